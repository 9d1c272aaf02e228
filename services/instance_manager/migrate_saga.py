"""The instance migrate saga: move a running instance to another sled without stopping it.

    interlock       pass the "one move at a time" compare-and-set     undo: the instance stays put
    place           reserve room on another active sled that answers  undo: release the reservation
    create_vmm      look at the sled again; record the target VMM     undo: end the target VMM record,
                                                                            and have its sled destroy it
    ensure_target   ask the target sled to await the instance
    migrate_source  ask the source sled to hand the instance over

The two remote steps first look at where the move stands, under the instance's lock: still under way,
they ask their sled; already over with the target running the instance (a retry after the move ended),
they succeed without asking anything; called off (its source or target was lost), they fail, and the
saga unwinds. No undo ever ends the VMM an instance runs on: the target's undo leaves it alone once the
instance has moved to it.

As with a start, the saga ends once the sleds have been asked; the move ends with the sleds' reports
(see lifecycle.py): the target reporting running, or the source reporting that it handed over, makes the
target the active VMM; the target ending first leaves the instance running on the source. The charge
never changes: the instance is charged once, wherever it runs, and holds room on both sleds until then.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from services.instance_manager import sleds
from services.instance_manager.app import SOURCE, Q
from services.instance_manager.saga import Context, Saga, Step, StepFailed
from services.instance_manager.start_saga import (
    create_vmm_undo,
    ensure_on_sled,
    place_undo,
    placement,
    record_vmm,
)
from shared import bus, subjects
from shared.messages import MigrationSource, VmmMigrate


async def interlock(ctx: Context) -> dict[str, Any]:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    to_sled = ctx.params.get("to_sled")
    target_vmm_id = uuid.uuid4()
    won = await ctx.tx.fetchrow(Q["migrate_interlock"], instance_id, target_vmm_id)
    if won is None:
        current = await ctx.tx.fetchrow(Q["instance_lock"], instance_id)
        state = current["state"] if current else "destroyed"
        if state == "destroyed":
            raise bus.NotFound("instance not found")
        if state == "migrating":
            raise bus.Conflict("instance is migrating already")
        raise bus.Conflict(f"instance is {state}; only a running instance can be migrated")
    source = await ctx.tx.fetchrow(Q["vmm_live"], won["active_vmm_id"])
    if to_sled is not None:
        sled = await ctx.tx.fetchrow(Q["sleds_view"], [to_sled])
        if sled is None:
            raise bus.NotFound(f"no sled {to_sled}")
        if to_sled == source["sled_id"]:
            raise bus.Conflict(f"instance already runs on {to_sled}")
        if sled["state"] != "active":
            raise bus.Conflict(
                f"sled {to_sled} is {sled['state']}; an instance can only move to an active sled"
            )
    await ctx.app.instance_changed(ctx.tx, instance_id)
    return {
        "vmm_id": str(target_vmm_id),
        "source_vmm_id": str(won["active_vmm_id"]),
        "source_sled_id": source["sled_id"],
        "vcpus": won["vcpus"],
        "ram_bytes": won["ram_bytes"],
    }


async def interlock_undo(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    d = ctx.data
    ended = await ctx.tx.fetchrow(
        Q["migration_end"],
        instance_id,
        uuid.UUID(d["vmm_id"]),
        uuid.UUID(d["source_vmm_id"]),
        f"migration failed: {ctx.error}",
    )
    if ended is not None:  # otherwise the move was called off already (its source or target was lost)
        await ctx.app.instance_changed(ctx.tx, instance_id)


async def place(ctx: Context) -> dict[str, Any]:
    d = ctx.data
    placed = await sleds.reserve(
        ctx.tx,
        d["vcpus"],
        d["ram_bytes"],
        avoid=d["source_sled_id"],
        only=ctx.params.get("to_sled"),
        judge_silence=ctx.app.hears_sleds(),
    )
    return placement(placed)


async def create_vmm(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    await sleds.still_placeable(ctx.tx, ctx.data["sled_id"], judge_silence=ctx.app.hears_sleds())
    inst = await ctx.tx.fetchrow(Q["instance_lock"], instance_id)
    if inst is None or inst["target_vmm_id"] != uuid.UUID(ctx.data["vmm_id"]):
        raise StepFailed("the migration was called off: its source VMM ended")
    await record_vmm(ctx, "migrating")
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    await ctx.tx.execute(Q["instance_bump"], instance_id)
    await ctx.app.instance_changed(ctx.tx, instance_id)


async def ensure_target(ctx: Context) -> None:
    d = ctx.data
    if await _where_the_move_stands(ctx) == "done":
        return
    source = MigrationSource(vmm_id=uuid.UUID(d["source_vmm_id"]), sled_id=d["source_sled_id"])
    await ensure_on_sled(ctx, migrate_from=source)


async def migrate_source(ctx: Context) -> None:
    d = ctx.data
    cmd = VmmMigrate(
        vmm_id=uuid.UUID(d["source_vmm_id"]),
        target_vmm_id=uuid.UUID(d["vmm_id"]),
        target_sled_id=d["sled_id"],
    )
    subject = subjects.sled_command(d["source_sled_id"], "vmm.migrate")
    async with ctx.app.pool.acquire() as conn, conn.transaction():
        if await _where_the_move_stands(ctx, conn) == "done":
            return
        await bus.publish(
            ctx.app.js, subject, cmd, source=SOURCE, key=f"migrate:{d['source_vmm_id']}:{d['vmm_id']}"
        )
    # The move's transition timeout counts from here (a stuck order judges the target by it). Apart from
    # the transaction above: it holds the instance's lock, and VMM records are locked before instances.
    await ctx.app.pool.execute(Q["vmm_asked"], cmd.target_vmm_id)


async def _where_the_move_stands(ctx: Context, conn: asyncpg.Connection | None = None) -> str:
    """`under way` or `done` (the target runs the instance); a move called off fails the step. With
    `conn`, the instance stays locked until its transaction ends, so the answer holds while a sled is
    asked."""
    instance_id, target = uuid.UUID(ctx.params["instance_id"]), uuid.UUID(ctx.data["vmm_id"])
    q = Q["instance_lock"] if conn is not None else Q["instance_vmms"]
    inst = await (conn or ctx.app.pool).fetchrow(q, instance_id)
    if inst is not None and inst["active_vmm_id"] == target:
        return "done"
    if inst is None or inst["target_vmm_id"] != target:
        raise StepFailed("the migration was called off: its source or target VMM ended")
    return "under way"


MIGRATE = Saga(
    "instance-migrate",
    [
        Step("interlock", interlock, interlock_undo),
        Step("place", place, place_undo),
        Step("create_vmm", create_vmm, create_vmm_undo),
        Step("ensure_target", ensure_target, local=False),
        Step("migrate_source", migrate_source, local=False),
    ],
)
