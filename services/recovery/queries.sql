-- name: instances_apply
-- A batch of instance events, one row per instance ($1 sorted by id: the newest event of each), in one
-- statement. Fenced by generation: an event older than what is held, or a repeat, changes nothing.
INSERT INTO instances (id, silo, project, name, state, generation, auto_restart, intended_state,
                       active_vmm_id, sled_id, vmm_boot_id, failed_at, last_auto_restart_at, changed_at,
                       target_vmm_id, target_sled_id, target_vmm_boot_id, vmm_boot_number,
                       target_vmm_boot_number, next_restart_at)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[],
                     $8::text[], $9::uuid[], $10::text[], $11::uuid[], $12::timestamptz[],
                     $13::timestamptz[], $14::timestamptz[], $15::uuid[], $16::text[], $17::uuid[],
                     $18::bigint[], $19::bigint[], $20::timestamptz[])
ORDER BY 1
ON CONFLICT (id) DO UPDATE
SET state = EXCLUDED.state, generation = EXCLUDED.generation, auto_restart = EXCLUDED.auto_restart,
    intended_state = EXCLUDED.intended_state, active_vmm_id = EXCLUDED.active_vmm_id,
    sled_id = EXCLUDED.sled_id, vmm_boot_id = EXCLUDED.vmm_boot_id, failed_at = EXCLUDED.failed_at,
    last_auto_restart_at = EXCLUDED.last_auto_restart_at, changed_at = EXCLUDED.changed_at,
    target_vmm_id = EXCLUDED.target_vmm_id, target_sled_id = EXCLUDED.target_sled_id,
    target_vmm_boot_id = EXCLUDED.target_vmm_boot_id, vmm_boot_number = EXCLUDED.vmm_boot_number,
    target_vmm_boot_number = EXCLUDED.target_vmm_boot_number, next_restart_at = EXCLUDED.next_restart_at,
    updated_at = now()
WHERE instances.generation < EXCLUDED.generation;

-- name: sleds_lock
-- The boots held for the sleds $1, locked in id order (those known: a new sled has no row yet).
SELECT id, boot_number FROM sleds WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE;

-- name: sleds_apply_inventories
-- The inventory fence, for one inventory per sled ($1 sorted): only a strictly newer (boot number,
-- sequence) is written; an older one (a redelivery from before a reboot) changes nothing. $5: each
-- sled's VMMs, as JSON text; $6: when the sled made each inventory. Returns the sleds written, with the
-- boot now held.
INSERT INTO sleds (id, boot_id, boot_number, inventory_seq, vmms, inventory_made_at)
SELECT u.id, u.boot_id, u.boot_number, u.seq, u.vmms::jsonb, u.made_at
FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[], $5::text[], $6::timestamptz[])
    AS u (id, boot_id, boot_number, seq, vmms, made_at)
ORDER BY 1
ON CONFLICT (id) DO UPDATE
SET boot_id = EXCLUDED.boot_id, boot_number = EXCLUDED.boot_number, inventory_seq = EXCLUDED.inventory_seq,
    vmms = EXCLUDED.vmms, inventory_made_at = EXCLUDED.inventory_made_at, last_inventory_at = now()
WHERE (sleds.boot_number, sleds.inventory_seq) < (EXCLUDED.boot_number, EXCLUDED.inventory_seq)
RETURNING id, boot_number;

-- name: sleds_state
-- A batch of sled events (instance-manager's view; one per sled, the latest) sets each sled's state; it
-- never moves a boot backwards, and leaves inventories alone.
INSERT INTO sleds (id, boot_id, boot_number, state, last_inventory_at)
SELECT u.id, u.boot_id, u.boot_number, u.state, '-infinity'
FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::text[]) AS u (id, boot_id, boot_number, state)
ORDER BY 1
ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state;

-- name: vmms_on_old_boots
-- Reconciler 1: VMMs placed on an earlier boot of their sled than the one its inventories now come from.
-- A sled that came back on a later boot has lost every VMM it ran: no timeout is needed to know it. A
-- migration target counts too. Each row is what the order names: the boots, and the generation seen.
SELECT i.id, i.generation, i.active_vmm_id AS vmm_id, i.sled_id, i.vmm_boot_number AS vmm_boot,
       s.boot_number AS sled_boot
