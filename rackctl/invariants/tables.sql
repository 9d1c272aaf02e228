-- What the database-only checks read (tables.py): every service's tables, read-only, across schemas.

-- name: silos_over_quota
SELECT name, vcpus, quota_vcpus, ram_bytes, quota_ram_bytes, disk_bytes, quota_disk_bytes
FROM accounting.silos
WHERE vcpus > quota_vcpus OR ram_bytes > quota_ram_bytes OR disk_bytes > quota_disk_bytes;

-- name: charged_state_without_vmm
-- An instance in a charged state ($1) without an active VMM, or one with an active VMM in another state.
SELECT id, name, state, active_vmm_id FROM instance_manager.instances
WHERE state <> 'creating' AND (state = ANY($1::text[])) <> (active_vmm_id IS NOT NULL)
ORDER BY id;

-- name: sled_reservations
SELECT s.id, s.reserved_vcpus, s.reserved_ram_bytes, s.vcpus, s.ram_bytes,
       coalesce(sum(v.vcpus), 0) AS v_vcpus, coalesce(sum(v.ram_bytes), 0) AS v_ram
FROM instance_manager.sleds s
LEFT JOIN instance_manager.vmms v ON v.sled_id = s.id AND v.ended_at IS NULL
GROUP BY s.id;

-- name: instances_with_two_live_vmms
SELECT v.instance_id, count(*) AS n
FROM instance_manager.vmms v JOIN instance_manager.instances i ON i.id = v.instance_id
WHERE v.ended_at IS NULL AND v.id IS DISTINCT FROM i.target_vmm_id
GROUP BY v.instance_id HAVING count(*) > 1;

-- name: claimed_vmms_not_live
SELECT i.id, c.role, c.vmm_id, v.instance_id AS owner, v.ended_at
FROM instance_manager.instances i
CROSS JOIN LATERAL (VALUES ('active', i.active_vmm_id), ('target', i.target_vmm_id))
    AS c(role, vmm_id)
LEFT JOIN instance_manager.vmms v ON v.id = c.vmm_id
WHERE c.vmm_id IS NOT NULL
  AND (v.id IS NULL OR v.ended_at IS NOT NULL OR v.instance_id IS DISTINCT FROM i.id);

-- name: unfinished_sagas
SELECT id, kind, status FROM instance_manager.sagas WHERE status IN ('running', 'unwinding');

-- name: saga_events_have_owner
-- Whether saga events name the process that ran them (false on a schema from before saga leases).
SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'instance_manager'
               AND table_name = 'saga_events' AND column_name = 'owner');

-- name: sagas_run_twice
WITH e AS (
    SELECT saga_id, seq, step, event, owner,
           lag(owner) OVER (PARTITION BY saga_id ORDER BY seq) AS before,
           min(seq) OVER (PARTITION BY saga_id, owner) AS owners_first
    FROM instance_manager.saga_events WHERE owner IS NOT NULL
), back AS (  -- an owner's run of steps that begins after another's, when it had had one before
    SELECT saga_id, owner, step, event, before FROM e
    WHERE before IS NOT NULL AND before <> owner AND owners_first < seq
), twice AS (
    SELECT saga_id, step, event, array_agg(DISTINCT owner ORDER BY owner) AS owners
    FROM e GROUP BY saga_id, step, event HAVING count(DISTINCT owner) > 1
)
SELECT s.kind, b.saga_id, format('%s ran %s (%s) after %s had taken over from it', b.owner,
                                 b.step, b.event, b.before) AS what
FROM back b JOIN instance_manager.sagas s ON s.id = b.saga_id
UNION ALL
SELECT s.kind, t.saga_id, format('%s (%s) recorded by %s', t.step, t.event,
                                 array_to_string(t.owners, ' and ')) AS what
FROM twice t JOIN instance_manager.sagas s ON s.id = t.saga_id
ORDER BY 2, 3;

