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
