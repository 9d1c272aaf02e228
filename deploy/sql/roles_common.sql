-- Database-wide rules and the read-only role of `rackctl check`, applied once per database by an
-- administrator. Variables in psql's syntax (deploy/dbroles.py substitutes them, or `psql -v`):
--   checker            the read-only login role
--   checker_password   its password (stored as a SCRAM-SHA-256 verifier)

-- Nobody but an owner creates anything: the public schema is not a shared scratch space.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;

CREATE ROLE :"checker" LOGIN;
ALTER ROLE :"checker" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS
    PASSWORD :'checker_password';
-- A second lock on the door: even a grant given by mistake cannot make its sessions write.
ALTER ROLE :"checker" SET default_transaction_read_only = on;
