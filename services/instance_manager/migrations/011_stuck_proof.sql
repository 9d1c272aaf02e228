-- A failure for being stuck keeps its evidence as a reboot's does: the sled's inventory it was judged on,
-- by (proof_boot_number, proof_seq), the sled's own order of its messages. The checker holds it against
-- the sled's reports: none of them may have said the VMM ran before that inventory (a late report is no
-- stuck VMM).
ALTER TABLE failures ADD COLUMN proof_seq bigint;
