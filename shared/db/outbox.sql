-- name: enqueue
INSERT INTO outbox (msg_id, subject, payload, headers) VALUES ($1, $2, $3, $4);

-- name: enqueue_many
-- WITH ORDINALITY keeps the given order in `seq`, which is the order the relay publishes in. $4: the
-- headers they share (the trace context; the relay adds each message's id from msg_id).
INSERT INTO outbox (msg_id, subject, payload, headers)
SELECT m, s, p, $4::jsonb
FROM unnest($1::uuid[], $2::text[], $3::bytea[]) WITH ORDINALITY AS u(m, s, p, n)
ORDER BY n;

-- name: claim
-- Oldest first; SKIP LOCKED lets several relays share one outbox without waiting on each other.
SELECT seq, msg_id, subject, payload, headers
FROM outbox ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED;

-- name: delete
DELETE FROM outbox WHERE seq = ANY($1::bigint[]);

-- name: pending
SELECT count(*) FROM outbox;
