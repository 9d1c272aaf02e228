-- name: silo_insert
INSERT INTO silos (id, name, quota) VALUES ($1, $2, $3)
ON CONFLICT (name) WHERE deleted_at IS NULL DO NOTHING RETURNING id;

-- name: silo_by_name
SELECT id, name, quota, created_at FROM silos WHERE name = $1 AND deleted_at IS NULL;

-- name: silo_page
-- A page of silos after name $1, $2 at most (and one more, to tell whether another page follows).
SELECT id, name, quota, created_at FROM silos
WHERE deleted_at IS NULL AND ($1::text IS NULL OR name > $1) ORDER BY name LIMIT $2 + 1;

-- name: project_insert
INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, $3)
ON CONFLICT (silo_id, name) WHERE deleted_at IS NULL DO NOTHING RETURNING id;

-- name: project_by_name
SELECT p.id, p.name, p.silo_id, s.name AS silo
FROM projects p JOIN silos s ON s.id = p.silo_id
WHERE s.name = $1 AND p.name = $2 AND s.deleted_at IS NULL AND p.deleted_at IS NULL;

-- name: project_page
SELECT p.id, p.name, s.name AS silo, p.created_at
FROM projects p JOIN silos s ON s.id = p.silo_id
WHERE s.name = $1 AND s.deleted_at IS NULL AND p.deleted_at IS NULL AND ($2::text IS NULL OR p.name > $2)
ORDER BY p.name LIMIT $3 + 1;

-- name: silo_lock_delete
-- `silo delete`: the live silo, locked FOR UPDATE, which a project create's lock (silo_lock_limits, FOR NO
-- KEY UPDATE) waits for: a create that came first is counted (silo_projects), one that comes after finds
-- no silo.
SELECT id, name FROM silos WHERE name = $1 AND deleted_at IS NULL FOR UPDATE;

-- name: silo_projects
-- The names of the silo's live projects, $2 at most, and how many there are.
SELECT count(*) OVER () AS total, name FROM projects
WHERE silo_id = $1 AND deleted_at IS NULL ORDER BY name LIMIT $2;

-- name: silo_mark_deleted
UPDATE silos SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL;

-- name: project_lock_delete
-- `project delete`, once its silo's row is locked as every create inside locks it: the live project,
-- locked FOR UPDATE, which the insert of an instance or a pool (instance_insert, pool_insert: FOR KEY SHARE
-- of the live project) waits for. An insert that came first is counted (project_holds); one that comes
-- after finds the project deleted and inserts nothing.
SELECT p.id, p.silo_id FROM projects p
WHERE p.silo_id = $1 AND p.name = $2 AND p.deleted_at IS NULL
FOR UPDATE;

-- name: project_holds
-- What lives inside project $1: its instances that are not destroyed, whatever their state, and its live
-- pools.
SELECT (SELECT count(*) FROM instances WHERE project_id = $1 AND state <> 'destroyed') AS instances,
       (SELECT count(*) FROM pools WHERE project_id = $1 AND state = 'active') AS pools;

-- name: project_mark_deleted
UPDATE projects SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL;

-- name: instance_insert
-- An ordinary instance may hold customer data from the start; a pool VM ($8) only once handed out.
-- The pool means its VMs to run.
-- Only into project $2 while it lives: its row is locked FOR KEY SHARE (as the foreign key locks it), so
-- an insert racing a `project delete` (project_lock_delete) waits for it, then inserts nothing.
INSERT INTO instances (id, project_id, name, vcpus, ram_bytes, disk_bytes, auto_restart, state, pool_id,
                       has_customer_data_at, intended_state)
SELECT $1::uuid, p.id, $3::text, $4::int, $5::bigint, $6::bigint, $7::text, 'creating', $8::uuid,
       CASE WHEN $8::uuid IS NULL THEN now() END, CASE WHEN $8::uuid IS NULL THEN 'stopped' ELSE 'running' END
FROM projects p WHERE p.id = $2 AND p.deleted_at IS NULL
FOR KEY SHARE OF p;

