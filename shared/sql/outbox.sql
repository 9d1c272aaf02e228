-- name: enqueue
INSERT INTO outbox (msg_id, subject, payload, headers) VALUES ($1, $2, $3, $4);

-- name: claim
-- Oldest first; SKIP LOCKED lets several relays share one outbox without waiting on each other.
SELECT seq, msg_id, subject, payload, headers
FROM outbox ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED;

-- name: delete
DELETE FROM outbox WHERE seq = ANY($1::bigint[]);

-- name: pending
SELECT count(*) FROM outbox;
