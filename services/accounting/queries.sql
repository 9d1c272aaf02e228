-- name: silo_upsert
INSERT INTO silos (id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO NOTHING;

-- name: project_upsert
INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE SET name = coalesce(EXCLUDED.name, projects.name);

-- name: silos_of
SELECT id, name FROM silos WHERE id = ANY($1::uuid[]);

-- name: projects_of
SELECT p.id, p.silo_id, p.name, s.name AS silo_name
FROM projects p JOIN silos s ON s.id = p.silo_id WHERE p.id = ANY($1::uuid[]);

-- name: charges_ensure
-- An instance seen for the first time gets its row, charged at zero, owned by its first delta's project.
-- Inserted in key order: a row inserted is held until commit, and two batches inserting the same new
-- instances in different orders would deadlock.
INSERT INTO instance_charges (instance_id, project_id, silo_id)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[]) AS u (instance_id, project_id, silo_id)
ORDER BY u.instance_id
ON CONFLICT (instance_id) DO NOTHING;

-- name: charges_lock
-- Concurrent batches touching one instance serialize here; locking in key order keeps them from
-- deadlocking. (Locked in its own statement: a FOR UPDATE in the same statement as an upsert skips the
-- rows the upsert touches.)
-- `told`: the outcome at `generation` was decided less than $2 seconds ago (half the broker's duplicate
-- window), so the broker still holds its message id and would drop a resend.
SELECT instance_id, project_id, silo_id, generation, vcpus, ram_bytes, disk_bytes, outcome, reason,
       updated_at > now() - make_interval(secs => $2) AS told
FROM instance_charges WHERE instance_id = ANY($1::uuid[]) ORDER BY instance_id FOR UPDATE;

-- name: silos_lock
-- Taken after the instances' rows, in key order: the totals and quotas the batch decides against.
-- NO KEY UPDATE, the lock its UPDATE takes anyway: a FOR UPDATE would wait on the KEY SHARE locks that
-- other batches' charges_ensure take on the silo through the foreign key, while they wait on this one.
SELECT id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos WHERE id = ANY($1::uuid[]) ORDER BY id FOR NO KEY UPDATE;

-- name: charges_set
UPDATE instance_charges c
SET generation = u.generation, vcpus = u.vcpus, ram_bytes = u.ram_bytes, disk_bytes = u.disk_bytes,
    outcome = u.outcome, reason = u.reason, updated_at = now()