-- name: instance_view
-- Everything a reply or an event says about an instance, for each of the instances $1, in that order. $2: seconds of sled silence after which its
-- instances' health is unknown; $3: the automatic restart cooldown, in seconds; $4: the longest wait
-- between automatic restarts. The cooldown doubles with each restart in a row that could not start
-- the instance (no room, no quota), up to $4: the one rule for when the next restart is due, kept in
-- the function next_restart_at (migration 009), which the start interlock checks too.
-- An instance whose VMM was placed on an earlier boot of its sled than the one the sled now reports
-- (x.lost) runs nowhere: it is shown as what recovery's lost order will make of it (failed; stopped if it
-- was stopping: lifecycle.Ended.state, orders.lost's reason) from the moment this service applies the
-- new boot's inventory, not once that order is through, which after a rack-wide power loss is a queue.
SELECT i.id, s.name AS silo, p.name AS project, i.name, s.id AS silo_id, p.id AS project_id,
       i.vcpus, i.ram_bytes, i.disk_bytes, i.auto_restart,
       CASE WHEN x.lost THEN CASE WHEN i.state = 'stopping' THEN 'stopped' ELSE 'failed' END
            ELSE i.state END AS state,
       i.intended_state, i.generation,
       i.active_vmm_id, v.sled_id, v.boot_id AS vmm_boot_id, v.boot_number AS vmm_boot_number,
       CASE WHEN x.lost AND i.state <> 'stopping'
            THEN format('sled %s rebooted (boot %s ended; boot %s began)', v.sled_id, v.boot_number, sl.boot_number)
            ELSE i.last_error END AS last_error,
       i.failed_at, i.auto_restarts, i.last_auto_restart_at, i.updated_at,
       pl.name AS pool, i.provisioned_at, i.has_customer_data_at,
       i.target_vmm_id, tv.sled_id AS target_sled_id, tv.boot_id AS target_vmm_boot_id,
       tv.boot_number AS target_vmm_boot_number,
       CASE
           WHEN i.state = 'failed' OR (x.lost AND i.state <> 'stopping') THEN 'failed'
           WHEN v.id IS NOT NULL AND (sl.last_seen_at IS NULL
                                      OR sl.last_seen_at < now() - make_interval(secs => $2)) THEN 'unknown'
           ELSE 'ok'
       END AS health,
       next_restart_at(i, $3, $4) AS next_restart_at
FROM instances i
JOIN projects p ON p.id = i.project_id
JOIN silos s ON s.id = p.silo_id
LEFT JOIN vmms v ON v.id = i.active_vmm_id
LEFT JOIN sleds sl ON sl.id = v.sled_id
LEFT JOIN pools pl ON pl.id = i.pool_id
LEFT JOIN vmms tv ON tv.id = i.target_vmm_id
CROSS JOIN LATERAL (SELECT coalesce(i.state IN ('starting', 'running', 'stopping', 'migrating')
                                    AND v.ended_at IS NULL AND sl.boot_number > v.boot_number, false) AS lost) x
JOIN unnest($1::uuid[]) WITH ORDINALITY AS wanted (id, n) ON wanted.id = i.id
ORDER BY wanted.n;

-- name: instance_by_name
SELECT i.id, i.state, i.generation, i.active_vmm_id
FROM instances i
JOIN projects p ON p.id = i.project_id
JOIN silos s ON s.id = p.silo_id
WHERE s.name = $1 AND p.name = $2 AND i.name = $3 AND i.state <> 'destroyed';

-- name: instance_page
-- A page of instances (of silo $1, project $2, or all), after (silo, project, name) ($3, $4, $5), in that
-- order, $6 at most (and one more, to tell whether another page follows).
SELECT i.id, s.name AS silo, p.name AS project, i.name FROM instances i
JOIN projects p ON p.id = i.project_id
JOIN silos s ON s.id = p.silo_id
WHERE i.state <> 'destroyed' AND ($1::text IS NULL OR s.name = $1) AND ($2::text IS NULL OR p.name = $2)
  AND ($3::text IS NULL OR (s.name, p.name, i.name) > ($3, $4, $5))
ORDER BY s.name, p.name, i.name
LIMIT $6 + 1;

-- name: instances_lock
-- Many instances, locked in id order.
SELECT id, project_id, state, generation, active_vmm_id, target_vmm_id, vcpus, ram_bytes, disk_bytes,
       pool_id, has_customer_data_at
FROM instances WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE;

-- name: instance_lock
SELECT id, project_id, state, generation, active_vmm_id, target_vmm_id, vcpus, ram_bytes, disk_bytes,
       pool_id, has_customer_data_at
FROM instances WHERE id = $1 FOR UPDATE;

