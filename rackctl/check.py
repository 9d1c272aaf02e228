"""The invariant checker: reads every service's tables and lists what does not hold.

It is an auditor, so unlike the services it reads across schemas (read-only). Each check returns one line
per violation; an empty list means the invariant holds. Checks marked "at rest" hold only once the system
is quiet (no saga or message in flight). The broker checks (`BROKER_AT_REST`) also read JetStream: what
was published was consumed, and what the sleds run has a record. `rackctl check` runs them all.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from deploy import identities
from rackctl import audit, dlq, stored
from shared import subjects
from shared.config import restart_backoff_max, restart_cooldown, settings, transition_timeout
from shared.messages import (
    CHARGED_STATES,
    BadMessage,
    InstanceChanged,
    InstanceChangedV2,
    PoolChanged,
    SledInventory,
    VmmDestroy,
    VmmReport,
    VmmState,
    decode,
)


async def totals_match_ledger(conn: asyncpg.Connection) -> list[str]:
    """Project, silo and fleet totals equal the sums of the per-instance charges (rackctl/audit.py)."""
    return [d.line() for d in await audit.total_drifts(conn)]


async def quotas_respected(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(
        """
        SELECT name, vcpus, quota_vcpus, ram_bytes, quota_ram_bytes, disk_bytes, quota_disk_bytes
        FROM accounting.silos
        WHERE vcpus > quota_vcpus OR ram_bytes > quota_ram_bytes OR disk_bytes > quota_disk_bytes
        """
    )
    return [f"silo {r['name']} exceeds its quota: {dict(r)}" for r in rows]


async def charges_follow_instances(conn: asyncpg.Connection) -> list[str]:
    """At rest: an instance holds a vCPU/RAM charge iff it has a live VMM, and its disk iff it exists (the
    charge rule is rackctl/audit.py's); and it is in a charged state iff it names an active VMM."""
    out = [d.line() for d in await audit.charge_drifts(conn)]
    rows = await conn.fetch(
        """
        SELECT id, name, state, active_vmm_id FROM instance_manager.instances
        WHERE state <> 'creating' AND (state = ANY($1::text[])) <> (active_vmm_id IS NOT NULL)
        ORDER BY id
        """,
        sorted(str(s) for s in CHARGED_STATES),
    )
    out += [
        f"instance {r['name']} ({r['id']}) is {r['state']} with active VMM {r['active_vmm_id']}" for r in rows
    ]
    return out


async def reservations_match_vmms(conn: asyncpg.Connection) -> list[str]:
    """Each sled's reservation equals the sum over its live VMMs (it may exceed a capacity the sled has
    since shrunk to: the sled is then overcommitted, and placement adds nothing to it)."""
    rows = await conn.fetch(
        """
        SELECT s.id, s.reserved_vcpus, s.reserved_ram_bytes, s.vcpus, s.ram_bytes,
               coalesce(sum(v.vcpus), 0) AS v_vcpus, coalesce(sum(v.ram_bytes), 0) AS v_ram
        FROM instance_manager.sleds s
        LEFT JOIN instance_manager.vmms v ON v.sled_id = s.id AND v.ended_at IS NULL
        GROUP BY s.id
        """
    )
    return [
        f"sled {r['id']}: reserved ({r['reserved_vcpus']}, {r['reserved_ram_bytes']}) != "
        f"live VMMs ({r['v_vcpus']}, {r['v_ram']})"
        for r in rows
        if (r["reserved_vcpus"], r["reserved_ram_bytes"]) != (r["v_vcpus"], r["v_ram"])
    ]


async def one_live_vmm(conn: asyncpg.Connection) -> list[str]:
    """No instance has two live VMMs outside a migration (where the second is its migration target)."""
    rows = await conn.fetch(
        """
        SELECT v.instance_id, count(*) AS n
        FROM instance_manager.vmms v JOIN instance_manager.instances i ON i.id = v.instance_id
        WHERE v.ended_at IS NULL AND v.id IS DISTINCT FROM i.target_vmm_id
        GROUP BY v.instance_id HAVING count(*) > 1
        """
    )
    return [f"instance {r['instance_id']} has {r['n']} live VMMs" for r in rows]


async def claimed_vmms_live(conn: asyncpg.Connection) -> list[str]:
    """Every VMM an instance names, as active or as its migration target, has a live record on the same
    instance: an instance never points at a VMM that was ended (or destroyed) under it."""
    rows = await conn.fetch(
        """
        SELECT i.id, c.role, c.vmm_id, v.instance_id AS owner, v.ended_at
        FROM instance_manager.instances i
        CROSS JOIN LATERAL (VALUES ('active', i.active_vmm_id), ('target', i.target_vmm_id))
            AS c(role, vmm_id)
        LEFT JOIN instance_manager.vmms v ON v.id = c.vmm_id
        WHERE c.vmm_id IS NOT NULL
          AND (v.id IS NULL OR v.ended_at IS NOT NULL OR v.instance_id IS DISTINCT FROM i.id)
        """
    )
    out = []
    for r in rows:
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
    rows = await conn.fetch(
        "SELECT id, kind, status FROM instance_manager.sagas WHERE status IN ('running', 'unwinding')"
    )
    return [f"saga {r['kind']} {r['id']} still {r['status']}" for r in rows]


async def no_saga_run_twice(conn: asyncpg.Connection) -> list[str]:
    """No saga was run by two processes at once: every step's event names the process that ran it
    (instance-manager's saga leases), and a saga passes from one process to another only when the first
    has let go of it. So no process's steps resume after another's (A, then B, then A again), and no
    two processes record the same step. Steps logged before leases name no process and are not judged."""
    if not await conn.fetchval(
        """
        SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'instance_manager'
                       AND table_name = 'saga_events' AND column_name = 'owner')
        """
    ):
        return []  # a schema from before saga leases
    rows = await conn.fetch(
        """
        WITH e AS (
            SELECT saga_id, seq, step, event, owner,
                   lag(owner) OVER (PARTITION BY saga_id ORDER BY seq) AS before,
                   min(seq) OVER (PARTITION BY saga_id, owner) AS owners_first
            FROM instance_manager.saga_events WHERE owner IS NOT NULL
        ), back AS (  -- an owner's run of steps that begins after another's, when it had had one before
            SELECT saga_id, owner, step, event, before FROM e
            WHERE before IS NOT NULL AND before <> owner AND owners_first < seq
        ), twice AS (
            SELECT saga_id, step, event, array_agg(DISTINCT owner ORDER BY owner) AS owners
            FROM e GROUP BY saga_id, step, event HAVING count(DISTINCT owner) > 1
        )
        SELECT s.kind, b.saga_id, format('%s ran %s (%s) after %s had taken over from it', b.owner,
                                         b.step, b.event, b.before) AS what
        FROM back b JOIN instance_manager.sagas s ON s.id = b.saga_id
        UNION ALL
        SELECT s.kind, t.saga_id, format('%s (%s) recorded by %s', t.step, t.event,
                                         array_to_string(t.owners, ' and ')) AS what
        FROM twice t JOIN instance_manager.sagas s ON s.id = t.saga_id
        ORDER BY 2, 3
        """
    )
    return [f"saga {r['kind']} {r['saga_id']} was run by two processes at once: {r['what']}" for r in rows]


async def totals_never_negative(conn: asyncpg.Connection) -> list[str]:
    """No total (project, silo) and no instance's charge is below zero (the fleet's is the sum of the
    silos')."""
    rows = await conn.fetch(
        """
        SELECT 'project ' || id AS what, vcpus, ram_bytes, disk_bytes FROM accounting.projects
        UNION ALL SELECT 'silo ' || name, vcpus, ram_bytes, disk_bytes FROM accounting.silos
        UNION ALL SELECT 'charge of instance ' || instance_id, vcpus, ram_bytes, disk_bytes
            FROM accounting.instance_charges
        """
    )
    return [
        f"{r['what']} is below zero: ({r['vcpus']}, {r['ram_bytes']}, {r['disk_bytes']})"
        for r in rows
        if min(r["vcpus"], r["ram_bytes"], r["disk_bytes"]) < 0
    ]


async def no_stuck_transitions(conn: asyncpg.Connection) -> list[str]:
    """At rest: no instance stays starting, stopping or migrating longer than the transition timeout
    (recovery acts on it by then)."""
    rows = await conn.fetch(
        """
        SELECT id, name, state, extract(epoch FROM now() - updated_at) AS age
        FROM instance_manager.instances
        WHERE state IN ('starting', 'stopping', 'migrating')
          AND updated_at < now() - make_interval(secs => $1)
        """,
        transition_timeout(),
    )
    return [
        f"instance {r['name']} ({r['id']}) has been {r['state']} for {r['age']:.0f}s "
        f"(transition timeout {transition_timeout():g}s)"
        for r in rows
    ]


async def vmms_claimed(conn: asyncpg.Connection) -> list[str]:
    """At rest: every live VMM record is claimed by an instance, as its active VMM or its migration target.
    A live record holds room on its sled and stands for a VM that may run; one nobody claims is a VM the
    control plane lost track of (charged to nobody, fenced from the zombie destroy by its live record)."""
    rows = await conn.fetch(
        """
        SELECT v.id, v.sled_id, v.state, v.instance_id, i.name, i.state AS instance_state
        FROM instance_manager.vmms v
        LEFT JOIN instance_manager.instances i ON i.id = v.instance_id
        WHERE v.ended_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM instance_manager.instances c WHERE c.active_vmm_id = v.id)
          AND NOT EXISTS (SELECT 1 FROM instance_manager.instances c WHERE c.target_vmm_id = v.id)
        ORDER BY v.id
        """
    )
    return [
        f"VMM {r['id']} on {r['sled_id']} ({r['state']}) has a live record no instance claims (its "
        f"instance {r['name']} ({r['instance_id']}) is {r['instance_state']})"
        for r in rows
    ]


async def intent_honoured(conn: asyncpg.Connection) -> list[str]:
    """At rest: no instance runs against its intent for longer than a reconcile pass
    (RACKPLANE_RECONCILE_INTERVAL): none is running while meant to be stopped (a pool member being retired
    included) a pass after its last change, or starting or migrating so a pass past the transition
    timeout; and none that is failed, meant to run and restarted automatically (best_effort) has a restart
    overdue by more than a pass (when it is due: instance_view's rule, with this process's cooldown and
    backoff settings). Stopped but meant to run is not judged: a pool member whose start was refused waits
    there, by design."""
    s = settings()
    rows = await conn.fetch(
        """
        SELECT id, name, state, intended_state, extract(epoch FROM now() - updated_at) AS age, due,
               extract(epoch FROM now() - due) AS overdue
        FROM instance_manager.instances i
        CROSS JOIN LATERAL (
            SELECT CASE
                WHEN i.state = 'failed' AND i.auto_restart = 'best_effort' AND i.intended_state = 'running'
                THEN greatest(i.failed_at, i.last_auto_restart_at
                              + make_interval(secs => least($3 * 2 ^ least(i.restart_failures, 30),
                                                            greatest($3, $4))))
            END AS due) d
        WHERE (intended_state = 'stopped' AND state = 'running'
               AND updated_at < now() - make_interval(secs => $1))
           OR (intended_state = 'stopped' AND state IN ('starting', 'migrating')
               AND updated_at < now() - make_interval(secs => $1 + $2))
           OR due < now() - make_interval(secs => $1)
        ORDER BY id
        """,
        s.reconcile_interval,
        transition_timeout(),
        restart_cooldown(),
        restart_backoff_max(),
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
    schemas = await conn.fetch(
        "SELECT table_schema FROM information_schema.tables WHERE table_name = 'outbox' ORDER BY 1"
    )
    out = []
    for r in schemas:
        left = await conn.fetchval(f'SELECT count(*) FROM "{r["table_schema"]}".outbox')
        if left:
            out.append(f"outbox of {r['table_schema']}: {left} committed message(s) not published")
    return out


ALWAYS = (
    totals_match_ledger,
    totals_never_negative,
    quotas_respected,
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


# --- what the broker holds (at rest) ----------------------------------------------------------------------

CONSUMERS = {
    "instance-manager-vmm-reports": subjects.SLED_REPORT_STREAM,
    "instance-manager-inventory": subjects.SLED_REPORT_STREAM,
    "instance-manager-outcomes": subjects.EVENTS_STREAM,
    **{subjects.delta_durable(p): subjects.PROVISION_STREAM for p in range(subjects.DELTA_PARTITIONS)},
    "accounting-silos": subjects.EVENTS_STREAM,
    "accounting-projects": subjects.EVENTS_STREAM,
    "recovery-instances": subjects.EVENTS_STREAM,
    "recovery-instances-v2": subjects.EVENTS_STREAM,
    "recovery-inventory": subjects.SLED_REPORT_STREAM,
    "recovery-sleds": subjects.EVENTS_STREAM,
}
"""The services' fixed durable consumers (the sleds' own, `sled-agent-<sled>`, come and go with them)."""


def judged(c: Any) -> bool:
    """A durable consumer, which must keep up; not an ephemeral one (an operator's `events follow`, an
    ordered reader), nor the one an earlier release made on EVENTS for the events reader (a third party's,
    read at its own pace; the events reader is a subscriber now, with a stream of its own)."""
    return bool(c.config.durable_name) and c.name != identities.EVENTS_READER


SETTLE_GRACE = 5.0
"""Seconds a consumer has, at rest, to settle what it held when the check began: sleds publish
inventories on a timer, so even a quiet rack has one in flight now and then."""


async def consumers_settled(js: JetStreamContext, grace: float = SETTLE_GRACE) -> list[str]:
    """At rest: every durable consumer of rackplane's streams (but a third party's: `judged`) settles
    everything published before the check began (applied, dropped as stale or duplicate by its handler, or
    dead-lettered with its reason; the DLQ stream keeps those). A consumer passes at once with nothing
    pending or unacked; otherwise it passes when, within `grace`, it is seen idle or its ack floor reaches
    the stream's last message as it was at the start (everything up to the floor is acked, so nothing held
    then is left)."""
    out = []
    seen: set[str] = set()
    busy: dict[tuple[str, str], int] = {}
    for stream in subjects.STREAMS:
        try:
            infos = await _consumers_of(js, stream)
            last = (await js.stream_info(stream)).state.last_seq
        except Exception as e:
            out.append(f"stream {stream}: cannot read its consumers: {type(e).__name__}: {e}")
            continue
        for c in infos:
            seen.add(c.name)
            if not judged(c):
                continue  # a follower's, the events reader's: how far it has read is its own business
            if c.num_pending or c.num_ack_pending:
                busy[(stream, c.name)] = last
    deadline = asyncio.get_running_loop().time() + grace
    while busy:
        await asyncio.sleep(min(0.25, grace))
        final = asyncio.get_running_loop().time() >= deadline
        for (stream, name), last in list(busy.items()):
            try:
                c = await js.consumer_info(stream, name)
            except nats.js.errors.NotFoundError:
                del busy[(stream, name)]  # deleted since (a sled removed): nothing of it is left to settle
                continue
            floor = c.ack_floor.stream_seq if c.ack_floor else 0
            if not (c.num_pending or c.num_ack_pending) or floor >= last:
                del busy[(stream, name)]
            elif final:
                del busy[(stream, name)]
                out.append(
                    f"consumer {name} on {stream}: {c.num_pending or 0} message(s) not delivered, "
                    f"{c.num_ack_pending or 0} not acknowledged"
                )
    for durable, stream in CONSUMERS.items():
        if durable not in seen:
            out.append(f"consumer {durable} on {stream}: cannot read it (not on the broker)")
    return out


async def _consumers_of(js: JetStreamContext, stream: str) -> list[Any]:
    infos: list[Any] = []
    while True:
        page = await js.consumers_info(stream, offset=len(infos))
        infos += page
        if len(page) < 256:
            return infos


async def vmms_pruned_before(conn: asyncpg.Connection) -> datetime | None:
    """How far instance-manager has pruned ended VMM records: one that ended before this may be gone."""
    if await conn.fetchval("SELECT to_regclass('instance_manager.pruned_before')") is None:
        return None
    return await conn.fetchval("SELECT at FROM instance_manager.pruned_before WHERE what = 'vmms'")


Latest = tuple[list[tuple[Any, SledInventory]], list[str]]
"""Each sled's last inventory in SLED_REPORT with when it was made, and what could not be read."""


async def no_zombie_vmms(
    conn: asyncpg.Connection, js: JetStreamContext, latest: Latest | None = None
) -> list[str]:
    """At rest: every VMM a sled runs, by its latest inventory, has a live record on that sled. A record
    that ended after the inventory was made does not count against it (the inventory predates the end);
    expunged sleds are out of the rack and not checked. A VMM without a record in an inventory made before
    the pruning horizon is not judged: its record may have ended after the inventory, and been pruned. A
    sled silent for longer than RACKPLANE_INVENTORY_TTL has no inventory left in the stream to judge.
    `latest`: the inventories, if already read (`_latest_inventories`)."""
    inventories, problems = latest if latest is not None else await _latest_inventories(js)
    out = list(problems)
    horizon = await vmms_pruned_before(conn)
    expunged = {
        r["id"] for r in await conn.fetch("SELECT id FROM instance_manager.sleds WHERE state = 'expunged'")
    }
    for sent_at, inv in inventories:
        if inv.sled_id in expunged or not inv.vmms:
            continue
        records = {
            r["id"]: r
            for r in await conn.fetch(
                "SELECT id, sled_id, ended_at FROM instance_manager.vmms WHERE id = ANY($1::uuid[])",
                [v.vmm_id for v in inv.vmms],
            )
        }
        for v in inv.vmms:
            r = records.get(v.vmm_id)
            if r is None and horizon is not None and sent_at < horizon:
                continue
            if r is None:
                why = "no record"
            elif r["sled_id"] != inv.sled_id:
                why = f"its record places it on {r['sled_id']}"
            elif r["ended_at"] is not None and r["ended_at"] < sent_at:
                why = f"its record ended at {r['ended_at'].isoformat()}"
            else:
                continue
            out.append(
                f"sled {inv.sled_id}: VMM {v.vmm_id} of instance {v.instance_id} is {v.state.value} "
                f"without a live record (zombie): {why}"
            )
    return out


async def _latest_inventories(js: JetStreamContext) -> Latest:
    """The last inventory of each sled in SLED_REPORT, with when it was made; and what could not be read."""
    found: list[tuple[Any, SledInventory]] = []
    problems: list[str] = []
    pattern = subjects.sled_report("*", "inventory")
    try:
        info = await js.stream_info(subjects.SLED_REPORT_STREAM, subjects_filter=pattern)
    except Exception as e:
        return [], [f"stream {subjects.SLED_REPORT_STREAM}: cannot read it: {type(e).__name__}: {e}"]
    for subject in sorted(info.state.subjects or {}):
        try:
            raw = await js.get_last_msg(subjects.SLED_REPORT_STREAM, subject)
            env, inv = decode(raw.data or b"", SledInventory)
        except nats.js.errors.NotFoundError:
            continue  # aged out of the stream
        except BadMessage as e:
            problems.append(f"last inventory on {subject} is unreadable: {e.reason}")
            continue
        except Exception as e:
            problems.append(f"last inventory on {subject}: cannot read it: {type(e).__name__}: {e}")
            continue
        assert isinstance(inv, SledInventory)
        found.append((env.time, inv))
    return found, problems


def inventory_in_flight() -> float:
    """Seconds a sled's newest inventory may wait to be applied: two of its intervals (the one on its way
    and the one before) or the settle grace, whichever is longer."""
    return max(SETTLE_GRACE, 2 * settings().inventory_interval)


async def newest_inventory_applied(
    conn: asyncpg.Connection, js: JetStreamContext, latest: Latest | None = None
) -> list[str]:
    """At rest: every sled's newest inventory in SLED_REPORT is applied by instance-manager (its `sleds`
    row holds that (boot number, sequence) or a newer one) and by recovery (its own `sleds` row). One
    younger than `inventory_in_flight()` may still be on its way: it passes if the service applied an
    inventory of that sled no longer than that before it was made, or none yet. So a sled whose
    inventories are all dead-lettered (or never read) is seen, whose new boot neither service would ever
    learn. Expunged sleds are out of the rack and not checked; what cannot be read is no_zombie_vmms's to
    report. `latest`: the inventories, if already read."""
    inventories, _ = latest if latest is not None else await _latest_inventories(js)
    flight = inventory_in_flight()
    now = await conn.fetchval("SELECT now()")
    held = {
        (r["service"], r["id"]): r
        for r in await conn.fetch(
            """
            SELECT 'instance-manager' AS service, id, state, boot_number, inventory_seq,
                   last_seen_at AS applied_at
            FROM instance_manager.sleds
            UNION ALL
            SELECT 'recovery', id, state, boot_number, inventory_seq,
                   CASE WHEN isfinite(last_inventory_at) THEN last_inventory_at END
            FROM recovery.sleds
            """
        )
    }
    out = []
    for sent_at, inv in sorted(inventories, key=lambda x: x[1].sled_id):
        im = held.get(("instance-manager", inv.sled_id))
        if im is not None and im["state"] == "expunged":
            continue
        newest = (inv.boot_number, inv.seq)
        young = (now - sent_at).total_seconds() < flight
        for service in ("instance-manager", "recovery"):
            r = held.get((service, inv.sled_id))
            mark = (-1, -1) if r is None else (r["boot_number"] or 0, _seq(r["inventory_seq"]))
            if mark >= newest:
                continue
            applied = None if r is None else r["applied_at"]
            if young and (applied is None or (sent_at - applied).total_seconds() < flight):
                continue  # on its way: the one before it was applied lately (or it is the sled's first)
            since = "never" if applied is None else f"last at {applied.isoformat()}"
            out.append(
                f"sled {inv.sled_id}: its newest inventory (boot {inv.boot_number}, seq {inv.seq}, made at "
                f"{sent_at.isoformat()}) is not applied by {service}, which holds (boot {mark[0]}, seq "
                f"{mark[1]}), applied {since}"
            )
    return out


def _seq(value: int | None) -> int:
    return -1 if value is None else value


async def pool_vms_handed_out_once(js: JetStreamContext) -> list[str]:
    """No pool VM was handed out twice: across the durable pool events, each VM is picked at most once.

    A pick is its event's envelope id: a copy of one message (a resend, or a duplicate past the broker's
    dedupe) is the same pick; another pick of the same VM would be another message."""
    picks: collections.defaultdict[str, set[str]] = collections.defaultdict(set)
    async for msg in stored.messages(js, subjects.EVENTS_STREAM, subjects.event("*", "pool", "changed")):
        try:
            env, event = decode(msg.data or b"", PoolChanged)
        except BadMessage:
            continue
        assert isinstance(event, PoolChanged)
        if event.change == "picked" and event.instance_id is not None:
            picks[str(event.instance_id)].add(str(env.id))
    return [
        f"pool VM {vm} was handed out {len(ids)} times" for vm, ids in sorted(picks.items()) if len(ids) > 1
    ]


async def no_claimed_vmm_destroyed(conn: asyncpg.Connection, js: JetStreamContext) -> list[str]:
    """No VMM was destroyed while an instance claimed it: every destroy order in SLED_CMD came after the
    end of the VMM's record (an instance holds a VMM exactly while its record is live), or is about a VMM
    the control plane has no record of (a zombie nobody ever claimed, or a record pruned: pruning keeps
    every record that ended after the horizon, so an order sent since is judged in full)."""
    orders: list[tuple[Any, VmmDestroy]] = []
    async for msg in stored.messages(js, subjects.SLED_CMD_STREAM, subjects.sled_command("*", "vmm.destroy")):
        try:
            _, body = decode(msg.data or b"", VmmDestroy)
        except BadMessage:
            continue  # not a destroy at all: dead-lettered by its sled, never carried out
        assert isinstance(body, VmmDestroy)
        orders.append((msg.time, body))
    records = {
        r["id"]: r
        for r in await conn.fetch(
            "SELECT id, instance_id, ended_at FROM instance_manager.vmms WHERE id = ANY($1::uuid[])",
            list({o.vmm_id for _, o in orders}),
        )
    }
    out = []
    for sent_at, order in orders:
        r = records.get(order.vmm_id)
        if r is not None and (r["ended_at"] is None or r["ended_at"] > sent_at):
            until = "still live" if r["ended_at"] is None else f"live until {r['ended_at'].isoformat()}"
            out.append(
                f"VMM {order.vmm_id} of instance {r['instance_id']} was ordered destroyed at "
                f"{sent_at.isoformat()} while its instance claimed it (its record {until})"
            )
    return out


async def sled_boots(nc: NATS) -> dict[str, list[dict[str, Any]]] | None:
    """Each sled's boot history, as the simulated hardware keeps it; None where no simulator answers, or
    this identity may not ask it (the auditor: simulator control is the simulator operator's), and where
    a real rack keeps it in its sleds' service processors, which this checker does not read."""
    from shared.bus import CommandError, request
    from shared.messages import SimSledList

    try:
        listed = await request(
            nc, subjects.sim_control("sled.list"), SimSledList(), source="check", timeout=5
        )
    except (CommandError, TimeoutError, ConnectionError, nats.errors.Error):
        return None
    return {s["sled_id"]: s.get("boots", []) for s in listed}


async def no_wrongful_kills(conn: asyncpg.Connection, boots: dict[str, list[dict[str, Any]]]) -> list[str]:
    """No instance was failed or stopped by the system on the evidence of a reboot while the boot its VMM
    ran on had not ended: each such failure is held against its sled's boot history (a later boot must
    have begun before the failure). Sleds no longer simulated are not checked."""
    rows = await conn.fetch(
        """
        SELECT f.instance_id, i.name, f.vmm_id, f.sled_id, f.reason, f.vmm_boot_number,
               f.proof_boot_number, f.at
        FROM instance_manager.failures f JOIN instance_manager.instances i ON i.id = f.instance_id
        WHERE f.kind = 'rebooted'
        ORDER BY f.seq
        """
    )
    out = []
    for r in rows:
        history = boots.get(r["sled_id"])
        if history is None:
            continue
        ended = any(
            b["number"] > (r["vmm_boot_number"] or 0) and datetime.fromisoformat(b["started_at"]) <= r["at"]
            for b in history
        )
        if not ended:
            out.append(
                f"instance {r['name']} ({r['instance_id']}) was failed at {r['at'].isoformat()} by the "
                f"system ({r['reason']}) while its VMM {r['vmm_id']} ran on boot {r['vmm_boot_number']} of "
                f"{r['sled_id']}, which had not ended (wrongful kill)"
            )
    return out


async def no_running_vmm_called_stuck(conn: asyncpg.Connection, js: JetStreamContext) -> list[str]:
    """No VMM was failed as stuck (a start or a migration past the timeout) that its sled had said runs: each
    such failure names the sled's inventory it was judged on, by (boot, sequence), and none of the sled's
    reports about that VMM made before that inventory in the same boot (the sled's own order of its
    messages, no clock) may say it was running. A failure without that evidence is a failure on a clock
    alone, which a late report turns into a running VM destroyed. A report of running from an earlier boot
    does not count: a VMM cannot outlive its sled's boot, so one judged on a later boot's inventory was
    gone already, and its failure destroyed nothing."""
    rows = await conn.fetch(
        """
        SELECT f.instance_id, f.vmm_id, f.sled_id, f.reason, f.proof_boot_number, f.proof_seq, f.at
        FROM instance_manager.failures f
        WHERE f.kind = 'stuck' AND (f.reason LIKE 'starting%' OR f.reason LIKE 'migrating%')
        ORDER BY f.seq
        """
    )
    if not rows:
        return []
    ran: dict[tuple[uuid.UUID, int], int] = {}  # each VMM's earliest report of running in a boot: its seq
    wanted = {r["vmm_id"] for r in rows}
    for sled in sorted({r["sled_id"] for r in rows}):
        async for msg in stored.messages(js, subjects.SLED_REPORT_STREAM, subjects.sled_report(sled, "vmm")):
            try:
                _, report = decode(msg.data or b"", VmmReport)
            except BadMessage:
                continue
            assert isinstance(report, VmmReport)
            if report.vmm_id in wanted and report.sled_id == sled and report.state is VmmState.running:
                key = (report.vmm_id, report.boot_number)
                ran[key] = min(ran.get(key, report.seq), report.seq)
    out = []
    for r in rows:
        what = f"VMM {r['vmm_id']} of instance {r['instance_id']} was failed at {r['at'].isoformat()}"
        what += f" ({r['reason']})"
        if r["proof_seq"] is None:
            out.append(f"{what} with no inventory of {r['sled_id']} as evidence: on a clock alone")
        elif (seq := ran.get((r["vmm_id"], r["proof_boot_number"]))) is not None and seq < r["proof_seq"]:
            out.append(
                f"{what} on {r['sled_id']}'s inventory (boot {r['proof_boot_number']}, seq "
                f"{r['proof_seq']}), though the sled had reported it running before (boot "
                f"{r['proof_boot_number']}, seq {seq}): a late report, not a stuck VMM"
            )
    return out


def recent_dead_letters(depth: dlq.Depth) -> list[str]:
    """No dead letter younger than the alert threshold: each is a message a consumer gave up on, which
    waits for an operator (`rackctl dlq`). Not an invariant of the rack, so `check` itself leaves it to
    `rackctl check`, which says how young is too young."""
    if not depth.recent or depth.newest is None:
        return []
    d = depth.newest
    return [
        f"{depth.recent} dead letter(s) newer than {_age(depth.within)} (of {depth.total} in the DLQ); the "
        f"newest, {d.seq} at {d.time.isoformat()}: {d.service}/{d.consumer} on {d.subject}: {d.reason} "
        "(rackctl dlq list)"
    ]


# --- what the operator was told (at rest) -------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """A command an operator sent, and what came of it: an ok reply (`acked`, with the state and generation
    it gave, for an instance), or no reply at all (not `acked`: it may or may not have run). A command
    refused with an answer did nothing and is not kept."""

    seq: int
    """The order in which the commands were sent."""
    verb: str
    """One of VERBS."""
    silo: str
    project: str | None
    name: str
    """The silo's, the project's or the instance's name."""
    acked: bool
    state: str | None = None
    generation: int | None = None

    def line(self) -> str:
        told = f"answered {self.state} at generation {self.generation}" if self.state else "answered ok"
        where = "/".join(x for x in (self.silo, self.project) if x and x != self.name)
        return f"{self.verb} {where + '/' if where else ''}{self.name} (#{self.seq}, {told})"


VERBS = ("silo create", "project create", "instance create", "instance delete", "instance start",
         "instance stop")  # fmt: skip
ENDED = ("stopped", "failed", "destroyed")
"""The states in which a stop has ended (a VMM that failed or an instance deleted meanwhile ended too)."""


async def no_acknowledged_command_lost(
    conn: asyncpg.Connection, js: JetStreamContext, sent: Sequence[Sent]
) -> list[str]:
    """At rest, every command that got an ok reply has its effect: whatever machine was lost meanwhile, what
    the operator was told stays true.

    - a silo or project created exists;
    - an instance created (or picked from a pool) exists, unless a delete of it was sent (a delete without
      a reply may have run); one answered `creating` (its saga still running) has a record, live or not;
    - an instance deleted is gone (no live instance of its name);
    - an instance whose reply gave generation G has a record at generation G or later (a change the
      operator saw is never rolled back);
    - a start answered `running` at G ran: the instance's history (its `instance.changed` events, which
      its transactions publish through the outbox) shows it running at G or later; one answered
      `starting` at G came to an end: running, stopped, failed or destroyed after G;
    - a stop answered `stopping` or `stopped` at G ended: its history shows it stopped, failed or
      destroyed at G or later."""
    acked = [s for s in sent if s.acked]
    deleting = {(s.silo, s.project, s.name) for s in sent if s.verb == "instance delete"}
    silos = {
        r["name"]
        for r in await conn.fetch("SELECT name FROM instance_manager.silos WHERE deleted_at IS NULL")
    }
    projects = {
        (r["silo"], r["name"])
        for r in await conn.fetch(
            "SELECT s.name AS silo, p.name FROM instance_manager.projects p "
            "JOIN instance_manager.silos s ON s.id = p.silo_id WHERE p.deleted_at IS NULL"
        )
    }
    records: dict[tuple[str, str | None, str], list[Any]] = collections.defaultdict(list)
    for r in await conn.fetch(
        "SELECT s.name AS silo, p.name AS project, i.name, i.id, i.state, i.generation "
        "FROM instance_manager.instances i JOIN instance_manager.projects p ON p.id = i.project_id "
        "JOIN instance_manager.silos s ON s.id = p.silo_id WHERE s.name = ANY($1::text[])",
        sorted({s.silo for s in acked if s.verb.startswith("instance")}),
    ):
        records[r["silo"], r["project"], r["name"]].append(r)
    history = await _instance_history(
        js, {s.silo for s in acked if s.verb in ("instance start", "instance stop")}
    )
    out = []
    for s in acked:
        key = (s.silo, s.project, s.name)
        mine = records.get(key, [])
        live = [r for r in mine if r["state"] != "destroyed"]
        if s.verb == "silo create":
            out += [f"{s.line()}: no such silo"] if s.name not in silos else []
            continue
        if s.verb == "project create":
            out += [f"{s.line()}: no such project"] if (s.silo, s.name) not in projects else []
            continue
        if not mine:
            out.append(f"{s.line()}: no record of the instance")
            continue
        if s.verb == "instance create" and not live and key not in deleting and s.state != "creating":
            out.append(f"{s.line()}: destroyed, and no delete of it was sent")
        elif s.verb == "instance delete" and live:
            out.append(f"{s.line()}: still {live[0]['state']}")
        if s.generation is None:
            continue
        if (had := max(r["generation"] for r in mine)) < s.generation:
            out.append(f"{s.line()}: its record is at generation {had}, before what the reply gave")
            continue
        seen = [h for r in mine for h in history.get(str(r["id"]), [])]
        if s.verb == "instance start" and s.state == "running":
            if not any(g >= s.generation and st == "running" for g, st in seen):
                out.append(f"{s.line()}: its history shows it running at no generation from then on")
        elif s.verb == "instance start" and s.state == "starting":
            if not any(g > s.generation and st in ("running", *ENDED) for g, st in seen):
                out.append(f"{s.line()}: its history shows the start never came to an end")
        elif s.verb == "instance stop" and s.state in ("stopping", "stopped"):
            if not any(g >= s.generation and st in ENDED for g, st in seen):
                out.append(f"{s.line()}: its history shows it stopped at no generation from then on")
    return out


async def _instance_history(js: JetStreamContext, silos: set[str]) -> dict[str, list[tuple[int, str]]]:
    """Each instance's (generation, state) changes, as its `instance.changed` events tell them: v2 and v1
    both (a replica of an earlier release, in a rolling upgrade, sends v1 alone)."""
    out: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for silo in sorted(silos):
        for version, schema in ((1, InstanceChanged), (2, InstanceChangedV2)):
            subject = subjects.event(silo, "instance", "changed", version=version)
            async for msg in stored.messages(js, subjects.EVENTS_STREAM, subject):
                try:
                    _, event = decode(msg.data or b"", schema)
                except BadMessage:
                    continue
                assert isinstance(event, InstanceChanged | InstanceChangedV2)
                out[str(event.instance.id)].append((event.instance.generation, str(event.instance.state)))
    return out


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


BROKER_AT_REST = (
    consumers_settled,
    no_zombie_vmms,
    pool_vms_handed_out_once,
    no_claimed_vmm_destroyed,
    no_wrongful_kills,
    newest_inventory_applied,
    no_running_vmm_called_stuck,
)


async def check(
    conn: asyncpg.Connection,
    *,
    at_rest: bool = True,
    js: JetStreamContext | None = None,
    nc: NATS | None = None,
    sent: Sequence[Sent] | None = None,
) -> list[str]:
    """Every check's violations. With `js`, the broker checks too (at rest only); with `nc` as well, the
    failures the control plane made are held against the simulated sleds' boot history; with `js` and
    `sent` (the commands a caller sent, and their replies), what it was told is held against the rack."""
    found = await check_each(conn, at_rest=at_rest, js=js, nc=nc, sent=sent)
    return [line for lines in found.values() for line in lines]


async def check_each(
    conn: asyncpg.Connection,
    *,
    at_rest: bool = True,
    js: JetStreamContext | None = None,
    nc: NATS | None = None,
    sent: Sequence[Sent] | None = None,
) -> dict[str, list[str]]:
    """Each check that ran, by name, with its violations (empty where it holds)."""
    out: dict[str, list[str]] = {}
    for f in ALWAYS + (AT_REST if at_rest else ()):
        out[f.__name__] = await f(conn)
    if at_rest and js is not None:
        out["consumers_settled"] = await consumers_settled(js)
        latest = await _latest_inventories(js)  # read once, for both checks that judge them
        out["no_zombie_vmms"] = await no_zombie_vmms(conn, js, latest)
        out["pool_vms_handed_out_once"] = await pool_vms_handed_out_once(js)
        out["no_claimed_vmm_destroyed"] = await no_claimed_vmm_destroyed(conn, js)
        out["newest_inventory_applied"] = await newest_inventory_applied(conn, js, latest)
        out["no_running_vmm_called_stuck"] = await no_running_vmm_called_stuck(conn, js)
    if at_rest and nc is not None and (boots := await sled_boots(nc)) is not None:
        out["no_wrongful_kills"] = await no_wrongful_kills(conn, boots)
    if at_rest and js is not None and sent is not None:
        out["no_acknowledged_command_lost"] = await no_acknowledged_command_lost(conn, js, sent)
    return out


def names(*, at_rest: bool = True, broker: bool = True, sent: bool = False) -> list[str]:
    """The checks `check` runs with these options, by name (`sent`: given the commands a caller sent)."""
    chosen: tuple[Any, ...] = ALWAYS + (AT_REST + (BROKER_AT_REST if broker else ()) if at_rest else ())
    told = (no_acknowledged_command_lost,) if at_rest and broker and sent else ()
    return [f.__name__ for f in chosen + told]
