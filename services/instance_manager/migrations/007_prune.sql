-- Pruning (prune.py): indexes that find old rows without reading whole tables, and how far ended VMM
-- records have been pruned (the checker reads it: a record that ended before then may be gone).
CREATE INDEX sagas_finished ON sagas (updated_at) WHERE status IN ('done', 'failed');
CREATE INDEX charge_outcomes_received ON charge_outcomes (received_at);
CREATE INDEX vmms_ended ON vmms (ended_at) WHERE ended_at IS NOT NULL;

CREATE TABLE pruned_before (
    what    text PRIMARY KEY,
    at      timestamptz NOT NULL
);
