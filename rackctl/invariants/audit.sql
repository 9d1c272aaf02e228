-- What the usage audit reads (audit.py): accounting's totals and charges, instance-manager's names and
-- states. Read-only.

-- name: live_silo_id
-- A live silo's id by name (a deleted silo's name may be another's now).
SELECT id FROM instance_manager.silos WHERE name = $1 AND deleted_at IS NULL;

-- name: live_project_id
SELECT id FROM instance_manager.projects WHERE silo_id = $1 AND name = $2 AND deleted_at IS NULL;

-- name: project_totals
-- Each project's total row (of silo $1 and project $2, when given) beside the sum of its charges.
WITH sums AS (
    SELECT project_id AS id, sum(vcpus)::bigint AS vcpus, sum(ram_bytes)::bigint AS ram_bytes,
           sum(disk_bytes)::bigint AS disk_bytes
    FROM accounting.instance_charges GROUP BY project_id
)
SELECT t.id, coalesce(s.name, a.name, t.silo_id::text) || '/' || coalesce(p.name, t.name, t.id::text)
           AS name,
       t.vcpus, t.ram_bytes, t.disk_bytes,
       coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
       coalesce(c.disk_bytes, 0) AS c_disk
FROM accounting.projects t
JOIN accounting.silos a ON a.id = t.silo_id
LEFT JOIN sums c ON c.id = t.id
LEFT JOIN instance_manager.projects p ON p.id = t.id
LEFT JOIN instance_manager.silos s ON s.id = t.silo_id
WHERE ($1::uuid IS NULL OR t.silo_id = $1) AND ($2::uuid IS NULL OR t.id = $2)
ORDER BY 2;

-- name: silo_totals
-- Each silo's total row (silo $1 alone, when given) beside the sum of its charges.
WITH sums AS (
    SELECT silo_id AS id, sum(vcpus)::bigint AS vcpus, sum(ram_bytes)::bigint AS ram_bytes,
           sum(disk_bytes)::bigint AS disk_bytes
    FROM accounting.instance_charges GROUP BY silo_id
)
SELECT t.id, coalesce(s.name, t.name) AS name, t.vcpus, t.ram_bytes, t.disk_bytes,
       coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
       coalesce(c.disk_bytes, 0) AS c_disk
FROM accounting.silos t
LEFT JOIN sums c ON c.id = t.id
LEFT JOIN instance_manager.silos s ON s.id = t.id
WHERE $1::uuid IS NULL OR t.id = $1
ORDER BY 2;

-- name: fleet_totals
-- The fleet's totals are the sum of the silo rows (accounting keeps no fleet row of its own).
SELECT (SELECT coalesce(sum(vcpus), 0)::bigint FROM accounting.silos) AS vcpus,
       (SELECT coalesce(sum(ram_bytes), 0)::bigint FROM accounting.silos) AS ram_bytes,
       (SELECT coalesce(sum(disk_bytes), 0)::bigint FROM accounting.silos) AS disk_bytes,
       (SELECT coalesce(sum(vcpus), 0)::bigint FROM accounting.instance_charges) AS c_vcpus,
       (SELECT coalesce(sum(ram_bytes), 0)::bigint FROM accounting.instance_charges) AS c_ram,
       (SELECT coalesce(sum(disk_bytes), 0)::bigint FROM accounting.instance_charges) AS c_disk;

-- name: instance_charges
-- Each instance (of silo $1 and project $2, when given) with its charge. Instances being created are left
-- out: their create saga charges the disk as it goes.
SELECT i.id, i.name, i.state, i.vcpus, i.ram_bytes, i.disk_bytes, s.name AS silo, p.name AS project,
       coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
       coalesce(c.disk_bytes, 0) AS c_disk
FROM instance_manager.instances i
JOIN instance_manager.projects p ON p.id = i.project_id
JOIN instance_manager.silos s ON s.id = p.silo_id
LEFT JOIN accounting.instance_charges c ON c.instance_id = i.id
WHERE i.state <> 'creating'
  AND ($1::uuid IS NULL OR p.silo_id = $1) AND ($2::uuid IS NULL OR p.id = $2)
ORDER BY s.name, p.name, i.name, i.id;
