-- The bookkeeping of a schema's migrations (shared/db/migrations.py), on a connection whose search_path
-- is the schema.

-- name: lock
SELECT pg_advisory_lock(hashtext($1));

-- name: unlock
SELECT pg_advisory_unlock(hashtext($1));

-- name: can_become
-- Whether the login may SET ROLE to $1 (a schema's owner role, where roles are in force).
SELECT CASE WHEN to_regrole($1::text) IS NULL THEN false
ELSE pg_has_role(current_user, $1::name, 'MEMBER') END;

-- name: set_lock_timeout
SELECT set_config('lock_timeout', $1, false);

-- name: reset_lock_timeout
RESET lock_timeout;

-- name: reset_role
RESET ROLE;

-- name: may_create
SELECT CASE WHEN to_regnamespace($1::text) IS NULL THEN false
ELSE has_schema_privilege($1::text, 'CREATE') END;

-- name: current_user
SELECT current_user;

-- name: create_table
CREATE TABLE IF NOT EXISTS schema_migrations
(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now(), checksum text);

-- name: has_checksum
-- A schema_migrations made before checksums were kept has no such column.
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'schema_migrations'::regclass
AND attname = 'checksum' AND NOT attisdropped);

-- name: add_checksum
ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS checksum text;

-- name: table_exists
SELECT to_regclass('schema_migrations') IS NOT NULL;

-- name: recorded
-- to_jsonb: a table made before checksums were kept has no such column (read-only callers cannot add it).
SELECT name, applied_at, to_jsonb(m) ->> 'checksum' AS checksum FROM schema_migrations m;

-- name: record_checksum
UPDATE schema_migrations SET checksum = $2 WHERE name = $1 AND checksum IS NULL;

-- name: record
INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2);
