"""The instance create saga.

    record          insert the instance, state creating               undo: mark it destroyed
    charge_disk     charge its boot disk through accounting (quota)   undo: release the disk
    ready           the instance is stopped, ready to start           (last step, nothing to undo)

A create that accounting refuses leaves no instance behind (it never passes through failed).
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from services.instance_manager.app import App, Q
from services.instance_manager.saga import Context, Saga, Step, StepFailed
from shared import bus
from shared.messages import ProvisionDelta


async def record(ctx: Context) -> dict[str, Any]:
    p = ctx.params
    instance_id = uuid.UUID(p["instance_id"])
    try:
        async with ctx.tx.transaction():  # a savepoint: a name clash must not poison the caller's tx
            inserted = await ctx.tx.execute(
                Q["instance_insert"],
                instance_id,
                uuid.UUID(p["project_id"]),
                p["name"],
                p["vcpus"],
                p["ram_bytes"],
                p["disk_bytes"],
                p["auto_restart"],
                uuid.UUID(p["pool_id"]) if p.get("pool_id") else None,
            )
    except asyncpg.UniqueViolationError:
        raise bus.Conflict(f"instance {p['silo']}/{p['project']}/{p['name']} already exists") from None
    if inserted == "INSERT 0 0":  # the project was deleted meanwhile (instance_insert)
        raise bus.NotFound(f"no project {p['silo']}/{p['project']}")
    v = await ctx.app.instance_changed(ctx.tx, instance_id)
    return {"generation": v.generation, "silo_id": str(v.silo_id)}


async def record_undo(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    await ctx.tx.execute(Q["instance_create_undo"], instance_id, f"create failed: {ctx.error}")
    await ctx.app.instance_changed(ctx.tx, instance_id)


async def charge_disk(ctx: Context) -> None:
    p = ctx.params
    delta = ProvisionDelta(
        instance_id=uuid.UUID(p["instance_id"]),
        project_id=uuid.UUID(p["project_id"]),
        silo_id=uuid.UUID(ctx.data["silo_id"]),
        generation=ctx.data["generation"],
        vcpus=0,
        ram_bytes=0,
        disk_bytes=p["disk_bytes"],
    )
    outcome, reason = await ctx.app.charge(p["silo"], p["project"], delta)
    if outcome != "applied":
        raise StepFailed(reason or f"disk charge {outcome}")


async def charge_disk_undo(ctx: Context) -> None:
    app: App = ctx.app
    instance_id = uuid.UUID(ctx.params["instance_id"])
    gen = await ctx.tx.fetchval(Q["instance_bump"], instance_id)
    v = await app.view(ctx.tx, instance_id)
    await app.send_delta(ctx.tx, v, gen, vcpus=0, ram_bytes=0, disk_bytes=0)


async def ready(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    await ctx.tx.execute(Q["instance_create_ready"], instance_id)
    await ctx.app.instance_changed(ctx.tx, instance_id)


CREATE = Saga(
    "instance-create",
    [
        Step("record", record, record_undo),
        Step("charge_disk", charge_disk, charge_disk_undo, local=False),
        Step("ready", ready),
    ],
)
