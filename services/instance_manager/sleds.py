"""Sleds as instance-manager knows them: registered and updated from their inventories, and placement
(room reserved on one of them)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import asyncpg

from services.instance_manager.app import App
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.sagas.definition import StepFailed
from shared import bus, telemetry
from shared.db import enqueue_many
from shared.messages import SledChanged, SledInventory, SledView
from shared.topology import subjects

GiB = 2**30


def _since(inv: SledInventory) -> str | None:
    """When each listed VMM took its state, by the sled's clock, as JSON (None: the sled does not say)."""
    since = {str(v.vmm_id): v.since.isoformat() for v in inv.vmms if v.since is not None}
    return json.dumps(since) if since else None


async def apply_inventories(app: App, batch: list[bus.Delivery]) -> None:
    """Record the sleds' capacities and boots from a batch of inventories, in one transaction of four
    statements however large the batch (5,000 sleds report every few seconds). Fenced by (boot number,
    sequence): an inventory older than the one held (a redelivery from before a reboot, say) changes
    nothing, not even when the sled was last seen; of one sled's inventories in a batch, the newest
    counts. A new sled, or a later boot, is announced as an event.

    A sled's boot and sequence are recorded even when its capacity cannot be honoured: a sled reporting
    less than is reserved on it is recorded as it says (overcommitted: no placement fits it until VMMs
    end), rather than refused, which would leave its next boot unrecorded and its lost VMMs unfailed.
    The same row keeps the sled's evidence for stuck orders (orders.stuck): when the sled made the
    inventory (its envelope's time), each VMM it listed with its state and since when, and how far it
    has taken its orders."""
    invs = SledInventory.newest([d.body for d in batch])
    made = {(d.body.sled_id, d.body.boot_number, d.body.seq): d.env.time for d in batch}
    async with app.pool.acquire() as conn, conn.transaction():
        held = await conn.fetch(Q["sleds_lock"], [i.sled_id for i in invs])
        before = {r["id"]: r["boot_number"] or 0 for r in held}
        applied = await conn.fetch(
            Q["sleds_apply_inventories"],
            [i.sled_id for i in invs],
            [i.boot_id for i in invs],
            [i.boot_number for i in invs],
            [i.seq for i in invs],
            [i.vcpus for i in invs],
            [i.ram_bytes for i in invs],
            [made[i.sled_id, i.boot_number, i.seq] for i in invs],
            [json.dumps({str(v.vmm_id): v.state.value for v in i.vmms}) for i in invs],
            [i.commands_read for i in invs],
            [_since(i) for i in invs],
        )
        await announce(
            app,
            conn,
            {
                r["id"]: f"boot:{r['boot_number']}:{r['boot_id']}"
                for r in applied
                if r["id"] not in before or before[r["id"]] < r["boot_number"]
            },
        )
    if applied:
        app.inventory_applied_at = time.monotonic()  # App.hears_sleds: this process hears sleds
    telemetry.count("inventories.applied", len(applied))
    telemetry.count("inventories.stale", len(batch) - len(applied))


async def announce(app: App, conn: asyncpg.Connection, changes: dict[str, str]) -> list[SledView]:
    """Publish the sleds `changes` names as they now are (after commit), in id order; each one's change
    names it, for the message id."""
    if not changes:
        return []
    rows = await conn.fetch(Q["sleds_view"], list(changes))
    sleds = [SledView.model_validate(dict(r)) for r in rows]
    await enqueue_many(
        conn,
        [
            (subjects.event(None, "sled", "changed"), SledChanged(sled=s), f"sled:{s.id}:{changes[s.id]}")
            for s in sleds
        ],
        source=SOURCE,
    )
    app.relay.kick()
    return sleds


PLACE_ATTEMPTS = 40
"""How often a placement tries again, a few milliseconds apart, when every sled with room is being
reserved by another placement at that moment, before it leaves the retry to the saga executor."""


async def reserve(
    tx: asyncpg.Connection,
    vcpus: int,
    ram_bytes: int,
    *,
    avoid: str | None = None,
    only: str | None = None,
    judge_silence: bool = True,
    silent_after: float,
) -> asyncpg.Record:
    """Reserve room on the least loaded active sled (never `avoid`; `only` if named): its id and boot id.

    Placements pass over sleds being reserved right now (each holds its sled for one short transaction),
    so they never wait on each other; when those are the only sleds with room (few sleds, many
    placements), this one tries again a moment later, rather than backing off as a failed step does.
    No room anywhere fails the step, unless silence cannot be judged yet (`judge_silence` false: see
    `App.hears_sleds`): then the step is retried, since the sleds may only seem silent. A sled silent for
    `silent_after` seconds does not answer (`Settings.unknown_after`)."""
    silent = silent_after
    for _ in range(PLACE_ATTEMPTS):
        placed = await tx.fetchrow(Q["place"], vcpus, ram_bytes, avoid, only, silent)
        if placed is not None:
            return placed
        if not await tx.fetchval(Q["any_sled_with_room"], vcpus, ram_bytes, avoid, only, silent):
            break
        telemetry.count("placement.contended")
        await asyncio.sleep(random.uniform(0.002, 0.01))
    else:
        raise RuntimeError("every sled with room is being reserved right now")  # transient: retried
    if not judge_silence:
        raise RuntimeError("no sled with room has been heard from since this service started")  # retried
    room = f"room for {vcpus} vCPUs and {ram_bytes / GiB:g} GiB of RAM"
    if only is not None:
        raise StepFailed(f"sled {only} is not active, does not answer, or has no {room}")
    raise StepFailed(f"no {'other ' if avoid else ''}active sled that answers has {room}")


async def still_placeable(
    tx: asyncpg.Connection, sled_id: str, *, judge_silence: bool = True, silent_after: float
) -> None:
    """The second look at a placement, when its VMM record is written: the sled must still be active and
    answering. The lock it takes waits for an expunge under way, so an expunge that commits mid-saga is
    seen here and unwinds the start rather than leaving a VMM on an expunged sled. A sled that seems
    silent while silence cannot be judged yet (`judge_silence` false) makes the step retry."""
    sled = await tx.fetchrow(Q["sled_placeable"], sled_id, silent_after)
    if sled is None or sled["state"] != "active":
        raise StepFailed(f"sled {sled_id} was {sled['state'] if sled else 'removed'} while it was placed on")
    if not sled["answering"]:
        if not judge_silence:
            raise RuntimeError(f"sled {sled_id} not heard from since this service started")  # retried
        raise StepFailed(f"sled {sled_id} stopped answering while it was placed on")
