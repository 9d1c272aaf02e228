"""The checks that read the services' tables alone: what always holds (`ALWAYS`), and what holds once the
system is quiet, no saga or message in flight (`AT_REST`). Each returns one line per violation; an empty
list means the invariant holds. Their SQL is tables.sql."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from rackctl.invariants import audit
from rackctl.invariants.timings import Timings
from shared.db import queries
from shared.messages import CHARGED_STATES

Q = queries(Path(__file__).with_suffix(".sql"))


async def totals_match_ledger(conn: asyncpg.Connection) -> list[str]:
    """Project, silo and fleet totals equal the sums of the per-instance charges (the audit's rule)."""
    return [d.line() for d in await audit.total_drifts(conn)]


async def quotas_respected(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(Q["silos_over_quota"])
    return [f"silo {r['name']} exceeds its quota: {dict(r)}" for r in rows]


async def charges_follow_instances(conn: asyncpg.Connection) -> list[str]:
    """At rest: an instance holds a vCPU/RAM charge iff it has a live VMM, and its disk iff it exists (the
    charge rule is the audit's); and it is in a charged state iff it names an active VMM."""
    out = [d.line() for d in await audit.charge_drifts(conn)]
    rows = await conn.fetch(Q["charged_state_without_vmm"], sorted(str(s) for s in CHARGED_STATES))
    out += [
        f"instance {r['name']} ({r['id']}) is {r['state']} with active VMM {r['active_vmm_id']}" for r in rows
    ]
    return out


async def reservations_match_vmms(conn: asyncpg.Connection) -> list[str]:
    """Each sled's reservation equals the sum over its live VMMs (it may exceed a capacity the sled has
    since shrunk to: the sled is then overcommitted, and placement adds nothing to it)."""
    rows = await conn.fetch(Q["sled_reservations"])
    return [
        f"sled {r['id']}: reserved ({r['reserved_vcpus']}, {r['reserved_ram_bytes']}) != "
        f"live VMMs ({r['v_vcpus']}, {r['v_ram']})"
        for r in rows
        if (r["reserved_vcpus"], r["reserved_ram_bytes"]) != (r["v_vcpus"], r["v_ram"])
    ]


async def silo_counts_match_instances(conn: asyncpg.Connection) -> list[str]:
    """Each silo's count of its live instances, which its instance limit is checked against at every
    create, is the number of its instances that are not destroyed."""
    rows = await conn.fetch(Q["silo_counts_drifted"])
    return [f"silo {r['name']} counts {r['counted']} live instances, holds {r['live']}" for r in rows]


async def one_live_vmm(conn: asyncpg.Connection) -> list[str]:
    """No instance has two live VMMs outside a migration (where the second is its migration target)."""
    rows = await conn.fetch(Q["instances_with_two_live_vmms"])
    return [f"instance {r['instance_id']} has {r['n']} live VMMs" for r in rows]


async def claimed_vmms_live(conn: asyncpg.Connection) -> list[str]:
    """Every VMM an instance names, as active or as its migration target, has a live record on the same
    instance: an instance never points at a VMM that was ended (or destroyed) under it."""
    out = []
    for r in await conn.fetch(Q["claimed_vmms_not_live"]):
        why = (
            "no record"
            if r["owner"] is None
            else f"its record ended at {r['ended_at'].isoformat()}"
            if r["ended_at"] is not None
            else f"it belongs to instance {r['owner']}"
        )
        out.append(f"instance {r['id']}: its {r['role']} VMM {r['vmm_id']} is not live ({why})")
    return out


async def no_unfinished_sagas(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(Q["unfinished_sagas"])
    return [f"saga {r['kind']} {r['id']} still {r['status']}" for r in rows]


async def no_saga_run_twice(conn: asyncpg.Connection) -> list[str]:
    """No saga was run by two processes at once: every step's event names the process that ran it
    (instance-manager's saga leases), and a saga passes from one process to another only when the first
    has let go of it. So no process's steps resume after another's (A, then B, then A again), and no
    two processes record the same step. Steps logged before leases name no process and are not judged."""
    if not await conn.fetchval(Q["saga_events_have_owner"]):
        return []  # a schema from before saga leases
    rows = await conn.fetch(Q["sagas_run_twice"])
    return [f"saga {r['kind']} {r['saga_id']} was run by two processes at once: {r['what']}" for r in rows]


async def totals_never_negative(conn: asyncpg.Connection) -> list[str]:
    """No total (project, silo) and no instance's charge is below zero (the fleet's is the sum of the
    silos')."""
    return [
        f"{r['what']} is below zero: ({r['vcpus']}, {r['ram_bytes']}, {r['disk_bytes']})"
        for r in await conn.fetch(Q["totals_and_charges"])
        if min(r["vcpus"], r["ram_bytes"], r["disk_bytes"]) < 0
    ]


async def no_stuck_transitions(conn: asyncpg.Connection, timings: Timings | None = None) -> list[str]:
    """At rest: no instance stays starting, stopping or migrating longer than the transition timeout
    (recovery acts on it by then). `timings`: this process's settings when not given."""
    timeout = (timings or Timings.from_env()).transition_timeout
    rows = await conn.fetch(Q["stuck_transitions"], timeout)
    return [
        f"instance {r['name']} ({r['id']}) has been {r['state']} for {r['age']:.0f}s "
        f"(transition timeout {timeout:g}s)"
        for r in rows
    ]


async def vmms_claimed(conn: asyncpg.Connection) -> list[str]:
    """At rest: every live VMM record is claimed by an instance, as its active VMM or its migration target.
    A live record holds room on its sled and stands for a VM that may run; one nobody claims is a VM the
    control plane lost track of (charged to nobody, fenced from the zombie destroy by its live record)."""
    return [
        f"VMM {r['id']} on {r['sled_id']} ({r['state']}) has a live record no instance claims (its "
        f"instance {r['name']} ({r['instance_id']}) is {r['instance_state']})"
        for r in await conn.fetch(Q["unclaimed_live_vmms"])
    ]


async def intent_honoured(conn: asyncpg.Connection, timings: Timings | None = None) -> list[str]:
    """At rest: no instance runs against its intent for longer than a reconcile pass
    (RACKPLANE_RECONCILE_INTERVAL): none is running while meant to be stopped (a pool member being retired
    included) a pass after its last change, or starting or migrating so a pass past the transition
    timeout; and none that is failed, meant to run and restarted automatically (best_effort) has a restart
    overdue by more than a pass (when it is due: instance_view's rule, with this process's cooldown and
    backoff settings). Stopped but meant to run is not judged: a pool member whose start was refused waits
    there, by design. `timings`: this process's settings when not given."""
    s = timings or Timings.from_env()
    rows = await conn.fetch(
        Q["intent_overdue"],
        s.reconcile_interval,
        s.transition_timeout,
        s.restart_cooldown,
        s.restart_backoff_max,
    )
    out = []
    for r in rows:
        if r["due"] is not None:
            out.append(
                f"instance {r['name']} ({r['id']}) is failed and meant to run (best_effort), its restart "
                f"overdue by {r['overdue']:.0f}s (reconcile interval {s.reconcile_interval:g}s)"
            )
        else:
            out.append(
                f"instance {r['name']} ({r['id']}) has been {r['state']} for {r['age']:.0f}s while meant "
                f"to be {r['intended_state']} (reconcile interval {s.reconcile_interval:g}s)"
            )
    return out


async def outboxes_empty(conn: asyncpg.Connection) -> list[str]:
    """At rest: every service's outbox is empty, so every message that followed a commit was published."""
    return [
        f"outbox of {r['table_schema']}: {r['held']} committed message(s) not published"
        for r in await conn.fetch(Q["outbox_backlogs"])
        if r["held"]
    ]


ALWAYS = (
    totals_match_ledger,
    totals_never_negative,
    quotas_respected,
    silo_counts_match_instances,
    one_live_vmm,
    claimed_vmms_live,
    no_saga_run_twice,
)
AT_REST = (
    charges_follow_instances,
    reservations_match_vmms,
    no_unfinished_sagas,
    no_stuck_transitions,
    outboxes_empty,
    vmms_claimed,
    intent_honoured,
)
TIMED = (no_stuck_transitions, intent_honoured)
"""The checks that judge by the service timings (`Timings`)."""
