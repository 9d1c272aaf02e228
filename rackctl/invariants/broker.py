"""The checks that read the broker, at rest: what was published was consumed, what the sleds run has a
record, no VMM was destroyed while claimed, no pool VM handed out twice, every sled's newest inventory
applied. They read streams message by message (rackctl/stored.py), never through a consumer of their own.
The records they hold the messages against are read with broker.sql."""

from __future__ import annotations

import asyncio
import collections
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats.js.errors
from nats.js import JetStreamContext

from deploy import identities
from rackctl import stored
from rackctl.invariants.timings import Timings
from shared.db import queries
from shared.messages import BadMessage, PoolChanged, SledInventory, VmmDestroy, decode
from shared.topology import durables, subjects

Q = queries(Path(__file__).with_suffix(".sql"))

CONSUMERS = {d.name: d.stream for d in durables.DURABLES}
"""The services' fixed durable consumers, by the topology, and the stream of each (the sleds' own,
`sled-agent-<sled>`, come and go with them)."""


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
    if await conn.fetchval(Q["vmms_pruning_kept"]) is None:
        return None
    return await conn.fetchval(Q["vmms_pruned_before"])


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
    `latest`: the inventories, if already read (`latest_inventories`)."""
    inventories, problems = latest if latest is not None else await latest_inventories(js)
    out = list(problems)
    horizon = await vmms_pruned_before(conn)
    expunged = {r["id"] for r in await conn.fetch(Q["expunged_sleds"])}
    for sent_at, inv in inventories:
        if inv.sled_id in expunged or not inv.vmms:
            continue
        records = {r["id"]: r for r in await conn.fetch(Q["vmm_records"], [v.vmm_id for v in inv.vmms])}
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


async def latest_inventories(js: JetStreamContext) -> Latest:
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


def inventory_in_flight(timings: Timings | None = None) -> float:
    """Seconds a sled's newest inventory may wait to be applied: two of its intervals (the one on its way
    and the one before) or the settle grace, whichever is longer (`timings`: this process's settings when
    not given)."""
    return max(SETTLE_GRACE, 2 * (timings or Timings.from_env()).inventory_interval)


async def newest_inventory_applied(
    conn: asyncpg.Connection,
    js: JetStreamContext,
    latest: Latest | None = None,
    timings: Timings | None = None,
) -> list[str]:
    """At rest: every sled's newest inventory in SLED_REPORT is applied by instance-manager (its `sleds`
    row holds that (boot number, sequence) or a newer one) and by recovery (its own `sleds` row). One
    younger than `inventory_in_flight()` may still be on its way: it passes if the service applied an
    inventory of that sled no longer than that before it was made, or none yet. So a sled whose
    inventories are all dead-lettered (or never read) is seen, whose new boot neither service would ever
    learn. Expunged sleds are out of the rack and not checked; what cannot be read is no_zombie_vmms's to
    report. `latest`: the inventories, if already read."""
    inventories, _ = latest if latest is not None else await latest_inventories(js)
    flight = inventory_in_flight(timings)
    now = await conn.fetchval(Q["now"])
    held = {(r["service"], r["id"]): r for r in await conn.fetch(Q["applied_inventories"])}
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
    records = {r["id"]: r for r in await conn.fetch(Q["vmm_claims"], list({o.vmm_id for _, o in orders}))}
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
