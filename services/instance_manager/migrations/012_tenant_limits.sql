-- Tenant limits (docs/security.md "Tenant limits"): how many projects, instances and warm-pool members a
-- silo may hold, and how many commands a second it may send. NULL: the rack's default
-- (RACKPLANE_SILO_MAX_PROJECTS, ..._MAX_INSTANCES, ..._MAX_POOL_MEMBERS, RACKPLANE_SILO_COMMAND_RATE), so
-- that a default an operator changes applies to every silo that has none of its own.
ALTER TABLE silos
    ADD COLUMN max_projects     int CHECK (max_projects >= 0),
    ADD COLUMN max_instances    int CHECK (max_instances >= 0),
    ADD COLUMN max_pool_members int CHECK (max_pool_members >= 0),
    ADD COLUMN command_rate     int CHECK (command_rate > 0);

-- Counting a silo's instances (the limit is checked at every create) reads them by project.
CREATE INDEX instances_live_project ON instances (project_id) WHERE state <> 'destroyed';
