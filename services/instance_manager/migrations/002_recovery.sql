-- What recovery needs from instance-manager: which boot of its sled a VMM was placed on (a VMM cannot
-- outlive a reboot), when an instance failed, and how often it was restarted automatically.
ALTER TABLE vmms ADD COLUMN boot_id uuid;
ALTER TABLE instances ADD COLUMN failed_at timestamptz;
ALTER TABLE instances ADD COLUMN auto_restarts int NOT NULL DEFAULT 0;
ALTER TABLE instances ADD COLUMN last_auto_restart_at timestamptz;
