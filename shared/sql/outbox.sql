-- name: enqueue
INSERT INTO outbox (msg_id, subject, payload, headers) VALUES ($1, $2, $3, $4);

-- name: enqueue_many
-- WITH ORDINALITY keeps the given order in `seq`, which is the order the relay publishes in.
INSERT INTO outbox (msg_id, subject, payload, headers)
SELECT m, s, p, h FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::jsonb[]) WITH ORDINALITY AS u(m, s, p, h, n)
ORDER BY n;

-- name: claim
-- Oldest first; SKIP LOCKED lets several relays share one outbox without waiting on each other.
SELECT seq, msg_id, subject, payload, headers
FROM outbox ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED;

-- name: delete
DELETE FROM outbox WHERE seq = ANY($1::bigint[]);

-- name: pending
SELECT count(*) FROM outbox;