-- name: instance_set_state
-- Every change bumps the generation; returns the new one. provisioned_at says since when the current VMM
-- runs: set on running, cleared on the way down.
UPDATE instances
SET state = $2, generation = generation + 1, last_error = coalesce($3, last_error), updated_at = now(),
    restart_failures = CASE WHEN $2 = 'running' THEN 0 ELSE restart_failures END,
    provisioned_at = CASE WHEN $2 = 'running' THEN now()
                          WHEN $2 IN ('stopping', 'stopped', 'failed') THEN NULL
                          ELSE provisioned_at END
WHERE id = $1
RETURNING generation;

-- name: instance_destroy
-- A VM destroyed before it was handed out is marked now: its disk is never reused either way.
UPDATE instances
SET state = 'destroyed', generation = generation + 1, updated_at = now(), provisioned_at = NULL,
    has_customer_data_at = coalesce(has_customer_data_at, now())
WHERE id = $1
RETURNING generation;

-- name: start_interlock
-- The "one start at a time" interlock: a compare-and-set that only one of any number of concurrent
-- starts can win, because only one finds the instance stopped with no active VMM. Who asks ($4, as
-- StartParams.asked_by says) adds its own conditions, checked here under the row lock, by this service's
-- clock: an automatic restart ('restart') names the generation it decided on ($3) and finds the instance
-- failed at it, best_effort, meant to run and its next restart due (next_restart_at, with instance_view's
-- $5 and $6), so that it loses to anything a user did since and never runs ahead of its cooldown; a pool
-- keeper's start ('pool') finds its VM still meant to run (not retired since).
UPDATE instances
SET state = 'starting', active_vmm_id = $2, intended_state = 'running',
    last_error = CASE WHEN $4::text = 'restart' THEN last_error END,
    auto_restarts = auto_restarts + CASE WHEN $4 = 'restart' THEN 1 ELSE 0 END,
    last_auto_restart_at = CASE WHEN $4 = 'restart' THEN now() ELSE last_auto_restart_at END,
    generation = generation + 1, updated_at = now()
WHERE id = $1 AND state IN ('stopped', 'failed') AND active_vmm_id IS NULL
  AND CASE $4
          WHEN 'restart' THEN generation = $3::bigint
                              AND next_restart_at(instances, $5::float8, $6::float8) <= now()
          WHEN 'pool' THEN intended_state = 'running'
          ELSE true
      END
RETURNING generation, project_id, vcpus, ram_bytes, disk_bytes;

-- name: start_refused
-- Why the start interlock did not pass, read under the row lock: what its conditions look at ($2, $3 as
-- its $5, $6).
SELECT i.state, i.generation, i.auto_restart, i.intended_state, next_restart_at(i, $2, $3) AS next_restart_at,
       now() AS now
FROM instances i WHERE i.id = $1 FOR UPDATE;

