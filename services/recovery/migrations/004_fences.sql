-- A sled's boots are ordered by their boot number, and its inventories by (boot number, sequence): an
-- inventory older than the one held (redelivered from before a reboot) changes nothing here. Each
-- instance keeps the boot numbers its VMMs were placed on, and when its next automatic restart is due
-- (as instance-manager computes it).
ALTER TABLE sleds ADD COLUMN boot_number bigint NOT NULL DEFAULT 0;
ALTER TABLE sleds ADD COLUMN inventory_seq bigint NOT NULL DEFAULT -1;
ALTER TABLE sleds ALTER COLUMN boot_id DROP NOT NULL;
ALTER TABLE instances ADD COLUMN vmm_boot_number bigint;
ALTER TABLE instances ADD COLUMN target_vmm_boot_number bigint;
ALTER TABLE instances ADD COLUMN next_restart_at timestamptz;