FROM instances i JOIN sleds s ON s.id = i.sled_id
WHERE i.active_vmm_id IS NOT NULL AND i.vmm_boot_number < s.boot_number
UNION ALL
SELECT i.id, i.generation, i.target_vmm_id, i.target_sled_id, i.target_vmm_boot_number, s.boot_number
FROM instances i JOIN sleds s ON s.id = i.target_sled_id
WHERE i.target_vmm_id IS NOT NULL AND i.target_vmm_boot_number < s.boot_number
ORDER BY 1;

-- name: stuck
-- Reconciler 1: instances starting, stopping or migrating for longer than the timeout ($1 s), each with
-- the sled its awaited VMM is on (a migration's target's) and what that sled's latest inventory says:
-- whether it was made over the timeout after the instance's last change and after the VMM took the
-- state it lists there, by the sled's clock (`judged`: before that it is no evidence), and the VMM's
-- state in it (`shown`, NULL: not listed). Whether the sled has read its order yet, instance-manager
-- judges (it knows where the order waits on the stream). Only sleds that still answer (an
-- inventory fresher than $2 s): a sled that went quiet is left alone, its instances' health unknown, not
-- failed. The reconciler orders only those its picture judges stuck (orders.shows_awaited); a migration
-- that takes too long is called off by losing its target (the instance runs on where it was).
SELECT c.id, c.generation, c.state, c.vmm_id, c.vmm_sled_id,
       coalesce(s.inventory_made_at > c.changed_at + make_interval(secs => $1)
                AND s.inventory_made_at > coalesce(shown.since, '-infinity') + make_interval(secs => $1),
                false) AS judged,
       shown.state AS shown
FROM (
    SELECT i.id, i.generation, i.state, i.changed_at,
           CASE WHEN i.state = 'migrating' THEN i.target_vmm_id ELSE i.active_vmm_id END AS vmm_id,
           CASE WHEN i.state = 'migrating' THEN i.target_sled_id ELSE i.sled_id END AS vmm_sled_id
    FROM instances i
    WHERE ((i.state IN ('starting', 'stopping') AND i.active_vmm_id IS NOT NULL)
           OR (i.state = 'migrating' AND i.target_vmm_id IS NOT NULL))
      AND i.changed_at < now() - make_interval(secs => $1)
) c
JOIN sleds s ON s.id = c.vmm_sled_id
LEFT JOIN LATERAL (
    SELECT v ->> 'state' AS state, (v ->> 'since')::timestamptz AS since
    FROM jsonb_array_elements(s.vmms) v WHERE v ->> 'vmm_id' = c.vmm_id::text LIMIT 1
) shown ON true
WHERE s.last_inventory_at > now() - make_interval(secs => $2)
ORDER BY c.id;

-- name: unexpected_now
-- Reconciler 1: VMMs that a sled's latest inventory lists but that no instance expects.
SELECT s.id AS sled_id, (v ->> 'vmm_id')::uuid AS vmm_id
FROM sleds s, jsonb_array_elements(s.vmms) v
WHERE NOT EXISTS (SELECT 1 FROM instances i WHERE i.active_vmm_id = (v ->> 'vmm_id')::uuid)
  AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.target_vmm_id = (v ->> 'vmm_id')::uuid);

-- name: unexpected_note
INSERT INTO unexpected_vmms (vmm_id, sled_id) SELECT * FROM unnest($1::uuid[], $2::text[])
ON CONFLICT (vmm_id) DO NOTHING;

-- name: unexpected_forget
-- Those no longer listed, or expected after all.
DELETE FROM unexpected_vmms WHERE NOT (vmm_id = ANY($1::uuid[]));

-- name: zombies
SELECT vmm_id, sled_id FROM unexpected_vmms WHERE first_seen_at < now() - make_interval(secs => $1);

-- name: failed
-- Reconciler 2: every failed instance, with what decides its fate (next_restart_at is set, by
-- instance-manager, for one that is to be restarted: when the cooldown and any backoff have passed).
SELECT id, generation, auto_restart, intended_state, next_restart_at
FROM instances WHERE state = 'failed' ORDER BY failed_at;