-- name: start_interlock_release
-- Undo of the interlock: only if the instance is still ours (our VMM is still the active one). Who asked
-- ($4) decides what is left: a user's start that failed leaves the instance stopped and meant to stay so,
-- with the reason; an automatic restart that failed leaves it failed and still meant to run, and counts
-- the failure, so that the next try backs off (see instance_view's next_restart_at); a pool keeper's
-- start leaves its VM stopped and still meant to run, for the keeper to try again.
UPDATE instances
SET state = CASE WHEN $4 = 'restart' THEN 'failed' ELSE 'stopped' END,
    intended_state = CASE WHEN $4 = 'user' THEN 'stopped' ELSE intended_state END,
    restart_failures = restart_failures + CASE WHEN $4 = 'restart' THEN 1 ELSE 0 END,
    active_vmm_id = NULL, last_error = $3, generation = generation + 1, updated_at = now()
WHERE id = $1 AND active_vmm_id = $2
RETURNING generation;

-- name: instance_bump_if_active
-- A new generation for a change about VMM $2, only while it is the instance's active VMM.
UPDATE instances SET generation = generation + 1, updated_at = now()
WHERE id = $1 AND active_vmm_id = $2
RETURNING generation, vcpus, ram_bytes, disk_bytes;

-- name: place
-- Placement: pick one active sled that answers (its last inventory is younger than $5 seconds) with room
-- and reserve on it, in one statement, without locking the table: SKIP LOCKED passes over sleds another
-- placement is reserving (or an expunge is taking out) right now. Least loaded first. A migration target
-- is never placed on its source's sled ($3), and goes to sled $4 if one is named. The row lock is NO KEY
-- UPDATE, so that a VMM record being inserted on the sled (its foreign key takes KEY SHARE) is no reason
-- to pass it over; an expunge (FOR UPDATE) is.
WITH candidate AS (
    SELECT id FROM sleds
    WHERE state = 'active' AND last_seen_at > now() - make_interval(secs => $5)
      AND ($3::text IS NULL OR id <> $3) AND ($4::text IS NULL OR id = $4)
      AND vcpus - reserved_vcpus >= $1
      AND ram_bytes - reserved_ram_bytes >= $2
    ORDER BY reserved_vcpus::float8 / vcpus, random()
    LIMIT 1
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE sleds s
SET reserved_vcpus = s.reserved_vcpus + $1, reserved_ram_bytes = s.reserved_ram_bytes + $2
FROM candidate
WHERE s.id = candidate.id
RETURNING s.id, s.boot_id, s.boot_number;

-- name: sled_placeable
-- create_vmm's second look at the sled it placed on, under a lock that an expunge (FOR UPDATE) waits
-- for and that waits for an expunge: is it still active, and does it still answer ($2 seconds)?
SELECT state, boot_number, last_seen_at > now() - make_interval(secs => $2) AS answering
FROM sleds WHERE id = $1 FOR KEY SHARE;

-- name: unreserve
UPDATE sleds SET reserved_vcpus = reserved_vcpus - $2, reserved_ram_bytes = reserved_ram_bytes - $3
WHERE id = $1;

-- name: vmm_insert
-- $7: 'starting' for a start, 'migrating' for a migration target.
INSERT INTO vmms (id, instance_id, sled_id, vcpus, ram_bytes, boot_id, boot_number, state)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (id) DO NOTHING;

-- name: vmms_end
-- End the VMM records $1 (state $2) and give their room back to their sleds, in one statement.
-- Idempotent: returns only the records this call ended, so each reservation is released exactly once.
-- The sleds are locked in id order first (`locked`: an UPDATE ... FROM over a set locks rows in the
-- order its plan meets them, not in id order, and would deadlock with an inventory batch's sleds_lock).
WITH ended AS (
    UPDATE vmms SET state = $2, ended_at = now()
    WHERE id = ANY($1::uuid[]) AND ended_at IS NULL
    RETURNING id, instance_id, sled_id, vcpus, ram_bytes, boot_number
), locked AS (
    SELECT s.id FROM sleds s WHERE s.id IN (SELECT sled_id FROM ended) ORDER BY s.id FOR NO KEY UPDATE
), freed AS (
    UPDATE sleds s
    SET reserved_vcpus = s.reserved_vcpus - f.vcpus, reserved_ram_bytes = s.reserved_ram_bytes - f.ram_bytes
    FROM (SELECT sled_id, sum(vcpus) AS vcpus, sum(ram_bytes) AS ram_bytes FROM ended GROUP BY sled_id) f
    WHERE s.id = f.sled_id AND s.id IN (SELECT id FROM locked)
)
SELECT * FROM ended ORDER BY id;
-- name: vmms_apply_reports
-- The generation fence, for a batch of reports (at most one per VMM and sled): only a strictly newer
-- report about a live VMM, from its own sled, made on the boot it was placed on or a later one, is
-- written. The VMMs are locked in id order first (the order every other path locks them in). Returns the
-- VMMs written; a report that ended its VMM returns `ended`.
WITH r AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[], $4::bool[], $5::text[], $6::bigint[])
        AS r (id, state, generation, terminal, sled_id, boot_number)
), locked AS (
    SELECT v.id FROM vmms v WHERE v.id IN (SELECT id FROM r) AND v.ended_at IS NULL ORDER BY v.id FOR UPDATE
)
UPDATE vmms v SET state = r.state, generation = r.generation,
                  ended_at = CASE WHEN r.terminal THEN now() ELSE NULL END
FROM r
WHERE v.id = r.id AND v.id IN (SELECT id FROM locked) AND v.generation < r.generation
  AND v.ended_at IS NULL AND v.sled_id = r.sled_id AND (v.boot_number IS NULL OR v.boot_number <= r.boot_number)
RETURNING v.id, v.instance_id, v.sled_id, v.vcpus, v.ram_bytes, v.boot_number, r.terminal AS ended;

-- name: vmms_placed
SELECT id, sled_id FROM vmms WHERE id = ANY($1::uuid[]);

-- name: sleds_unreserve
-- Give back the room of VMMs whose records ended ($1 their sleds, one entry per VMM). The sleds are
-- locked in id order first, as every path locks sleds (see vmms_end).
WITH locked AS (
    SELECT id FROM sleds WHERE id = ANY($1::text[]) ORDER BY id FOR NO KEY UPDATE
)
UPDATE sleds s
SET reserved_vcpus = s.reserved_vcpus - f.vcpus, reserved_ram_bytes = s.reserved_ram_bytes - f.ram_bytes
FROM (
    SELECT sled_id, sum(vcpus) AS vcpus, sum(ram_bytes) AS ram_bytes
    FROM unnest($1::text[], $2::int[], $3::bigint[]) AS u (sled_id, vcpus, ram_bytes) GROUP BY sled_id
) f
WHERE s.id = f.sled_id AND s.id IN (SELECT id FROM locked);

-- name: instances_set_state
-- instance_set_state for many instances, each to its own state ($2); returns each one's new generation.
UPDATE instances i
SET state = u.state, generation = i.generation + 1, updated_at = now(),
    restart_failures = CASE WHEN u.state = 'running' THEN 0 ELSE i.restart_failures END,
    provisioned_at = CASE WHEN u.state = 'running' THEN now()
                          WHEN u.state IN ('stopping', 'stopped', 'failed') THEN NULL
                          ELSE i.provisioned_at END
FROM unnest($1::uuid[], $2::text[]) AS u (id, state)
WHERE i.id = u.id
RETURNING i.id, i.generation;

-- name: sled_lock
SELECT state, boot_id, boot_number, inventory_seq FROM sleds WHERE id = $1 FOR UPDATE;

-- name: sleds_lock
-- The boots held for the sleds $1, locked in id order (those known: a new sled has no row yet).
SELECT id, boot_number FROM sleds WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE;

-- name: sleds_apply_inventories
-- Sleds make themselves known, and tell their boots, through their inventories (one per sled, $1
-- sorted). The inventory fence: only a strictly newer (boot number, sequence) than the one held is
-- written; returns the sleds written, with the boot number now held. The capacity is recorded as
-- reported, even below what is reserved (a sled that shrank is overcommitted, never wedged). Each row
-- also keeps what a stuck order is judged on: when the sled made the inventory ($7), the VMMs it
-- listed with their states ($8, a JSON object {vmm_id: state}) and since when by its clock ($10,
-- {vmm_id: time}), and the stream sequence up to which it has taken every command ($9).
INSERT INTO sleds (id, boot_id, boot_number, inventory_seq, vcpus, ram_bytes, inventory_made_at,
                   inventory_vmms, inventory_commands_read, inventory_since, last_seen_at)
SELECT u.id, u.boot_id, u.boot_number, u.seq, u.vcpus, u.ram_bytes, u.made_at, u.vmms::jsonb, u.commands_read,
       u.since::jsonb, now()
FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[], $5::int[], $6::bigint[],
            $7::timestamptz[], $8::text[], $9::bigint[], $10::text[])
    AS u (id, boot_id, boot_number, seq, vcpus, ram_bytes, made_at, vmms, commands_read, since)
