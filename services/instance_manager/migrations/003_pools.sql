-- Warm pools: per project, a shape and a target number of booted, idle VMs, handed to exactly one
-- customer each. A pool VM is an ordinary instance of the pool's project (charged like any other) with
-- pool_id set.
CREATE TABLE pools (
    id          uuid PRIMARY KEY,
    project_id  uuid NOT NULL REFERENCES projects (id),
    name        text NOT NULL,
    vcpus       int    NOT NULL CHECK (vcpus > 0),
    ram_bytes   bigint NOT NULL CHECK (ram_bytes > 0),
    disk_bytes  bigint NOT NULL CHECK (disk_bytes > 0),
    target_size int    NOT NULL CHECK (target_size BETWEEN 0 AND 1000),
    state       text   NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'deleted')),
    generation  bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX pools_live_name ON pools (project_id, name) WHERE state = 'active';

ALTER TABLE instances ADD COLUMN pool_id uuid REFERENCES pools (id);
-- When the instance's current VMM began to run (cleared when it ends). A pool VM is idle, ready to hand
-- out, when this is set and it holds no customer data: both durable fields, never a display state.
ALTER TABLE instances ADD COLUMN provisioned_at timestamptz;
-- Set once the VM may hold customer data: at create for an ordinary instance, in the very statement that
-- hands a pool VM out, or when a pool VM is destroyed unpicked. Never cleared. A VM with it set is never
-- handed out from a pool again.
ALTER TABLE instances ADD COLUMN has_customer_data_at timestamptz;
UPDATE instances SET has_customer_data_at = created_at;
CREATE INDEX instances_idle_in_pool ON instances (pool_id, provisioned_at)
    WHERE pool_id IS NOT NULL AND has_customer_data_at IS NULL;
