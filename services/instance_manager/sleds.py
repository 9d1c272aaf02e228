"""Sleds as instance-manager knows them: registered and updated from their inventories, and placement
(room reserved on one of them)."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from services.instance_manager.app import SOURCE, App, Q
from services.instance_manager.saga import StepFailed
from shared import subjects, telemetry
from shared.config import sled_unknown_after
from shared.db import enqueue
from shared.messages import SledChanged, SledInventory, SledView

GiB = 2**30


async def apply_inventory(app: App, inv: SledInventory) -> str:
    """Record the sled's capacity and boot, fenced by (boot number, sequence): an inventory older than the
    one held (a redelivery from before a reboot, say) changes nothing, not even when the sled was last
    seen. A new sled, or a later boot, is announced as an event. Returns applied or stale."""
    async with app.pool.acquire() as conn, conn.transaction():
        before = await conn.fetchrow(Q["sled_lock"], inv.sled_id)
        applied = await conn.fetchval(
            Q["sled_apply_inventory"],
            inv.sled_id,
            inv.boot_id,
            inv.boot_number,
            inv.seq,
            inv.vcpus,
            inv.ram_bytes,
        )
        if applied is None:
            telemetry.count("inventories.stale")
            return "stale"
        if before is None or (before["boot_number"] or 0) < inv.boot_number:
            await announce(app, conn, inv.sled_id, f"boot:{inv.boot_number}:{inv.boot_id}")
        telemetry.count("inventories.applied")
        return "applied"


async def announce(app: App, conn: asyncpg.Connection, sled_id: str, change: str) -> SledView:
    """Publish the sled as it now is (after commit); `change` names the change, for the message id."""
    sled = SledView.model_validate(dict(await conn.fetchrow(Q["sled_view"], sled_id)))
    await enqueue(
        conn,
        subjects.event(None, "sled", "changed"),
        SledChanged(sled=sled),
        source=SOURCE,
        key=f"sled:{sled_id}:{change}",
    )
    app.relay.kick()
    return sled


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
) -> asyncpg.Record:
    """Reserve room on the least loaded active sled (never `avoid`; `only` if named): its id and boot id.

    Placements pass over sleds being reserved right now (each holds its sled for one short transaction),
    so they never wait on each other; when those are the only sleds with room (few sleds, many
    placements), this one tries again a moment later, rather than backing off as a failed step does.
    No room anywhere fails the step, unless silence cannot be judged yet (`judge_silence` false: see
    `App.hears_sleds`): then the step is retried, since the sleds may only seem silent."""
    silent = sled_unknown_after()
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


async def still_placeable(tx: asyncpg.Connection, sled_id: str, *, judge_silence: bool = True) -> None:
    """The second look at a placement, when its VMM record is written: the sled must still be active and
    answering. The lock it takes waits for an expunge under way, so an expunge that commits mid-saga is
    seen here and unwinds the start rather than leaving a VMM on an expunged sled. A sled that seems
    silent while silence cannot be judged yet (`judge_silence` false) makes the step retry."""
    sled = await tx.fetchrow(Q["sled_placeable"], sled_id, sled_unknown_after())
    if sled is None or sled["state"] != "active":
        raise StepFailed(f"sled {sled_id} was {sled['state'] if sled else 'removed'} while it was placed on")
    if not sled["answering"]:
        if not judge_silence:
            raise RuntimeError(f"sled {sled_id} not heard from since this service started")  # retried
        raise StepFailed(f"sled {sled_id} stopped answering while it was placed on")