ORDER BY 1
ON CONFLICT (id) DO UPDATE
SET boot_id = EXCLUDED.boot_id, boot_number = EXCLUDED.boot_number, inventory_seq = EXCLUDED.inventory_seq,
    vcpus = EXCLUDED.vcpus, ram_bytes = EXCLUDED.ram_bytes, inventory_made_at = EXCLUDED.inventory_made_at,
    inventory_vmms = EXCLUDED.inventory_vmms, inventory_commands_read = EXCLUDED.inventory_commands_read,
    inventory_since = EXCLUDED.inventory_since, last_seen_at = now()
WHERE (coalesce(sleds.boot_number, 0), coalesce(sleds.inventory_seq, -1))
      < (EXCLUDED.boot_number, EXCLUDED.inventory_seq)
RETURNING id, boot_id, boot_number;
-- name: sleds_view
-- The sleds $1, in id order.
SELECT s.id, s.state, s.boot_id, s.boot_number, s.vcpus, s.ram_bytes, s.reserved_vcpus, s.reserved_ram_bytes,
       s.last_seen_at, (SELECT count(*) FROM vmms v WHERE v.sled_id = s.id AND v.ended_at IS NULL) AS vmms
FROM sleds s WHERE s.id = ANY($1::text[]) ORDER BY s.id;