-- name: totals_and_charges
SELECT 'project ' || id AS what, vcpus, ram_bytes, disk_bytes FROM accounting.projects
UNION ALL SELECT 'silo ' || name, vcpus, ram_bytes, disk_bytes FROM accounting.silos
UNION ALL SELECT 'charge of instance ' || instance_id, vcpus, ram_bytes, disk_bytes
    FROM accounting.instance_charges;

-- name: stuck_transitions
-- Instances starting, stopping or migrating for longer than $1 seconds.
SELECT id, name, state, extract(epoch FROM now() - updated_at) AS age
FROM instance_manager.instances
WHERE state IN ('starting', 'stopping', 'migrating')
  AND updated_at < now() - make_interval(secs => $1);

-- name: unclaimed_live_vmms
SELECT v.id, v.sled_id, v.state, v.instance_id, i.name, i.state AS instance_state
FROM instance_manager.vmms v
LEFT JOIN instance_manager.instances i ON i.id = v.instance_id
WHERE v.ended_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM instance_manager.instances c WHERE c.active_vmm_id = v.id)
  AND NOT EXISTS (SELECT 1 FROM instance_manager.instances c WHERE c.target_vmm_id = v.id)
ORDER BY v.id;

-- name: intent_overdue
-- Instances against their intent for longer than a reconcile pass ($1 s): running while meant to be
-- stopped; starting or migrating so past the transition timeout ($2 s); failed, meant to run and restarted
-- automatically, with a restart overdue (`due`: instance_view's rule, with cooldown $3 s and backoff
-- limit $4 s).
SELECT id, name, state, intended_state, extract(epoch FROM now() - updated_at) AS age, due,
       extract(epoch FROM now() - due) AS overdue
FROM instance_manager.instances i
CROSS JOIN LATERAL (
    SELECT CASE
        WHEN i.state = 'failed' AND i.auto_restart = 'best_effort' AND i.intended_state = 'running'
        THEN greatest(i.failed_at, i.last_auto_restart_at
                      + make_interval(secs => least($3 * 2 ^ least(i.restart_failures, 30),
                                                    greatest($3, $4))))
    END AS due) d
WHERE (intended_state = 'stopped' AND state = 'running'
       AND updated_at < now() - make_interval(secs => $1))
   OR (intended_state = 'stopped' AND state IN ('starting', 'migrating')
       AND updated_at < now() - make_interval(secs => $1 + $2))
   OR due < now() - make_interval(secs => $1)
ORDER BY id;

-- name: outbox_backlogs
-- Every service's outbox (each schema that has one) with the messages it holds: a table per schema, so
-- each is counted by a query made for it.
SELECT table_schema,
       (xpath('/row/n/text()',
              query_to_xml(format('SELECT count(*) AS n FROM %I.outbox', table_schema), false, true, '')
       ))[1]::text::bigint AS held
FROM information_schema.tables WHERE table_name = 'outbox' ORDER BY 1;

-- name: silo_counts_drifted
-- A silo's count of live instances (migration 015: folded, plus the changes not folded yet) against its
-- instances, where they differ.
SELECT s.name, coalesce(f.live, 0) + coalesce(c.changes, 0) AS counted, coalesce(i.live, 0) AS live
FROM instance_manager.silos s
LEFT JOIN instance_manager.silo_instance_counts f ON f.silo_id = s.id
LEFT JOIN (SELECT silo_id, sum(change) AS changes FROM instance_manager.silo_instance_changes GROUP BY silo_id) c
    ON c.silo_id = s.id
LEFT JOIN (
    SELECT p.silo_id, count(*) AS live
    FROM instance_manager.instances i JOIN instance_manager.projects p ON p.id = i.project_id
    WHERE i.state <> 'destroyed' GROUP BY p.silo_id
) i ON i.silo_id = s.id
WHERE coalesce(f.live, 0) + coalesce(c.changes, 0) <> coalesce(i.live, 0);
