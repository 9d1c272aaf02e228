-- name: insert
INSERT INTO sagas (id, kind, params, data, status, cursor, trace) VALUES ($1, $2, $3, $4, 'running', 1, $5);

-- name: log
INSERT INTO saga_events (saga_id, step, event, detail) VALUES ($1, $2, $3, $4);

-- name: unfinished
SELECT id FROM sagas WHERE status IN ('running', 'unwinding') ORDER BY created_at;

-- name: load
SELECT id, kind, params, data, status, cursor, trace, error FROM sagas WHERE id = $1;

-- name: advance
-- Compare-and-set on (cursor, status): a saga only moves from where its runner saw it.
UPDATE sagas SET data = $2, status = $3, cursor = cursor + $4, updated_at = now()
WHERE id = $1 AND cursor = $5 AND status = $6;

-- name: unwind
UPDATE sagas SET status = 'unwinding', cursor = cursor - 1, error = $2, updated_at = now()
WHERE id = $1 AND status = 'running' AND cursor = $3;

-- name: error
SELECT error FROM sagas WHERE id = $1;
