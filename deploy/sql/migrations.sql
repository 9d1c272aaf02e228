-- name: search_path
-- `python -m deploy.migrations --status` reads every schema on one connection, one after another.
SELECT set_config('search_path', $1, false);
