-- A start waiting unread on its sled's command stream is not stuck (orders._check_stuck). The order to
-- run a VMM records the stream sequence it was stored at (asked_seq); a sled's inventory tells the last
-- command it took (inventory_commands_read) and, for each VMM it lists, when the VMM took its state by
-- the sled's clock (inventory_since, {vmm_id: time}). A VMM is judged only once its sled has read the
-- order, and only on how long the sled has had it in its state, not on how long ago it was asked.
-- Every column may be NULL (records and inventories from before, or from a sled that does not tell):
-- then the rule before this one holds. Nothing is rewritten: replicas of the version before run on.
ALTER TABLE vmms ADD COLUMN asked_seq bigint;
ALTER TABLE sleds ADD COLUMN inventory_commands_read bigint, ADD COLUMN inventory_since jsonb;
