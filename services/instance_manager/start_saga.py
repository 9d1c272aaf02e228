"""The instance start saga.

    interlock       pass the "one start at a time" compare-and-set    undo: give the instance back
    charge          charge vCPUs and RAM through accounting (quota)   undo: release the charge
    place           reserve room on an active sled                    undo: release the reservation
    create_vmm      record the VMM on that sled                       undo: end the VMM record
    ensure_on_sled  ask the sled agent to run the VMM                 undo: ask the sled to destroy it

The instance becomes running when the sled reports its VMM running (see reports.py), not here: the
saga's job ends once the sled has been asked. A failure at any step unwinds the earlier ones, so a
refused or failed start leaves no charge, reservation or VMM.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.instance_manager import sleds
from services.instance_manager.app import SOURCE, App, Q
from services.instance_manager.saga import Context, Saga, Step, StepFailed
from shared import bus, subjects
from shared.messages import MigrationSource, ProvisionDelta, VmmDestroy, VmmEnsure


class AlreadyRunning(Exception):
    """Start of an instance that is starting or running already: a successful no-op."""


async def interlock(ctx: Context) -> dict[str, Any]:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    vmm_id = uuid.uuid4()
    expected = ctx.params.get("expected_generation")  # set by an automatic restart
    won = await ctx.tx.fetchrow(Q["start_interlock"], instance_id, vmm_id, expected, expected is not None)
    if won is None:
        current = await ctx.tx.fetchrow(Q["instance_lock"], instance_id)
        state = current["state"] if current else "destroyed"
        if expected is not None and current is not None and current["generation"] != expected:
            raise bus.Conflict(f"instance changed since generation {expected}; not restarting it")
        if state in ("starting", "running", "migrating"):
            raise AlreadyRunning(state)
        if state == "destroyed":
            raise bus.NotFound("instance not found")
        raise bus.Conflict(f"instance is {state}; it can be started once it is stopped")
    app: App = ctx.app
    await app.instance_changed(ctx.tx, instance_id)
    v = await app.view(ctx.tx, instance_id)
    return {
        "vmm_id": str(vmm_id),
        "generation": won["generation"],
        "silo": v.silo,
        "project": v.project,
        "silo_id": str(v.silo_id),
        "project_id": str(v.project_id),
        "vcpus": won["vcpus"],
        "ram_bytes": won["ram_bytes"],
        "disk_bytes": won["disk_bytes"],
    }


async def interlock_undo(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    released = await ctx.tx.fetchrow(
        Q["start_interlock_release"], instance_id, uuid.UUID(ctx.data["vmm_id"]), f"start failed: {ctx.error}"
    )
    if released is not None:
        await ctx.app.instance_changed(ctx.tx, instance_id)


async def charge(ctx: Context) -> None:
    d = ctx.data
    delta = ProvisionDelta(
        instance_id=uuid.UUID(ctx.params["instance_id"]),
        project_id=uuid.UUID(d["project_id"]),
        silo_id=uuid.UUID(d["silo_id"]),
        generation=d["generation"],
        vcpus=d["vcpus"],
        ram_bytes=d["ram_bytes"],
        disk_bytes=d["disk_bytes"],
    )
    outcome, reason = await ctx.app.charge(d["silo"], d["project"], delta)
    if outcome == "refused":
        raise StepFailed(reason)
    if outcome == "stale":
        raise StepFailed("the instance changed while it was starting")


async def charge_undo(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    bumped = await ctx.tx.fetchrow(Q["instance_bump_if_active"], instance_id, uuid.UUID(ctx.data["vmm_id"]))
    if bumped is not None:  # otherwise whoever took the VMM away released the charge with it
        await ctx.app.release_charge(ctx.tx, instance_id, bumped["generation"])


async def place(ctx: Context) -> dict[str, Any]:
    placed = await sleds.reserve(ctx.tx, ctx.data["vcpus"], ctx.data["ram_bytes"])
    return {"sled_id": placed["id"], "boot_id": str(placed["boot_id"]) if placed["boot_id"] else None}


async def place_undo(ctx: Context) -> None:
    # Once the VMM record exists, the reservation is the VMM's: whoever ends the record releases it.
    if not await ctx.tx.fetchval(Q["vmm_exists"], uuid.UUID(ctx.data["vmm_id"])):
        await ctx.tx.execute(Q["unreserve"], ctx.data["sled_id"], ctx.data["vcpus"], ctx.data["ram_bytes"])


async def create_vmm(ctx: Context) -> None:
    d = ctx.data
    instance_id = uuid.UUID(ctx.params["instance_id"])
    await ctx.tx.execute(
        Q["vmm_insert"],
        uuid.UUID(d["vmm_id"]),
        instance_id,
        d["sled_id"],
        d["vcpus"],
        d["ram_bytes"],
        uuid.UUID(d["boot_id"]) if d.get("boot_id") else None,
    )
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    if await ctx.tx.fetchrow(Q["instance_bump_if_active"], instance_id, uuid.UUID(d["vmm_id"])) is not None:
        await ctx.app.instance_changed(ctx.tx, instance_id)


async def create_vmm_undo(ctx: Context) -> None:
    ended = await ctx.tx.fetchrow(Q["vmm_end"], uuid.UUID(ctx.data["vmm_id"]), "destroyed")
    if ended is not None:
        await ctx.tx.execute(Q["unreserve"], ended["sled_id"], ended["vcpus"], ended["ram_bytes"])


async def ensure_on_sled(ctx: Context, migrate_from: MigrationSource | None = None) -> None:
    d = ctx.data
    cmd = VmmEnsure(
        vmm_id=uuid.UUID(d["vmm_id"]),
        instance_id=uuid.UUID(ctx.params["instance_id"]),
        vcpus=d["vcpus"],
        ram_bytes=d["ram_bytes"],
        boot_id=uuid.UUID(d["boot_id"]) if d.get("boot_id") else None,
        migrate_from=migrate_from,
    )
    await bus.publish(
        ctx.app.js,
        subjects.sled_command(d["sled_id"], "vmm.ensure"),
        cmd,
        source=SOURCE,
        key=f"ensure:{d['vmm_id']}",
    )


async def ensure_on_sled_undo(ctx: Context) -> None:
    d = ctx.data
    await bus.publish(
        ctx.app.js,
        subjects.sled_command(d["sled_id"], "vmm.destroy"),
        VmmDestroy(vmm_id=uuid.UUID(d["vmm_id"])),
        source=SOURCE,
        key=f"destroy:{d['vmm_id']}",
    )


START = Saga(
    "instance-start",
    [
        Step("interlock", interlock, interlock_undo),
        Step("charge", charge, charge_undo, local=False),
        Step("place", place, place_undo),
        Step("create_vmm", create_vmm, create_vmm_undo),
        Step("ensure_on_sled", ensure_on_sled, ensure_on_sled_undo, local=False, undo_local=False),
    ],
)
