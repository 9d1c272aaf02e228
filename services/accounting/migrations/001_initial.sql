-- accounting owns quotas, the per-instance charge ledger, and project, silo and fleet totals.
-- Totals can never go below zero: a CHECK says so, and the generation fence makes sure it never fires.

CREATE TABLE silos (
    id                  uuid PRIMARY KEY,
    name                text NOT NULL,
    quota_vcpus         bigint CHECK (quota_vcpus >= 0),
    quota_ram_bytes     bigint CHECK (quota_ram_bytes >= 0),
    quota_disk_bytes    bigint CHECK (quota_disk_bytes >= 0),
    vcpus               bigint NOT NULL DEFAULT 0 CHECK (vcpus >= 0),
    ram_bytes           bigint NOT NULL DEFAULT 0 CHECK (ram_bytes >= 0),
    disk_bytes          bigint NOT NULL DEFAULT 0 CHECK (disk_bytes >= 0)
);

CREATE TABLE projects (
    id          uuid PRIMARY KEY,
    silo_id     uuid NOT NULL REFERENCES silos (id),
    name        text,
    vcpus       bigint NOT NULL DEFAULT 0 CHECK (vcpus >= 0),
    ram_bytes   bigint NOT NULL DEFAULT 0 CHECK (ram_bytes >= 0),
    disk_bytes  bigint NOT NULL DEFAULT 0 CHECK (disk_bytes >= 0)
);

CREATE TABLE fleet (
    id          boolean PRIMARY KEY DEFAULT true CHECK (id),
    vcpus       bigint NOT NULL DEFAULT 0 CHECK (vcpus >= 0),
    ram_bytes   bigint NOT NULL DEFAULT 0 CHECK (ram_bytes >= 0),
    disk_bytes  bigint NOT NULL DEFAULT 0 CHECK (disk_bytes >= 0)
);
INSERT INTO fleet DEFAULT VALUES;

-- One row per instance, never deleted: it holds the generation fence. A deleted instance keeps a row
-- charged at zero, so that a late delta about it is recognised as stale instead of charging again.
CREATE TABLE instance_charges (
    instance_id uuid PRIMARY KEY,
    project_id  uuid NOT NULL REFERENCES projects (id),
    silo_id     uuid NOT NULL REFERENCES silos (id),
    generation  bigint NOT NULL DEFAULT 0,
    vcpus       bigint NOT NULL DEFAULT 0 CHECK (vcpus >= 0),
    ram_bytes   bigint NOT NULL DEFAULT 0 CHECK (ram_bytes >= 0),
    disk_bytes  bigint NOT NULL DEFAULT 0 CHECK (disk_bytes >= 0),
    -- the outcome of the delta at `generation`, repeated to whoever sends that delta again
    outcome     text NOT NULL DEFAULT 'applied',
    reason      text NOT NULL DEFAULT '',
    updated_at  timestamptz NOT NULL DEFAULT now()
);
