-- The totals of every silo and project after each change, appended in the transaction that changed them
-- (services/accounting/history.py) and never updated: what usage was at any moment. The fleet's history
-- is derived from its silos' rows. `at` is taken once the silo's row is locked, so that for one silo
-- (and each of its projects) the order of `at` is the order of the changes.

CREATE TABLE usage_history (
    seq         bigserial PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    scope       text NOT NULL CHECK (scope IN ('silo', 'project')),
    id          uuid NOT NULL,
    silo_id     uuid NOT NULL,
    vcpus       bigint,
    ram_bytes   bigint,
    disk_bytes  bigint
);

CREATE INDEX usage_history_id_at ON usage_history (id, at);
