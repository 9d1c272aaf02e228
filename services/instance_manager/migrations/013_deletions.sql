-- `silo delete` and `project delete`: the row stays, marked deleted, because what was inside keeps
-- pointing at it (a destroyed instance is kept for good, its generation a fence; a deleted pool too), and
-- its name is free again: a name is unique among the live silos, and among a silo's live projects.
ALTER TABLE silos ADD COLUMN deleted_at timestamptz;
ALTER TABLE projects ADD COLUMN deleted_at timestamptz;

ALTER TABLE silos DROP CONSTRAINT silos_name_key;
CREATE UNIQUE INDEX silos_live_name ON silos (name) WHERE deleted_at IS NULL;

ALTER TABLE projects DROP CONSTRAINT projects_silo_id_name_key;
CREATE UNIQUE INDEX projects_live_name ON projects (silo_id, name) WHERE deleted_at IS NULL;
