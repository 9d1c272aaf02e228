-- recovery keeps its own picture of the rack, built only from messages:
-- what the control plane expects (instance events) and what the sleds report (inventories).

CREATE TABLE instances (
    id              uuid PRIMARY KEY,
    silo            text NOT NULL,
    project         text NOT NULL,
    name            text NOT NULL,
    state           text NOT NULL,
    generation      bigint NOT NULL,
    auto_restart    text NOT NULL,
    active_vmm_id   uuid,
    sled_id         text,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX instances_by_sled ON instances (sled_id) WHERE active_vmm_id IS NOT NULL;

CREATE TABLE sleds (
    id                  text PRIMARY KEY,
    boot_id             uuid NOT NULL,
    vmms                jsonb NOT NULL DEFAULT '[]',
    last_inventory_at   timestamptz NOT NULL DEFAULT now()
);
