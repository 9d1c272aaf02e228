-- The charges instance-manager has sent and not yet heard the outcome of: an outcome is recorded only
-- for one of these (anything else is unsolicited, and dropped), and the row goes when it is.
CREATE TABLE pending_charges (
    instance_id uuid   NOT NULL,
    generation  bigint NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (instance_id, generation)
);