FROM unnest($1::uuid[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::text[], $7::text[])
    AS u (instance_id, generation, vcpus, ram_bytes, disk_bytes, outcome, reason)
WHERE c.instance_id = u.instance_id;

-- name: silos_set
-- The silos' new totals, decided under their locks (silos_lock).
UPDATE silos s SET vcpus = u.vcpus, ram_bytes = u.ram_bytes, disk_bytes = u.disk_bytes
FROM unnest($1::uuid[], $2::bigint[], $3::bigint[], $4::bigint[]) AS u (id, vcpus, ram_bytes, disk_bytes)
WHERE s.id = u.id;

-- name: projects_add
-- Moves each project by what the batch changed. A project's rows are only ever changed under its silo's
-- lock, which the batch holds.
UPDATE projects p
SET vcpus = p.vcpus + u.vcpus, ram_bytes = p.ram_bytes + u.ram_bytes, disk_bytes = p.disk_bytes + u.disk_bytes
FROM unnest($1::uuid[], $2::bigint[], $3::bigint[], $4::bigint[]) AS u (id, vcpus, ram_bytes, disk_bytes)
WHERE p.id = u.id
RETURNING p.id, p.silo_id, p.vcpus, p.ram_bytes, p.disk_bytes;

-- name: silo_by_name
-- A name means its newest silo: one deleted in instance-manager keeps its row, and its name may be reused.
SELECT id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos WHERE name = $1 ORDER BY seq DESC LIMIT 1;

-- name: silo_list
-- Each name's newest silo (silo_by_name).
SELECT DISTINCT ON (name) id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos ORDER BY name, seq DESC;

-- name: project_by_name
-- The newest project of the name in the newest silo of the name (silo_by_name).
SELECT p.id, p.name, p.vcpus, p.ram_bytes, p.disk_bytes
FROM projects p
WHERE p.silo_id = (SELECT id FROM silos WHERE name = $1 ORDER BY seq DESC LIMIT 1) AND p.name = $2
ORDER BY p.seq DESC LIMIT 1;

-- name: projects_of_silo
-- Each name's newest project in silo $1 (project_by_name).
SELECT DISTINCT ON (p.name) p.id, p.name, p.vcpus, p.ram_bytes, p.disk_bytes
FROM projects p WHERE p.silo_id = $1 ORDER BY p.name, p.seq DESC;

-- name: fleet_get
-- The fleet's totals are the sum of its silos' (no row of its own that every charge would have to lock).
-- numeric: a sum of bigints may pass a bigint.
SELECT coalesce(sum(vcpus), 0)::numeric AS vcpus, coalesce(sum(ram_bytes), 0)::numeric AS ram_bytes,
       coalesce(sum(disk_bytes), 0)::numeric AS disk_bytes
FROM silos;

-- name: history_append
-- Rows of (scope, id, silo_id, vcpus, ram_bytes, disk_bytes), one array per column, so that one statement
-- appends any number of them.
INSERT INTO usage_history (scope, id, silo_id, vcpus, ram_bytes, disk_bytes)
SELECT * FROM unnest($1::text[], $2::uuid[], $3::uuid[], $4::bigint[], $5::bigint[], $6::bigint[]);

-- name: history_now
SELECT clock_timestamp();

-- name: silo_ids
SELECT id FROM silos;

-- name: history_buckets
-- The summed usage of the series $2 (ids of scope $1) from $3 on, in $5 buckets of $4 seconds: each
-- bucket's least, greatest and last level, and (bucket -1) the level at $3. Each series' level at $3 is
-- its last row before $3; after it, the levels are a running sum of every series' differences in
-- (at, seq) order, so that a sum over several silos (the fleet) moves one change at a time.
WITH start AS (
    SELECT b.id, b.vcpus, b.ram_bytes, b.disk_bytes
    FROM unnest($2::uuid[]) AS ids (id)
    CROSS JOIN LATERAL (
        SELECT h.id, h.vcpus, h.ram_bytes, h.disk_bytes FROM usage_history h
        WHERE h.id = ids.id AND h.scope = $1 AND h.at < $3
        ORDER BY h.at DESC, h.seq DESC LIMIT 1
    ) b
), base AS (
    SELECT coalesce(sum(vcpus), 0)::bigint AS vcpus, coalesce(sum(ram_bytes), 0)::bigint AS ram_bytes,
           coalesce(sum(disk_bytes), 0)::bigint AS disk_bytes
    FROM start
), changes AS (
    SELECT h.at, h.seq,
           h.vcpus - coalesce(lag(h.vcpus) OVER w, s.vcpus, 0) AS dv,
           h.ram_bytes - coalesce(lag(h.ram_bytes) OVER w, s.ram_bytes, 0) AS dr,
           h.disk_bytes - coalesce(lag(h.disk_bytes) OVER w, s.disk_bytes, 0) AS dd
    FROM usage_history h LEFT JOIN start s ON s.id = h.id
    WHERE h.id = ANY ($2::uuid[]) AND h.scope = $1 AND h.at >= $3
    WINDOW w AS (PARTITION BY h.id ORDER BY h.at, h.seq)
), levels AS (
    SELECT least(floor(extract(epoch FROM c.at - $3) / $4)::int, $5 - 1) AS bucket, c.at, c.seq,
           (base.vcpus + sum(c.dv) OVER o)::bigint AS vcpus,
           (base.ram_bytes + sum(c.dr) OVER o)::bigint AS ram_bytes,
           (base.disk_bytes + sum(c.dd) OVER o)::bigint AS disk_bytes
    FROM changes c, base
    WINDOW o AS (ORDER BY c.at, c.seq)
)
SELECT bucket,
       min(vcpus) AS vcpus_min, max(vcpus) AS vcpus_max,
       (array_agg(vcpus ORDER BY at DESC, seq DESC))[1] AS vcpus_last,
       min(ram_bytes) AS ram_bytes_min, max(ram_bytes) AS ram_bytes_max,
       (array_agg(ram_bytes ORDER BY at DESC, seq DESC))[1] AS ram_bytes_last,
       min(disk_bytes) AS disk_bytes_min, max(disk_bytes) AS disk_bytes_max,
       (array_agg(disk_bytes ORDER BY at DESC, seq DESC))[1] AS disk_bytes_last
FROM levels GROUP BY bucket
UNION ALL
SELECT -1, vcpus, vcpus, vcpus, ram_bytes, ram_bytes, ram_bytes, disk_bytes, disk_bytes, disk_bytes FROM base
ORDER BY bucket;
