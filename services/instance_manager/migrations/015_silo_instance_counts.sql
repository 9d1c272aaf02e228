-- A silo's live instances, counted without reading them. A create checks the silo's instance limit
-- under the silo's lock (silo_lock_limits), and counting its instances there took 33 ms at 123,000, so
-- the creates of a large silo took turns at 30 a second (docs/scaling.md). Now every change of an
-- instance's liveness (inserted live, destroyed, deleted live), whatever path makes it, adds a row of +1
-- or -1 to silo_instance_changes, by trigger; a create, holding the silo's lock, folds the silo's rows
-- into silo_instance_counts (silo_instances_count), and so does the pruner for silos nobody creates in.
-- Rows are only inserted, and only a fold under the silo's lock deletes them: transactions that change
-- the instances of several silos lock no shared row, where a counter row updated by each would make
-- them wait on one another, and deadlock.

-- The index that served the count goes first. Its lock (ACCESS EXCLUSIVE on instances) is the only
-- strong lock this migration takes, and the first, so it waits only for transactions that wait for
-- nothing of its own while replicas of the version before serve; once held, no change of an instance
-- slips between the count below and the triggers. A project's live instances are found by
-- instances_live_name (project_id, name), with the same condition.
DROP INDEX instances_live_project;

-- No foreign keys: creating one would lock silos against writes while this migration runs.
CREATE TABLE silo_instance_counts (
    silo_id uuid PRIMARY KEY,
    live    bigint NOT NULL
);
INSERT INTO silo_instance_counts (silo_id, live)
SELECT p.silo_id, count(*) FROM instances i JOIN projects p ON p.id = i.project_id
WHERE i.state <> 'destroyed' GROUP BY p.silo_id;

CREATE TABLE silo_instance_changes (
    id      bigserial PRIMARY KEY,
    silo_id uuid NOT NULL,
    change  int NOT NULL CHECK (change IN (-1, 1))
);
CREATE INDEX silo_instance_changes_silo ON silo_instance_changes (silo_id);

-- Its tables found by this schema's path whoever changes an instance (an administrator's session too).
CREATE FUNCTION instance_liveness_changed() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    project uuid;
    change int;
BEGIN
    IF TG_OP = 'DELETE' THEN
        project := OLD.project_id;
        change := -1;
    ELSE
        project := NEW.project_id;
        change := CASE WHEN NEW.state = 'destroyed' THEN -1 ELSE 1 END;
    END IF;
    INSERT INTO silo_instance_changes (silo_id, change) SELECT silo_id, change FROM projects WHERE id = project;
    RETURN NULL;
END
$$;

CREATE TRIGGER instance_inserted_live AFTER INSERT ON instances
    FOR EACH ROW WHEN (NEW.state <> 'destroyed') EXECUTE FUNCTION instance_liveness_changed();
CREATE TRIGGER instance_liveness AFTER UPDATE OF state ON instances
    FOR EACH ROW WHEN ((OLD.state = 'destroyed') <> (NEW.state = 'destroyed'))
    EXECUTE FUNCTION instance_liveness_changed();
CREATE TRIGGER instance_deleted_live AFTER DELETE ON instances
    FOR EACH ROW WHEN (OLD.state <> 'destroyed') EXECUTE FUNCTION instance_liveness_changed();
