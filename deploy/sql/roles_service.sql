-- One service's roles and schema, applied by an administrator for each service that keeps state.
-- Variables in psql's syntax (deploy/dbroles.py substitutes them, or `psql -v`):
--   schema        the service's schema
--   owner         NOLOGIN role that owns the schema and everything in it; migrations run as it
--   app           the service's login role: DML on its own schema only
--   app_password  its password (stored as a SCRAM-SHA-256 verifier)
--   checker       the read-only role of `rackctl check` (roles_common.sql)
--
-- Migrations: `app` is a member of `owner` without inheriting its rights (NOINHERIT), so its sessions
-- have only the DML granted below until shared/db/migrations.py's migrate() says `SET ROLE owner`, and `RESET ROLE`
-- when done. The most a stolen `app` password gains is DDL on its own schema, never another's.

CREATE ROLE :"owner" NOLOGIN;
ALTER ROLE :"owner" NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
CREATE ROLE :"app" LOGIN;
ALTER ROLE :"app" LOGIN NOINHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS
    PASSWORD :'app_password';
GRANT :"owner" TO :"app";
-- A service's machine that vanishes (no FIN, no RST) would leave its backends, and their locks, for the
-- kernel's two hours: keepalives find the dead peer in about 11 s, and a session idle inside a
-- transaction for a minute (a frozen process) is ended, its locks released.
ALTER ROLE :"app" SET tcp_keepalives_idle = 5;
ALTER ROLE :"app" SET tcp_keepalives_interval = 2;
ALTER ROLE :"app" SET tcp_keepalives_count = 3;
ALTER ROLE :"app" SET idle_in_transaction_session_timeout = '1min';

CREATE SCHEMA IF NOT EXISTS :"schema" AUTHORIZATION :"owner";
ALTER SCHEMA :"schema" OWNER TO :"owner";
REVOKE ALL ON SCHEMA :"schema" FROM PUBLIC;

GRANT USAGE ON SCHEMA :"schema" TO :"app";
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA :"schema" TO :"app";
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA :"schema" TO :"app";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"app";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO :"app";

GRANT USAGE ON SCHEMA :"schema" TO :"checker";
GRANT SELECT ON ALL TABLES IN SCHEMA :"schema" TO :"checker";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema" GRANT SELECT ON TABLES TO :"checker";
