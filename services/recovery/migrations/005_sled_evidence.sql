-- A stuck order is sent only on the sled's own evidence: when the sled made its latest inventory (by
-- its own clock), beside the VMMs it listed. NULL until the sled's next inventory: no evidence yet.
ALTER TABLE sleds ADD COLUMN inventory_made_at timestamptz;
