-- A VMM is judged stuck only on its sled's evidence: each sled keeps what its latest applied inventory
-- said (when the sled made it, by its own clock, and each VMM it listed with its state: {vmm_id: state}),
-- written by the inventory upsert that already writes the row, and each VMM when its sled was asked to
-- run it (a start's ensure, a migration's hand-over order to its source).
ALTER TABLE sleds ADD COLUMN inventory_made_at timestamptz;
ALTER TABLE sleds ADD COLUMN inventory_vmms jsonb;
ALTER TABLE vmms ADD COLUMN asked_at timestamptz;

-- Live VMMs made before this migration: asked when their saga's step that asked the sled was done, or,
-- without that record, when made if their sled has reported on them (it had them, so it was asked). A
-- VMM neither shows is taken as not asked yet: never judged stuck.
UPDATE vmms v SET asked_at = a.at
FROM (
    SELECT (s.data ->> 'vmm_id')::uuid AS id, max(e.at) AS at
    FROM sagas s JOIN saga_events e ON e.saga_id = s.id
    WHERE s.kind IN ('instance-start', 'instance-migrate') AND e.event = 'done'
      AND e.step IN ('ensure_on_sled', 'ensure_target', 'migrate_source')
    GROUP BY 1
) a
WHERE v.id = a.id AND v.ended_at IS NULL;
UPDATE vmms SET asked_at = created_at WHERE ended_at IS NULL AND asked_at IS NULL AND generation > 0;

-- A sled's boot and sequence are recorded even when its capacity cannot be: a sled that reports less
-- than is reserved on it (it shrank) is recorded as it reports itself, overcommitted, and gets no new
-- placement (place needs room left) until enough of its VMMs end. Its reservation may exceed its
-- capacity; it never goes below zero.
ALTER TABLE sleds DROP CONSTRAINT sleds_check;
ALTER TABLE sleds DROP CONSTRAINT sleds_check1;
ALTER TABLE sleds ADD CONSTRAINT sleds_reserved_vcpus_check CHECK (reserved_vcpus >= 0);
ALTER TABLE sleds ADD CONSTRAINT sleds_reserved_ram_bytes_check CHECK (reserved_ram_bytes >= 0);
