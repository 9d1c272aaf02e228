-- The failures the control plane made, and the evidence each names (failures.py). Read-only.

-- name: reboot_failures
SELECT f.instance_id, i.name, f.vmm_id, f.sled_id, f.reason, f.vmm_boot_number,
       f.proof_boot_number, f.at
FROM instance_manager.failures f JOIN instance_manager.instances i ON i.id = f.instance_id
WHERE f.kind = 'rebooted'
ORDER BY f.seq;

-- name: stuck_start_failures
SELECT f.instance_id, f.vmm_id, f.sled_id, f.reason, f.proof_boot_number, f.proof_seq, f.at
FROM instance_manager.failures f
WHERE f.kind = 'stuck' AND (f.reason LIKE 'starting%' OR f.reason LIKE 'migrating%')
ORDER BY f.seq;
