-- name: command_claim
-- The first statement of a command's transaction: claim its envelope id ($1) for what it asks ($2).
-- Returns nothing when a copy already committed it (a copy in flight is waited for: the primary key),
-- which `command_record` then reads.
INSERT INTO command_replies (request_id, digest) VALUES ($1, $2)
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id;

-- name: command_record
-- What the first copy of command $1 recorded: what it asked, and its answer or its saga.
SELECT digest, saga_id, instance_id, reply FROM command_replies WHERE request_id = $1;

-- name: command_answered
-- The answer of command $1, in the transaction that applied it: its reply ($2), or its saga ($3) and the
-- instance the saga works on ($4).
UPDATE command_replies SET reply = $2, saga_id = $3, instance_id = $4 WHERE request_id = $1;

-- name: saga_status
-- Whether saga $1 is over (done, failed), still running or unwinding, or gone (pruned: long over).
SELECT status FROM sagas WHERE id = $1;
