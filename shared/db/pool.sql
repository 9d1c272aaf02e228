-- name: schema_exists
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1);
