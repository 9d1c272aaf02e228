-- name: insert
-- A saga whose first steps are done ($6: their names, in order; logged as done), in one statement; returns
-- the saga as it now is. Its lease is its creator's ($7, for $8 seconds), so that no other process
-- resumes it before its creator launches it. Its cursor is how many steps are done.
WITH saga AS (
    INSERT INTO sagas (id, kind, params, data, status, cursor, trace, lease_owner, lease_until)
    VALUES ($1, $2, $3, $4, 'running', cardinality($6::text[]), $5, $7, now() + make_interval(secs => $8))
    RETURNING id, kind, params, data, status, cursor, trace, error
), logged AS (
    INSERT INTO saga_events (saga_id, step, event, detail, owner)
    SELECT saga.id, done.step, 'done', NULL, $7
    FROM saga, unnest($6::text[]) WITH ORDINALITY AS done (step, n)
    ORDER BY done.n
)
SELECT * FROM saga;

-- name: unfinished
-- Unfinished sagas no live process runs: the lease is free, expired, or this process's own ($1).
SELECT id FROM sagas
WHERE status IN ('running', 'unwinding')
  AND (lease_owner IS NULL OR lease_owner = $1 OR lease_until < now())
ORDER BY created_at;

-- name: lease_take
-- Take the lease of saga $1 for process $2 ($3 seconds), only if it is free, expired or already ours.
-- Returns nothing when another process holds it, or the row is locked: its holder is committing a step
-- under the lease (lease_fence), and the lease stays with it.
UPDATE sagas SET lease_owner = $2, lease_until = now() + make_interval(secs => $3)
WHERE id = (
    SELECT id FROM sagas
    WHERE id = $1 AND status IN ('running', 'unwinding')
      AND (lease_owner IS NULL OR lease_owner = $2 OR lease_until < now())
    FOR NO KEY UPDATE SKIP LOCKED
)
RETURNING id;

-- name: lease
-- Whether saga $1, unfinished, has its lease free, expired or held by process $2 (read without a lock):
-- when lease_take found its row locked, whether to try again.
SELECT lease_owner IS NULL OR lease_owner = $2 OR lease_until < now() AS ours_or_free
FROM sagas WHERE id = $1 AND status IN ('running', 'unwinding');

-- name: leases_renew
-- Every unfinished saga process $1 holds runs on for $2 seconds more. Rows locked right now (a step of
-- ours committing, which renews its own; or another process taking an expired lease) are skipped.
UPDATE sagas SET lease_until = now() + make_interval(secs => $2)
WHERE id IN (
    SELECT id FROM sagas
    WHERE lease_owner = $1 AND status IN ('running', 'unwinding')
    FOR NO KEY UPDATE SKIP LOCKED
);

-- name: leases_release
-- Process $1 stops: what it held may be resumed by another process at once, not once its leases expire.
UPDATE sagas SET lease_owner = NULL, lease_until = NULL
WHERE lease_owner = $1 AND status IN ('running', 'unwinding');

-- name: lease_fence
-- The first statement of a step's transaction: the rows of sagas $1, locked, those process $2 holds the
-- lease of (returned). Nobody can take their leases until this transaction ends, and a process that
-- lost a lease commits nothing of that saga (not returned: its steps are left out, or rolled back).
SELECT id FROM sagas WHERE id = ANY($1::uuid[]) AND lease_owner = $2 ORDER BY id FOR NO KEY UPDATE;

-- name: load
SELECT id, kind, params, data, status, cursor, trace, error FROM sagas WHERE id = $1;

-- name: advance
-- Compare-and-set on (cursor, status), for sagas $1 at once (each with its new data $2, status $3, and
-- the move of its cursor $4, from the cursor $5 and status $6 its runner saw), fenced by the lease ($9:
-- this process): a saga only moves from where its runner saw it, and only by the process holding its
-- lease, which it renews ($10 seconds). The steps' events ($7: the saga of each, $8: its step, in order;
-- event $11) are logged in the same statement, with their owner; returns the sagas as they now are
-- (one missing: it had moved, or the lease is another's).
WITH moved AS (
    UPDATE sagas s SET data = u.data, status = u.status, cursor = s.cursor + u.move, updated_at = now(),
                       lease_until = now() + make_interval(secs => $10)
    FROM unnest($1::uuid[], $2::jsonb[], $3::text[], $4::int[], $5::int[], $6::text[])
         AS u (id, data, status, move, seen_cursor, seen_status)
    WHERE s.id = u.id AND s.cursor = u.seen_cursor AND s.status = u.seen_status AND s.lease_owner = $9
    RETURNING s.id, s.kind, s.params, s.data, s.status, s.cursor, s.trace, s.error
), logged AS (
    INSERT INTO saga_events (saga_id, step, event, detail, owner)
    SELECT e.saga_id, e.step, $11, NULL, $9
    FROM unnest($7::uuid[], $8::text[]) WITH ORDINALITY AS e (saga_id, step, n)
    WHERE e.saga_id IN (SELECT id FROM moved)
    ORDER BY e.n
)
SELECT * FROM moved;

-- name: unwind
-- A step failed: the saga unwinds from the step before it, fenced like `advance`, and the failure is
-- logged with its owner ($4). Returns nothing if the saga moved or its lease is another's.
WITH moved AS (
    UPDATE sagas SET status = 'unwinding', cursor = cursor - 1, error = $2, updated_at = now()
    WHERE id = $1 AND status = 'running' AND cursor = $3 AND lease_owner = $4
    RETURNING id
), logged AS (
    INSERT INTO saga_events (saga_id, step, event, detail, owner) SELECT id, $5, 'failed', $2, $4 FROM moved
)
SELECT id FROM moved;

-- name: error
SELECT error FROM sagas WHERE id = $1;
