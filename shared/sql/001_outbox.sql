-- The transactional outbox: a message that follows a database change is written in the same transaction
-- as the change, and published by the relay after commit, so that neither can happen without the other.
CREATE TABLE outbox (
    seq         bigserial PRIMARY KEY,
    msg_id      uuid        NOT NULL,
    subject     text        NOT NULL,
    payload     bytea       NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now()
);
