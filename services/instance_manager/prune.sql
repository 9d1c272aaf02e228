-- name: cutoff
-- Rows finished before this (now, by the database's clock, less the retention of $1 seconds) may go.
SELECT now() - make_interval(secs => $1);

-- name: sagas_finished
-- Finished sagas (done, or failed once unwound) last changed before $1; $2 at most. An unfinished saga
-- is never pruned.
SELECT id FROM sagas
WHERE status IN ('done', 'failed') AND updated_at < $1
ORDER BY updated_at
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: saga_events_delete
DELETE FROM saga_events WHERE saga_id = ANY($1::uuid[]);

-- name: sagas_delete
DELETE FROM sagas WHERE id = ANY($1::uuid[]) AND status IN ('done', 'failed');

-- name: charge_outcomes_delete
-- Outcomes received before $1, $2 at most, except each instance's latest one and every outcome of an
-- instance an unfinished saga works on: a saga's charge step reads its outcome again after a crash,
-- and would send the charge anew if it were gone.
DELETE FROM charge_outcomes
WHERE (instance_id, generation) IN (
    SELECT o.instance_id, o.generation FROM charge_outcomes o
    WHERE o.received_at < $1
      AND EXISTS (SELECT 1 FROM charge_outcomes n
                  WHERE n.instance_id = o.instance_id AND n.generation > o.generation)
      AND NOT EXISTS (SELECT 1 FROM sagas s
                      WHERE s.status IN ('running', 'unwinding')
                        AND s.params ->> 'instance_id' = o.instance_id::text)
    LIMIT $2
);

-- name: vmms_horizon
-- Said before any record that ended before $1 is deleted, and never moved back.
INSERT INTO pruned_before (what, at) VALUES ('vmms', $1)
ON CONFLICT (what) DO UPDATE SET at = greatest(pruned_before.at, EXCLUDED.at);

-- name: vmms_delete
-- VMM records that ended before $1, $2 at most, except each instance's latest one, any an instance
-- names (active or migration target), and any an unfinished saga names: its steps and undos look the
-- record up again (ensure_on_sled, place_undo, end_unclaimed_vmm), and a missing one would release its
-- reservation twice. Nothing references a VMM record by foreign key.
DELETE FROM vmms
WHERE id IN (
    SELECT v.id FROM vmms v
    WHERE v.ended_at < $1
      AND EXISTS (SELECT 1 FROM vmms n
                  WHERE n.instance_id = v.instance_id AND (n.created_at, n.id) > (v.created_at, v.id))
      AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.active_vmm_id = v.id)
      AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.target_vmm_id = v.id)
      AND NOT EXISTS (SELECT 1 FROM sagas s
                      WHERE s.status IN ('running', 'unwinding')
                        AND v.id::text IN (s.data ->> 'vmm_id', s.data ->> 'source_vmm_id'))
    LIMIT $2
    FOR UPDATE OF v SKIP LOCKED
);

-- name: command_replies_delete
-- Commands' recorded answers made before $1 (an hour ago: prune.REPLIES_KEPT), $2 at most: a caller
-- sends a command again within its own timeout, seconds after the first.
DELETE FROM command_replies
WHERE request_id IN (SELECT request_id FROM command_replies WHERE created_at < $1 LIMIT $2);

-- name: silos_with_instance_changes
-- Silos whose instance count has changes not folded yet (migration 015), $1 at most.
SELECT DISTINCT silo_id FROM silo_instance_changes LIMIT $1;

-- name: silo_lock_to_fold
-- The silo's row, locked as a create locks it (silo_lock_limits), unless a create holds it: that create
-- folds the silo's changes itself.
SELECT id FROM silos WHERE id = $1 FOR NO KEY UPDATE SKIP LOCKED;
