-- Live migration: while an instance moves, its active VMM (the source) keeps running and the target VMM
-- waits to take over; both hold room on their sleds. A migration ends when the target takes over (it
-- becomes the active VMM) or when the target ends (the instance stays on the source).
ALTER TABLE instances ADD COLUMN target_vmm_id uuid;
ALTER TABLE instances ADD CONSTRAINT instances_target_only_while_migrating
    CHECK (target_vmm_id IS NULL OR state = 'migrating');
ALTER TABLE vmms DROP CONSTRAINT vmms_state_check;
ALTER TABLE vmms ADD CONSTRAINT vmms_state_check
    CHECK (state IN ('starting', 'running', 'migrating', 'stopping', 'stopped', 'failed', 'destroyed'));
