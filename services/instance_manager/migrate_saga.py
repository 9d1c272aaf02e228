"""The instance migrate saga: move a running instance to another sled without stopping it.

    interlock       pass the "one move at a time" compare-and-set     undo: the instance stays put
    place           reserve room on another active sled               undo: release the reservation
    create_vmm      record the target VMM on that sled                undo: end the target VMM record
    ensure_target   ask the target sled to await the instance         undo: ask it to destroy the target
    migrate_source  ask the source sled to hand the instance over

As with a start, the saga ends once the sleds have been asked; the move ends with the sleds' reports
(see lifecycle.py): the target reporting running, or the source reporting that it handed over, makes the
target the active VMM; the target ending first leaves the instance running on the source. The charge
never changes: the instance is charged once, wherever it runs, and holds room on both sleds until then.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.instance_manager import sleds
from services.instance_manager.app import SOURCE, Q
from services.instance_manager.saga import Context, Saga, Step, StepFailed
from services.instance_manager.start_saga import (
    create_vmm_undo,
    ensure_on_sled,
    ensure_on_sled_undo,
    place_undo,
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
        sled = await ctx.tx.fetchrow(Q["sled_list"], to_sled)
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
        ctx.tx, d["vcpus"], d["ram_bytes"], avoid=d["source_sled_id"], only=ctx.params.get("to_sled")
    )
    return {"sled_id": placed["id"], "boot_id": str(placed["boot_id"]) if placed["boot_id"] else None}


async def create_vmm(ctx: Context) -> None:
    d = ctx.data
    instance_id = uuid.UUID(ctx.params["instance_id"])
    target = uuid.UUID(d["vmm_id"])
    inst = await ctx.tx.fetchrow(Q["instance_lock"], instance_id)
    if inst is None or inst["target_vmm_id"] != target:
        raise StepFailed("the migration was called off: its source VMM ended")
    boot_id = uuid.UUID(d["boot_id"]) if d.get("boot_id") else None
    await ctx.tx.execute(
        Q["vmm_insert_target"], target, instance_id, d["sled_id"], d["vcpus"], d["ram_bytes"], boot_id
    )
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    await ctx.tx.execute(Q["instance_bump"], instance_id)
    await ctx.app.instance_changed(ctx.tx, instance_id)


async def ensure_target(ctx: Context) -> None:
    d = ctx.data
    await _still_on(ctx)
    source = MigrationSource(vmm_id=uuid.UUID(d["source_vmm_id"]), sled_id=d["source_sled_id"])
    await ensure_on_sled(ctx, migrate_from=source)


async def migrate_source(ctx: Context) -> None:
    d = ctx.data
    await _still_on(ctx)
    cmd = VmmMigrate(
        vmm_id=uuid.UUID(d["source_vmm_id"]),
        target_vmm_id=uuid.UUID(d["vmm_id"]),
        target_sled_id=d["sled_id"],
    )
    subject = subjects.sled_command(d["source_sled_id"], "vmm.migrate")
    await bus.publish(
        ctx.app.js, subject, cmd, source=SOURCE, key=f"migrate:{d['source_vmm_id']}:{d['vmm_id']}"
    )


async def _still_on(ctx: Context) -> None:
    """A remote step asks a sled for nothing once the move is over (its source or target was lost)."""
    target = await ctx.app.pool.fetchval(Q["instance_target"], uuid.UUID(ctx.params["instance_id"]))
    if target != uuid.UUID(ctx.data["vmm_id"]):
        raise StepFailed("the migration was called off: its source or target VMM ended")


MIGRATE = Saga(
    "instance-migrate",
    [
        Step("interlock", interlock, interlock_undo),
        Step("place", place, place_undo),
        Step("create_vmm", create_vmm, create_vmm_undo),
        Step("ensure_target", ensure_target, ensure_on_sled_undo, local=False, undo_local=False),
        Step("migrate_source", migrate_source, local=False),
    ],
)
