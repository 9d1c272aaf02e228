-- instance-manager owns silos, projects, instances, sleds, VMMs and the saga log.

CREATE TABLE silos (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    quota       jsonb NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE projects (
    id          uuid PRIMARY KEY,
    silo_id     uuid NOT NULL REFERENCES silos (id),
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (silo_id, name)
);

CREATE TABLE sleds (
    id                  text PRIMARY KEY,
    state               text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'expunged')),
    boot_id             uuid,
    vcpus               int    NOT NULL CHECK (vcpus > 0),
    ram_bytes           bigint NOT NULL CHECK (ram_bytes > 0),
    reserved_vcpus      int    NOT NULL DEFAULT 0,
    reserved_ram_bytes  bigint NOT NULL DEFAULT 0,
    last_seen_at        timestamptz,
    CHECK (reserved_vcpus BETWEEN 0 AND vcpus),
    CHECK (reserved_ram_bytes BETWEEN 0 AND ram_bytes)
);

CREATE TABLE instances (
    id              uuid PRIMARY KEY,
    project_id      uuid NOT NULL REFERENCES projects (id),
    name            text NOT NULL,
    vcpus           int    NOT NULL CHECK (vcpus > 0),
    ram_bytes       bigint NOT NULL CHECK (ram_bytes > 0),
    disk_bytes      bigint NOT NULL CHECK (disk_bytes > 0),
    auto_restart    text NOT NULL CHECK (auto_restart IN ('best_effort', 'never')),
    state           text NOT NULL CHECK (state IN
                        ('creating', 'stopped', 'starting', 'running', 'stopping', 'migrating', 'failed', 'destroyed')),
    -- Bumped by every change; every message derived from the instance carries it, and accounting
    -- applies a charge only for a generation newer than the one it holds.
    generation      bigint NOT NULL DEFAULT 1,
    -- The "one start at a time" interlock: set by compare-and-set when a start begins, cleared when
    -- the VMM ends. An instance runs on at most this one VMM (outside a migration).
    active_vmm_id   uuid,
    intended_state  text NOT NULL DEFAULT 'stopped' CHECK (intended_state IN ('running', 'stopped')),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX instances_live_name ON instances (project_id, name) WHERE state <> 'destroyed';
CREATE INDEX instances_state ON instances (state) WHERE state <> 'destroyed';

CREATE TABLE vmms (
    id          uuid PRIMARY KEY,
    instance_id uuid NOT NULL REFERENCES instances (id),
    sled_id     text NOT NULL REFERENCES sleds (id),
    vcpus       int    NOT NULL,
    ram_bytes   bigint NOT NULL,
    state       text NOT NULL CHECK (state IN ('starting', 'running', 'stopping', 'stopped', 'failed', 'destroyed')),
    -- The sled's generation for this VMM: only a strictly newer report is written.
    generation  bigint NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz
);
CREATE INDEX vmms_live_by_sled ON vmms (sled_id) WHERE ended_at IS NULL;
CREATE INDEX vmms_by_instance ON vmms (instance_id);

-- Durable sagas: one row a saga, its progress logged in saga_events.
CREATE TABLE sagas (
    id          uuid PRIMARY KEY,
    kind        text NOT NULL,
    params      jsonb NOT NULL,
    data        jsonb NOT NULL DEFAULT '{}',
    status      text NOT NULL CHECK (status IN ('running', 'unwinding', 'done', 'failed')),
    -- index of the next step to run forward, or of the next step to undo when unwinding
    cursor      int NOT NULL DEFAULT 0,
    error       text,
    trace       jsonb NOT NULL DEFAULT '{}',
    lease_owner text,
    lease_until timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sagas_unfinished ON sagas (status) WHERE status IN ('running', 'unwinding');

CREATE TABLE saga_events (
    saga_id     uuid NOT NULL REFERENCES sagas (id),
    seq         bigserial,
    step        text NOT NULL,
    event       text NOT NULL CHECK (event IN ('done', 'failed', 'undone')),
    detail      text,
    at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (saga_id, seq)
);

-- Charge outcomes from accounting, as they arrive: a start saga waits here for its charge.
CREATE TABLE charge_outcomes (
    instance_id uuid   NOT NULL,
    generation  bigint NOT NULL,
    outcome     text   NOT NULL,
    reason      text   NOT NULL DEFAULT '',
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (instance_id, generation)
);
