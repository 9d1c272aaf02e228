-- name: instance_upsert
-- Fenced by generation: an event older than what is held changes nothing.
INSERT INTO instances (id, silo, project, name, state, generation, auto_restart, active_vmm_id, sled_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (id) DO UPDATE
SET state = EXCLUDED.state, generation = EXCLUDED.generation, auto_restart = EXCLUDED.auto_restart,
    active_vmm_id = EXCLUDED.active_vmm_id, sled_id = EXCLUDED.sled_id, updated_at = now()
WHERE instances.generation < EXCLUDED.generation;

-- name: sled_upsert
INSERT INTO sleds (id, boot_id, vmms) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE SET boot_id = EXCLUDED.boot_id, vmms = EXCLUDED.vmms, last_inventory_at = now();

-- name: discrepancies
-- Instances the control plane expects on a sled whose latest inventory does not list their VMM.
SELECT i.id, i.silo, i.project, i.name, i.sled_id, i.active_vmm_id
FROM instances i JOIN sleds s ON s.id = i.sled_id
WHERE i.active_vmm_id IS NOT NULL AND i.state IN ('running', 'stopping')
  AND NOT EXISTS (
      SELECT 1 FROM jsonb_array_elements(s.vmms) v WHERE (v ->> 'vmm_id')::uuid = i.active_vmm_id
  );
