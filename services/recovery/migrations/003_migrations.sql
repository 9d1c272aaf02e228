-- An instance that is migrating runs on its active VMM and is expected on its target's sled too.
ALTER TABLE instances ADD COLUMN target_vmm_id uuid;
ALTER TABLE instances ADD COLUMN target_sled_id text;
ALTER TABLE instances ADD COLUMN target_vmm_boot_id uuid;
CREATE INDEX instances_target_vmm ON instances (target_vmm_id) WHERE target_vmm_id IS NOT NULL;
