-- A command's envelope id, recorded in the transaction that applied it, with its answer: a copy of the
-- command (its caller sending it again after the reply was lost) finds it and gets the first's answer,
-- or awaits the first's saga, instead of applying again. The primary key makes two copies arriving at
-- once (at two replicas) take turns: the second's insert waits for the first's commit, then finds it.
-- `digest` is what the command asked (subject and body): an id reused for another command is refused.
-- Pruned after an hour, or RACKPLANE_RETENTION if shorter (prune.py).
CREATE TABLE command_replies (
    request_id  uuid PRIMARY KEY,
    digest      text NOT NULL,
    saga_id     uuid,
    instance_id uuid,
    reply       jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX command_replies_created_at ON command_replies (created_at);