-- name: sled_page
-- A page of sleds after id $1, $2 at most (and one more, to tell whether another page follows).
SELECT s.id, s.state, s.boot_id, s.boot_number, s.vcpus, s.ram_bytes, s.reserved_vcpus, s.reserved_ram_bytes,
       s.last_seen_at, coalesce(v.n, 0) AS vmms
FROM sleds s
LEFT JOIN (SELECT sled_id, count(*) AS n FROM vmms WHERE ended_at IS NULL GROUP BY sled_id) v ON v.sled_id = s.id
WHERE $1::text IS NULL OR s.id > $1
ORDER BY s.id LIMIT $2 + 1;

-- name: outcomes_insert
-- Record the outcomes, and tell every replica once they are committed (Charging.hear_outcomes): the charge
-- waiting for one may be running in a replica other than the one whose consumer read it. Returns the
-- charges recorded (not those that had an outcome already).
WITH recorded AS (
    INSERT INTO charge_outcomes (instance_id, generation, outcome, reason)
    SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[])
    ON CONFLICT DO NOTHING
    RETURNING instance_id, generation
)
SELECT instance_id, generation, pg_notify('charge_outcome', instance_id::text || ':' || generation)
FROM recorded;

-- name: outcomes_known
-- Which of the charges ($1, $2) have an outcome recorded.
SELECT o.instance_id, o.generation
FROM charge_outcomes o JOIN unnest($1::uuid[], $2::bigint[]) AS u (instance_id, generation)
  ON o.instance_id = u.instance_id AND o.generation = u.generation;

-- name: outcome_get
SELECT outcome, reason FROM charge_outcomes WHERE instance_id = $1 AND generation = $2;

-- name: instances_vmm_ended
-- The instances' active VMMs ended: each lets go of it (and of a migration target), and is stopped or
-- failed ($2, with the reason $3 for a failure). Returns each one's new generation.
UPDATE instances i
SET state = u.state, active_vmm_id = NULL, target_vmm_id = NULL, generation = i.generation + 1,
    provisioned_at = NULL, last_error = coalesce(u.reason, i.last_error), updated_at = now(),
    failed_at = CASE WHEN u.state = 'failed' THEN now() ELSE i.failed_at END
FROM unnest($1::uuid[], $2::text[], $3::text[]) AS u (id, state, reason)
WHERE i.id = u.id
RETURNING i.id, i.generation;
-- name: instance_set_intent
-- Every change of intent is a change: it bumps the generation (the caller publishes the instance), so
-- that recovery sees it and any order decided on the old intent is stale. Nothing if the intent is so
-- already. Returns the new generation, or NULL.
UPDATE instances SET intended_state = $2, generation = generation + 1, updated_at = now()
WHERE id = $1 AND intended_state <> $2
RETURNING generation;

-- name: instance_create_undo
UPDATE instances SET state = 'destroyed', generation = generation + 1, last_error = $2, updated_at = now(),
                     has_customer_data_at = coalesce(has_customer_data_at, now())
WHERE id = $1 AND state = 'creating';

-- name: instance_create_ready
UPDATE instances SET state = 'stopped', generation = generation + 1, updated_at = now()
WHERE id = $1 AND state = 'creating';

-- name: instance_bump
UPDATE instances SET generation = generation + 1, updated_at = now() WHERE id = $1 RETURNING generation;

-- name: any_sled_with_room
-- Whether `place` (same parameters) could succeed if no other placement were under way.
SELECT EXISTS (
    SELECT 1 FROM sleds
    WHERE state = 'active' AND last_seen_at > now() - make_interval(secs => $5)
      AND ($3::text IS NULL OR id <> $3) AND ($4::text IS NULL OR id = $4)
      AND vcpus - reserved_vcpus >= $1 AND ram_bytes - reserved_ram_bytes >= $2
);

-- name: vmm_exists
SELECT EXISTS (SELECT 1 FROM vmms WHERE id = $1);

-- name: vmm_sled
SELECT sled_id FROM vmms WHERE id = $1;

-- name: settle_failed
-- A failed instance that will not be restarted comes to rest as stopped, unless it changed since ($2).
UPDATE instances SET state = 'stopped', intended_state = 'stopped', generation = generation + 1, updated_at = now()
WHERE id = $1 AND state = 'failed' AND generation = $2
RETURNING generation;

-- name: vmm_live
SELECT id, instance_id, sled_id FROM vmms WHERE id = $1 AND ended_at IS NULL;

-- name: vmms_live_on_sled
SELECT id, boot_number FROM vmms WHERE sled_id = $1 AND ended_at IS NULL ORDER BY id;

