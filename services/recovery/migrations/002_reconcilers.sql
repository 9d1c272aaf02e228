-- What the reconcilers need to know: where each instance's VMM was placed and on which boot, what it
-- intends, when it failed and was last restarted; each sled's state; VMMs that sleds run unexpectedly.
ALTER TABLE instances ADD COLUMN intended_state text NOT NULL DEFAULT 'stopped';
ALTER TABLE instances ADD COLUMN vmm_boot_id uuid;
ALTER TABLE instances ADD COLUMN failed_at timestamptz;
ALTER TABLE instances ADD COLUMN last_auto_restart_at timestamptz;
ALTER TABLE instances ADD COLUMN changed_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX instances_failed ON instances (id) WHERE state = 'failed';
CREATE INDEX instances_active_vmm ON instances (active_vmm_id) WHERE active_vmm_id IS NOT NULL;

ALTER TABLE sleds ADD COLUMN state text NOT NULL DEFAULT 'active';

-- A VMM a sled runs that no instance expects: destroyed once it has been unexpected for a grace period
-- (long enough for the instance event that would explain it to arrive).
CREATE TABLE unexpected_vmms (
    vmm_id          uuid PRIMARY KEY,
    sled_id         text NOT NULL,
    first_seen_at   timestamptz NOT NULL DEFAULT now()
);
