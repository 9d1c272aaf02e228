"""The invariant checker and the usage audit: they read every service's tables (read-only, across schemas)
and, at rest, the broker, and list what does not hold.

An auditor, so unlike the services it reads across schemas. Each check returns one line per violation; an
empty list means the invariant holds. Checks marked "at rest" hold only once the system is quiet (no saga
or message in flight). `rackctl check` runs them all (`check`), `rackctl usage audit` the audit. Each
module keeps its SQL in the .sql file of its name, loaded as the services load theirs:

- `tables`: the checks that read the tables alone (`ALWAYS`, `AT_REST`);
- `audit`: the usage audit, totals against charges and charges against states (`rackctl usage audit`);
- `broker`: what the broker holds against the records (consumers settled, zombies, destroy orders, pool
  picks, inventories applied);
- `failures`: the failures the control plane made, against the sleds' own word;
- `acknowledged`: what the operator was told, against the rack;
- `checker`: running them (`check`, `check_each`, `names`).
"""

from rackctl.invariants.acknowledged import ENDED, VERBS, Sent, no_acknowledged_command_lost
from rackctl.invariants.broker import (
    CONSUMERS,
    SETTLE_GRACE,
    consumers_settled,
    inventory_in_flight,
    judged,
    latest_inventories,
    newest_inventory_applied,
    no_claimed_vmm_destroyed,
    no_zombie_vmms,
    pool_vms_handed_out_once,
    vmms_pruned_before,
)
from rackctl.invariants.checker import BROKER_AT_REST, check, check_each, names, recent_dead_letters
from rackctl.invariants.failures import no_running_vmm_called_stuck, no_wrongful_kills, sled_boots
from rackctl.invariants.tables import (
    ALWAYS,
    AT_REST,
    charges_follow_instances,
    claimed_vmms_live,
    intent_honoured,
    no_saga_run_twice,
    no_stuck_transitions,
    no_unfinished_sagas,
    one_live_vmm,
    outboxes_empty,
    quotas_respected,
    reservations_match_vmms,
    silo_counts_match_instances,
    totals_match_ledger,
    totals_never_negative,
    vmms_claimed,
)

__all__ = [
    "ALWAYS",
    "AT_REST",
    "BROKER_AT_REST",
    "CONSUMERS",
    "ENDED",
    "SETTLE_GRACE",
    "VERBS",
    "Sent",
    "charges_follow_instances",
    "check",
    "check_each",
    "claimed_vmms_live",
    "consumers_settled",
    "intent_honoured",
    "inventory_in_flight",
    "judged",
    "latest_inventories",
    "names",
    "newest_inventory_applied",
    "no_acknowledged_command_lost",
    "no_claimed_vmm_destroyed",
    "no_running_vmm_called_stuck",
    "no_saga_run_twice",
    "no_stuck_transitions",
    "no_unfinished_sagas",
    "no_wrongful_kills",
    "no_zombie_vmms",
    "one_live_vmm",
    "outboxes_empty",
    "pool_vms_handed_out_once",
    "quotas_respected",
    "recent_dead_letters",
    "reservations_match_vmms",
    "silo_counts_match_instances",
    "sled_boots",
    "totals_match_ledger",
    "totals_never_negative",
    "vmms_claimed",
    "vmms_pruned_before",
]