-- name: sled_expunge
-- Irreversible: an expunged sled never receives a placement again (place picks active sleds only).
UPDATE sleds SET state = 'expunged' WHERE id = $1;

-- name: migrate_interlock
-- One migration at a time, of a running instance only: a compare-and-set like the start interlock. The
-- target VMM ($2) is named now, so that every later step and report can be fenced by it.
UPDATE instances
SET state = 'migrating', target_vmm_id = $2, generation = generation + 1, updated_at = now()
WHERE id = $1 AND state = 'running' AND active_vmm_id IS NOT NULL AND target_vmm_id IS NULL
RETURNING generation, active_vmm_id, vcpus, ram_bytes;

-- name: migration_end
-- The migration to target $2 is over: the instance runs on $3 (the target if it took over, the source
-- if not), and is running again. Only while $2 is still its target.
UPDATE instances
SET state = 'running', active_vmm_id = $3, target_vmm_id = NULL, generation = generation + 1,
    last_error = coalesce($4, last_error), updated_at = now()
WHERE id = $1 AND target_vmm_id = $2 AND state = 'migrating'
RETURNING generation;

-- name: instance_vmms
SELECT active_vmm_id, target_vmm_id FROM instances WHERE id = $1;

-- name: vmms_lock
-- An order about VMMs locks their records first (in id order), then their instances: the order every
-- report takes too. $2: seconds after its end that a VMM counts as long ended.
SELECT id, instance_id, sled_id, boot_number, state, generation, ended_at, vcpus, ram_bytes,
       ended_at < now() - make_interval(secs => $2) AS ended_long_ago
FROM vmms WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE;
-- name: sleds_seen
-- What instance-manager itself knows of the sleds $1: each one's latest boot, and whether it answers
-- ($2 seconds).
SELECT id, state, boot_number, last_seen_at > now() - make_interval(secs => $2) AS answering
FROM sleds WHERE id = ANY($1::text[]);

-- name: stuck_evidence
-- What a stuck order about VMM $1 of instance $2 (both locked by the caller) is judged on, with the
-- VMM's sled locked after them (as ending the VMM locks it), so that an inventory being applied is
-- waited for and read: when the sled was asked (for a stop, when the instance began to stop: the stop
-- goes out after that commit; NULL: not asked yet), whether that is over $3 seconds ago by this
-- service's clock, whether the sled answers ($4 seconds), and its latest inventory: whether the sled
-- had taken the order to run the VMM off its stream (`read`; unknown counts as read), whether the sled
-- made it over $3 seconds after it was asked and after the VMM took its state (by the sled's clock),
-- and the VMM's state in it (NULL: not listed) and since when.
SELECT s.id AS sled_id, s.last_seen_at > now() - make_interval(secs => $4) AS answering,
       s.boot_number, s.inventory_seq, s.inventory_made_at, s.inventory_vmms ->> v.id::text AS shown,
       (s.inventory_since ->> v.id::text)::timestamptz AS shown_since,
       v.asked_seq, s.inventory_commands_read AS commands_read,
       coalesce(s.inventory_commands_read >= v.asked_seq, true) AS read,
       CASE WHEN i.state = 'stopping' THEN i.updated_at ELSE v.asked_at END AS asked_at,
       CASE WHEN i.state = 'stopping' THEN i.updated_at ELSE v.asked_at END
           < now() - make_interval(secs => $3) AS overdue,
       s.inventory_made_at > CASE WHEN i.state = 'stopping' THEN i.updated_at ELSE v.asked_at END
                             + make_interval(secs => $3) AS judged,
       coalesce(s.inventory_made_at > (s.inventory_since ->> v.id::text)::timestamptz
                                      + make_interval(secs => $3), true) AS settled
FROM vmms v JOIN instances i ON i.id = $2 JOIN sleds s ON s.id = v.sled_id
WHERE v.id = $1
FOR NO KEY UPDATE OF s;

-- name: vmm_asked
-- The VMM's sled has just been asked to run it (or, for a migration target, its source to hand over):
-- the transition timeout counts from now (the clock's, not the transaction's start). $2: the stream
-- sequence the order to run it was stored at (NULL: the one recorded stands), which the sled's
-- inventories tell it has read once they tell a later one.
UPDATE vmms SET asked_at = clock_timestamp(), asked_seq = coalesce($2, asked_seq)
WHERE id = $1 AND ended_at IS NULL;

-- name: vmm_claimants
-- Every instance that names the VMM as active or as its migration target, locked.
SELECT id FROM instances WHERE active_vmm_id = $1 OR target_vmm_id = $1 ORDER BY id FOR UPDATE;

-- name: failures_record
-- The evidence of failures the control plane made (the checker holds it against the sleds' history).
INSERT INTO failures (instance_id, vmm_id, sled_id, kind, reason, vmm_boot_number, proof_boot_number, proof_seq)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::bigint[],
                     $8::bigint[]);

-- name: charges_pending
-- Before deltas (instances $1 at generations $2) are sent: a resend of one already answered adds nothing.
INSERT INTO pending_charges (instance_id, generation)
SELECT u.id, u.generation FROM unnest($1::uuid[], $2::bigint[]) AS u (id, generation)
WHERE NOT EXISTS (SELECT 1 FROM charge_outcomes o WHERE o.instance_id = u.id AND o.generation = u.generation)
ON CONFLICT DO NOTHING;

-- name: charges_answered
-- The charges ($1, $2) that were waiting for their outcomes, and are answered now.
DELETE FROM pending_charges p USING unnest($1::uuid[], $2::bigint[]) AS u (instance_id, generation)
WHERE p.instance_id = u.instance_id AND p.generation = u.generation
RETURNING p.instance_id, p.generation;

-- name: silo_lock_limits
-- Tenant limits: the silo's own limits (NULL: the rack's default), its row locked so that the creates
-- of one silo that check a count serialize (FOR NO KEY UPDATE: a project insert's foreign key check,
-- FOR KEY SHARE, is not held up).
SELECT id, name, max_projects, max_instances, max_pool_members, command_rate
FROM silos WHERE name = $1 AND deleted_at IS NULL
FOR NO KEY UPDATE;

