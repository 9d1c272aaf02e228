-- name: pool_insert
-- Only into project $2 while it lives, as instance_insert (queries.sql): a pool create racing a
-- `project delete` waits for it, then inserts nothing.
INSERT INTO pools (id, project_id, name, vcpus, ram_bytes, disk_bytes, target_size)
SELECT $1::uuid, p.id, $3::text, $4::int, $5::bigint, $6::bigint, $7::int
FROM projects p WHERE p.id = $2 AND p.deleted_at IS NULL
FOR KEY SHARE OF p;

-- name: pool_by_name
SELECT pl.id FROM pools pl
JOIN projects p ON p.id = pl.project_id JOIN silos s ON s.id = p.silo_id
WHERE s.name = $1 AND p.name = $2 AND pl.name = $3 AND pl.state = 'active';

-- name: pool_view
-- Pools $1 (in that order) with their members counted: idle (booted, never handed out), provisioning
-- (on the way), handed out (picked, now a customer's instance).
SELECT pl.id, s.name AS silo, p.name AS project, pl.name, pl.vcpus, pl.ram_bytes, pl.disk_bytes,
       pl.target_size, pl.state, pl.generation, pl.project_id, s.id AS silo_id,
       count(i.id) FILTER (WHERE i.has_customer_data_at IS NULL AND i.provisioned_at IS NOT NULL
                           AND i.intended_state = 'running') AS idle,
       count(i.id) FILTER (WHERE i.has_customer_data_at IS NULL AND i.provisioned_at IS NULL
                           AND i.intended_state = 'running') AS provisioning,
       count(i.id) FILTER (WHERE i.has_customer_data_at IS NOT NULL) AS handed_out
FROM pools pl
JOIN projects p ON p.id = pl.project_id JOIN silos s ON s.id = p.silo_id
LEFT JOIN instances i ON i.pool_id = pl.id AND i.state <> 'destroyed'
JOIN unnest($1::uuid[]) WITH ORDINALITY AS wanted (id, n) ON wanted.id = pl.id
GROUP BY pl.id, s.name, p.name, s.id, wanted.n
ORDER BY wanted.n;

-- name: pool_page
-- A page of pools (of silo $1, project $2, or all) after (silo, project, name) ($3, $4, $5), $6 at most
-- (and one more, to tell whether another page follows).
SELECT pl.id, s.name AS silo, p.name AS project, pl.name
FROM pools pl JOIN projects p ON p.id = pl.project_id JOIN silos s ON s.id = p.silo_id
WHERE pl.state = 'active' AND ($1::text IS NULL OR s.name = $1) AND ($2::text IS NULL OR p.name = $2)
  AND ($3::text IS NULL OR (s.name, p.name, pl.name) > ($3, $4, $5))
ORDER BY s.name, p.name, pl.name
LIMIT $6 + 1;

-- name: pool_resize
UPDATE pools SET target_size = $2, generation = generation + 1, updated_at = now()
WHERE id = $1 AND state = 'active';

-- name: pool_delete
UPDATE pools SET state = 'deleted', target_size = 0, generation = generation + 1, updated_at = now()
WHERE id = $1 AND state = 'active';

-- name: pick
-- Hand out one idle VM of pool $1: claim it, rename it ($2) and mark it as holding customer data, all in
-- this one statement. SKIP LOCKED passes over a VM another pick is claiming right now, so concurrent
-- picks never wait on each other, never take the same VM, and never lock the rest of the pool; a VM
-- already marked can never qualify again.
WITH candidate AS (
    SELECT id FROM instances
    WHERE pool_id = $1
      AND has_customer_data_at IS NULL
      AND provisioned_at IS NOT NULL
      AND intended_state = 'running'
    ORDER BY provisioned_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE instances i
SET name = $2, auto_restart = $3, has_customer_data_at = now(),
    generation = i.generation + 1, updated_at = now()
FROM candidate
WHERE i.id = candidate.id
RETURNING i.id;

-- name: members
-- The pool's own VMs (not handed out, not destroyed), for the keeper.
SELECT id, name, state, intended_state, provisioned_at
FROM instances
WHERE pool_id = $1 AND has_customer_data_at IS NULL AND state <> 'destroyed'
ORDER BY provisioned_at DESC NULLS FIRST, created_at DESC;

-- name: pools_to_keep
SELECT id FROM pools WHERE state = 'active'
UNION
SELECT DISTINCT pool_id FROM instances
WHERE pool_id IS NOT NULL AND has_customer_data_at IS NULL AND state <> 'destroyed';
