-- Orders are conditions. A sled's boot number only grows and orders its boots; with a sequence number
-- within the boot it orders its inventories, so that a redelivered old one changes nothing. A VMM
-- remembers the boot it was placed on. Every failure the control plane makes keeps its evidence.
ALTER TABLE sleds ADD COLUMN boot_number bigint;
ALTER TABLE sleds ADD COLUMN inventory_seq bigint;
ALTER TABLE vmms ADD COLUMN boot_number bigint;

-- Consecutive automatic restarts that could not place or charge the instance: the next try backs off.
ALTER TABLE instances ADD COLUMN restart_failures int NOT NULL DEFAULT 0;

CREATE TABLE failures (
    seq                 bigserial PRIMARY KEY,
    instance_id         uuid NOT NULL,
    vmm_id              uuid NOT NULL,
    sled_id             text NOT NULL,
    -- rebooted: the sled came back on a later boot; stuck: a transition past its timeout; expunged: the
    -- sled was taken out of the rack; vmm: the sled itself reported the VMM failed
    kind                text NOT NULL CHECK (kind IN ('rebooted', 'stuck', 'expunged', 'vmm')),
    reason              text NOT NULL,
    vmm_boot_number     bigint,
    proof_boot_number   bigint,
    at                  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX failures_by_instance ON failures (instance_id);

-- Who claims a VMM, asked under lock before a zombie is destroyed.
CREATE INDEX instances_active_vmm ON instances (active_vmm_id) WHERE active_vmm_id IS NOT NULL;
CREATE INDEX instances_target_vmm ON instances (target_vmm_id) WHERE target_vmm_id IS NOT NULL;