-- name: silo_limits
SELECT id, name, quota, created_at, max_projects, max_instances, max_pool_members, command_rate
FROM silos WHERE name = $1 AND deleted_at IS NULL;

-- name: silo_limits_set
-- The fleet operator's `silo limits`: each given limit ($2..$5, NULL: unchanged) replaces the silo's.
UPDATE silos SET max_projects = coalesce($2, max_projects), max_instances = coalesce($3, max_instances),
                 max_pool_members = coalesce($4, max_pool_members), command_rate = coalesce($5, command_rate)
WHERE name = $1 AND deleted_at IS NULL
RETURNING id;

-- name: silo_command_rates
-- The silos with a command rate of their own (the limiter's cache).
SELECT name, command_rate FROM silos WHERE command_rate IS NOT NULL AND deleted_at IS NULL;

-- name: silo_projects_count
-- The silo's live projects (a deleted one no longer counts against its limit).
SELECT count(*) FROM projects WHERE silo_id = $1 AND deleted_at IS NULL;

-- name: silo_instances_count
-- The silo's instances that are not destroyed (warm-pool VMs included: each is a VM of the silo's), for a
-- transaction holding the silo's lock (a create; the pruner): the changes recorded since the last fold
-- (migration 015) folded into its count, and how many were. A create's saga inserts its instance in the
-- create's own transaction (its first step), so the new one is counted; a change another transaction
-- has not committed yet stays for the next fold.
WITH folded AS (
    DELETE FROM silo_instance_changes WHERE silo_id = $1 RETURNING change
), sums AS (
    SELECT coalesce(sum(change), 0) AS change, count(*) AS n FROM folded
)
INSERT INTO silo_instance_counts AS c (silo_id, live)
SELECT $1, change FROM sums
ON CONFLICT (silo_id) DO UPDATE SET live = c.live + EXCLUDED.live
RETURNING c.live, (SELECT n FROM sums) AS folded;

-- name: silo_instances_live
-- silo_instances_count without the silo's lock, for `silo show`: what is folded, and what is not yet.
SELECT coalesce((SELECT live FROM silo_instance_counts WHERE silo_id = $1), 0)
     + coalesce((SELECT sum(change) FROM silo_instance_changes WHERE silo_id = $1), 0);

-- name: silo_pool_members_count
-- The warm-pool VMs the silo's live pools are meant to keep, but the pool named $2/$3 (a resize
-- replaces its size).
SELECT coalesce(sum(pl.target_size), 0)::bigint
FROM pools pl JOIN projects p ON p.id = pl.project_id
WHERE p.silo_id = $1 AND pl.state = 'active' AND NOT (p.name = $2 AND pl.name = $3);
