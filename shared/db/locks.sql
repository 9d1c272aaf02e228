-- name: try_lock
SELECT pg_try_advisory_lock(hashtext($1));

-- name: unlock
SELECT pg_advisory_unlock(hashtext($1));
