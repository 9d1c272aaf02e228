-- What an operator's acknowledged commands are held against (acknowledged.py). Read-only.

-- name: live_silos
SELECT name FROM instance_manager.silos WHERE deleted_at IS NULL;

-- name: live_projects
SELECT s.name AS silo, p.name FROM instance_manager.projects p
JOIN instance_manager.silos s ON s.id = p.silo_id WHERE p.deleted_at IS NULL;

-- name: instances_of_silos
-- Every instance record, live or not, of the silos named in $1.
SELECT s.name AS silo, p.name AS project, i.name, i.id, i.state, i.generation
FROM instance_manager.instances i JOIN instance_manager.projects p ON p.id = i.project_id
JOIN instance_manager.silos s ON s.id = p.silo_id WHERE s.name = ANY($1::text[]);
