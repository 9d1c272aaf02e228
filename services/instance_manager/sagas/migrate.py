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
from enum import StrEnum

import asyncpg

from services.instance_manager import sleds, views
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.sagas import common
from services.instance_manager.sagas.common import InstanceParams, Placed, Reserved
from services.instance_manager.sagas.definition import Context, Saga, Step, StepFailed
from shared import bus
from shared.messages import MigrationSource, VmmMigrate, VmmState
from shared.topology import subjects


class MigrateParams(InstanceParams):
    to_sled: str | None = None
    """The sled asked for; None: any other active sled that answers."""


class Interlocked(Reserved):
    """The move as the interlock won it: `vmm_id` is the target VMM to be; the source is where the
    instance runs now."""

    source_vmm_id: uuid.UUID
    source_sled_id: str


class Move(StrEnum):
    """Where a move stands, as its remote steps find it."""

    under_way = "under way"
    done = "done"
    """The target runs the instance."""


async def interlock(ctx: Context[MigrateParams]) -> Interlocked:
    instance_id, to_sled = ctx.params.instance_id, ctx.params.to_sled
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
    await views.instance_changed(ctx.app, ctx.tx, instance_id)
    return Interlocked(
        vmm_id=target_vmm_id,
        source_vmm_id=won["active_vmm_id"],
        source_sled_id=source["sled_id"],
        vcpus=won["vcpus"],
        ram_bytes=won["ram_bytes"],
    )


async def interlock_undo(ctx: Context[MigrateParams]) -> None:
    instance_id, i = ctx.params.instance_id, ctx.get(Interlocked)
    ended = await ctx.tx.fetchrow(
        Q["migration_end"], instance_id, i.vmm_id, i.source_vmm_id, f"migration failed: {ctx.error}"
    )
    if ended is not None:  # otherwise the move was called off already (its source or target was lost)
        await views.instance_changed(ctx.app, ctx.tx, instance_id)


async def place(ctx: Context[MigrateParams]) -> Placed:
    i = ctx.get(Interlocked)
    return common.placed(
        await sleds.reserve(
            ctx.tx,
            i.vcpus,
            i.ram_bytes,
            avoid=i.source_sled_id,
            only=ctx.params.to_sled,
            judge_silence=ctx.app.hears_sleds(),
            silent_after=ctx.app.settings.unknown_after(),
        )
    )


async def create_vmm(ctx: Context[MigrateParams]) -> None:
    instance_id = ctx.params.instance_id
    await common.still_placeable(ctx)
    inst = await ctx.tx.fetchrow(Q["instance_lock"], instance_id)
    if inst is None or inst["target_vmm_id"] != ctx.get(Interlocked).vmm_id:
        raise StepFailed("the migration was called off: its source VMM ended")
    await common.record_vmm(ctx, VmmState.migrating)
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    await ctx.tx.execute(Q["instance_bump"], instance_id)
    await views.instance_changed(ctx.app, ctx.tx, instance_id)


async def ensure_target(ctx: Context[MigrateParams]) -> None:
    if await _where_the_move_stands(ctx) is Move.done:
        return
    i = ctx.get(Interlocked)
    source = MigrationSource(vmm_id=i.source_vmm_id, sled_id=i.source_sled_id)
    await common.ensure_on_sled(ctx, migrate_from=source)


async def migrate_source(ctx: Context[MigrateParams]) -> None:
    i, p = ctx.get(Interlocked), ctx.get(Placed)
    cmd = VmmMigrate(vmm_id=i.source_vmm_id, target_vmm_id=i.vmm_id, target_sled_id=p.sled_id)
    subject = subjects.sled_command(i.source_sled_id, "vmm.migrate")
    async with ctx.app.pool.acquire() as conn, conn.transaction():
        if await _where_the_move_stands(ctx, conn) is Move.done:
            return
        await bus.publish(
            ctx.app.js, subject, cmd, source=SOURCE, key=f"migrate:{i.source_vmm_id}:{i.vmm_id}"
        )
    # The move's transition timeout counts from here (a stuck order judges the target by it). Apart from
    # the transaction above: it holds the instance's lock, and VMM records are locked before instances.
    await ctx.app.pool.execute(Q["vmm_asked"], cmd.target_vmm_id, None)


async def _where_the_move_stands(ctx: Context[MigrateParams], conn: asyncpg.Connection | None = None) -> Move:
    """Under way, or done (the target runs the instance); a move called off fails the step. With `conn`,
    the instance stays locked until its transaction ends, so the answer holds while a sled is asked."""
    instance_id, target = ctx.params.instance_id, ctx.get(Interlocked).vmm_id
    q = Q["instance_lock"] if conn is not None else Q["instance_vmms"]
    inst = await (conn or ctx.app.pool).fetchrow(q, instance_id)
    if inst is not None and inst["active_vmm_id"] == target:
        return Move.done
    if inst is None or inst["target_vmm_id"] != target:
        raise StepFailed("the migration was called off: its source or target VMM ended")
    return Move.under_way


MIGRATE = Saga(
    "instance-migrate",
    [
        Step("interlock", interlock, interlock_undo),
        Step("place", place, common.place_undo),
        Step("create_vmm", create_vmm, common.create_vmm_undo),
        Step("ensure_target", ensure_target, local=False),
        Step("migrate_source", migrate_source, local=False),
    ],
    MigrateParams,
)
