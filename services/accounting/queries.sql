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
INSERT INTO instance_charges (instance_id, project_id, silo_id)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[])
ON CONFLICT (instance_id) DO NOTHING;

-- name: charges_lock
-- Concurrent batches touching one instance serialize here; locking in key order keeps them from
-- deadlocking. (Locked in its own statement: a FOR UPDATE in the same statement as an upsert skips the
-- rows the upsert touches.)
SELECT instance_id, project_id, silo_id, generation, vcpus, ram_bytes, disk_bytes, outcome, reason
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
-- The fleet's totals are the sum of its silos' (no row of its own that every charge would have to lock).
-- numeric: a sum of bigints may pass a bigint.
SELECT coalesce(sum(vcpus), 0)::numeric AS vcpus, coalesce(sum(ram_bytes), 0)::numeric AS ram_bytes,
       coalesce(sum(disk_bytes), 0)::numeric AS disk_bytes
FROM silos;
