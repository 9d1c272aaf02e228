-- name: insert
-- A saga whose first step is done, with that step's event ($6), in one statement.
WITH saga AS (
    INSERT INTO sagas (id, kind, params, data, status, cursor, trace) VALUES ($1, $2, $3, $4, 'running', 1, $5)
    RETURNING id
)
INSERT INTO saga_events (saga_id, step, event, detail) SELECT id, $6, 'done', NULL FROM saga;

-- name: log
INSERT INTO saga_events (saga_id, step, event, detail) VALUES ($1, $2, $3, $4);

-- name: unfinished
SELECT id FROM sagas WHERE status IN ('running', 'unwinding') ORDER BY created_at;

-- name: load
SELECT id, kind, params, data, status, cursor, trace, error FROM sagas WHERE id = $1;

-- name: advance
-- Compare-and-set on (cursor, status): a saga only moves from where its runner saw it. The step's event
-- ($7, $8) is logged in the same statement; returns the saga as it now is (none: it had moved).
WITH moved AS (
    UPDATE sagas SET data = $2, status = $3, cursor = cursor + $4, updated_at = now()
    WHERE id = $1 AND cursor = $5 AND status = $6
    RETURNING id, kind, params, data, status, cursor, trace, error
), logged AS (
    INSERT INTO saga_events (saga_id, step, event, detail) SELECT id, $7, $8, NULL FROM moved
)
SELECT * FROM moved;

-- name: unwind
UPDATE sagas SET status = 'unwinding', cursor = cursor - 1, error = $2, updated_at = now()
WHERE id = $1 AND status = 'running' AND cursor = $3;

-- name: error
SELECT error FROM sagas WHERE id = $1;
