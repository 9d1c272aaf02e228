-- What the broker checks hold the rack's messages against (broker.py): instance-manager's and recovery's
-- records. Read-only.

-- name: vmms_pruning_kept
-- Whether instance-manager keeps a pruning horizon (a schema from before pruning has none).
SELECT to_regclass('instance_manager.pruned_before');

-- name: vmms_pruned_before
SELECT at FROM instance_manager.pruned_before WHERE what = 'vmms';

-- name: expunged_sleds
SELECT id FROM instance_manager.sleds WHERE state = 'expunged';

-- name: vmm_records
SELECT id, sled_id, ended_at FROM instance_manager.vmms WHERE id = ANY($1::uuid[]);

-- name: now
SELECT now();

-- name: applied_inventories
-- The newest inventory of each sled that instance-manager and recovery have applied, and when.
SELECT 'instance-manager' AS service, id, state, boot_number, inventory_seq,
       last_seen_at AS applied_at
FROM instance_manager.sleds
UNION ALL
SELECT 'recovery', id, state, boot_number, inventory_seq,
       CASE WHEN isfinite(last_inventory_at) THEN last_inventory_at END
FROM recovery.sleds;

-- name: vmm_claims
SELECT id, instance_id, ended_at FROM instance_manager.vmms WHERE id = ANY($1::uuid[]);
