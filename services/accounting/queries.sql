-- name: silo_upsert
INSERT INTO silos (id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO NOTHING;

-- name: project_upsert
INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE SET name = coalesce(EXCLUDED.name, projects.name);

-- name: silo_exists
SELECT EXISTS (SELECT 1 FROM silos WHERE id = $1);

-- name: silo_name
SELECT name FROM silos WHERE id = $1;

-- name: project_owner
SELECT p.silo_id, p.name, s.name AS silo_name FROM projects p JOIN silos s ON s.id = p.silo_id WHERE p.id = $1;

-- name: charge_row_ensure
INSERT INTO instance_charges (instance_id, project_id, silo_id) VALUES ($1, $2, $3)
ON CONFLICT (instance_id) DO NOTHING;

-- name: charge_row_lock
-- Concurrent deltas of one instance serialize here, so that both cannot see "not charged yet".
-- (Locked in its own statement: a FOR UPDATE in the same statement as an upsert skips the rows the
-- upsert touches.)
SELECT project_id, silo_id, generation, vcpus, ram_bytes, disk_bytes, outcome, reason
FROM instance_charges WHERE instance_id = $1 FOR UPDATE;

-- name: apply_totals
-- Moves silo, project and fleet totals by ($2 vCPUs, $3 RAM, $4 disk) in one statement, gated by the
-- silo's quotas: only increases are checked, reaching a quota exactly is allowed, and the silo row's
-- lock serializes concurrent charges, so together they can never exceed it. No increase may take the
-- fleet's total (which bounds every silo's and project's) past $6 (MAX_TOTAL, shared/messages/base.py),
-- so no sum overflows a bigint. Returns 0 rows if refused.
WITH d AS (SELECT $2::bigint AS v, $3::bigint AS r, $4::bigint AS k), silo AS (
    UPDATE silos
    SET vcpus = vcpus + d.v, ram_bytes = ram_bytes + d.r, disk_bytes = disk_bytes + d.k
    FROM d
    WHERE id = $1
      AND (d.v <= 0 OR quota_vcpus IS NULL OR vcpus + d.v <= quota_vcpus)
      AND (d.r <= 0 OR quota_ram_bytes IS NULL OR ram_bytes + d.r <= quota_ram_bytes)
      AND (d.k <= 0 OR quota_disk_bytes IS NULL OR disk_bytes + d.k <= quota_disk_bytes)
      AND (d.v <= 0 OR (SELECT f.vcpus FROM fleet f) + d.v <= $6)
      AND (d.r <= 0 OR (SELECT f.ram_bytes FROM fleet f) + d.r <= $6)
      AND (d.k <= 0 OR (SELECT f.disk_bytes FROM fleet f) + d.k <= $6)
    RETURNING silos.id, silos.vcpus, ram_bytes, disk_bytes
), project AS (
    UPDATE projects
    SET vcpus = vcpus + d.v, ram_bytes = ram_bytes + d.r, disk_bytes = disk_bytes + d.k
    FROM d
    WHERE id = $5 AND EXISTS (SELECT 1 FROM silo)
    RETURNING id, vcpus, ram_bytes, disk_bytes
), fleet_row AS (
    UPDATE fleet
    SET vcpus = vcpus + d.v, ram_bytes = ram_bytes + d.r, disk_bytes = disk_bytes + d.k
    FROM d
    WHERE EXISTS (SELECT 1 FROM silo)
    RETURNING 1
)
SELECT s.vcpus AS silo_vcpus, s.ram_bytes AS silo_ram_bytes, s.disk_bytes AS silo_disk_bytes,
       p.vcpus AS project_vcpus, p.ram_bytes AS project_ram_bytes, p.disk_bytes AS project_disk_bytes,
       (SELECT count(*) FROM fleet_row) AS fleet
FROM silo s, project p;

-- name: charge_row_set
UPDATE instance_charges
SET generation = $2, vcpus = $3, ram_bytes = $4, disk_bytes = $5, outcome = $6, reason = $7, updated_at = now()
WHERE instance_id = $1;

-- name: silo_get
SELECT id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos WHERE id = $1;

-- name: silo_by_name
SELECT id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos WHERE name = $1;

-- name: silo_list
SELECT id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes, vcpus, ram_bytes, disk_bytes
FROM silos ORDER BY name;

-- name: project_by_name
SELECT p.id, p.name, p.vcpus, p.ram_bytes, p.disk_bytes
FROM projects p JOIN silos s ON s.id = p.silo_id WHERE s.name = $1 AND p.name = $2;

-- name: projects_of_silo
SELECT p.id, p.name, p.vcpus, p.ram_bytes, p.disk_bytes FROM projects p WHERE p.silo_id = $1 ORDER BY p.name;

-- name: fleet_get
SELECT vcpus, ram_bytes, disk_bytes FROM fleet;

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
