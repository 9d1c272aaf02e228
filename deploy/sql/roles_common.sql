-- Database-wide rules and the read-only role of `rackctl check`, applied once per database by an
-- administrator. Variables in psql's syntax (deploy/dbroles.py substitutes them, or `psql -v`):
--   checker            the read-only login role
--   checker_password   its password (stored as a SCRAM-SHA-256 verifier)
--   database           the database (the one the administrator is connected to)

-- Nobody but an owner creates anything: the public schema is not a shared scratch space, and no login
-- makes temporary tables (no service uses them), so the read-only login, which may turn its session's
-- read-only setting off, still has nothing it may write.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
REVOKE TEMPORARY ON DATABASE :"database" FROM PUBLIC;
-- Large objects: any role may create them by default, in a session it has made read-write; no service
-- uses them.
REVOKE EXECUTE ON FUNCTION lo_creat(integer), lo_create(oid), lo_from_bytea(oid, bytea) FROM PUBLIC;

CREATE ROLE :"checker" LOGIN;
ALTER ROLE :"checker" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS
    PASSWORD :'checker_password';
-- A second lock on the door, not the first: a session may set this off again (`SET transaction_read_only
-- = off`), so what keeps the checker from writing is that it holds SELECT and USAGE only, and no TEMP.
ALTER ROLE :"checker" SET default_transaction_read_only = on;
REVOKE TEMPORARY ON DATABASE :"database" FROM :"checker";
