"""The instance create saga.

    record          insert the instance, state creating               undo: mark it destroyed
    charge_disk     charge its boot disk through accounting (quota)   undo: release the disk
    ready           the instance is stopped, ready to start           (last step, nothing to undo)

A create that accounting refuses leaves no instance behind (it never passes through failed).
"""

from __future__ import annotations

import uuid

import asyncpg

from services.instance_manager import charging, views
from services.instance_manager.base import Q
from services.instance_manager.sagas.definition import Context, Output, Params, Saga, Step, StepFailed
from shared import bus
from shared.messages import AutoRestart, Outcome


class CreateParams(Params):
    silo: str
    project: str
    name: str
    vcpus: int
    ram_bytes: int
    disk_bytes: int
    auto_restart: AutoRestart
    instance_id: uuid.UUID
    project_id: uuid.UUID
    pool_id: uuid.UUID | None = None
    """The pool the instance is a VM of, if a pool's keeper created it."""

    def account(self, silo_id: uuid.UUID) -> charging.Account:
        return charging.Account(self.instance_id, self.project_id, silo_id, self.silo, self.project)


class Recorded(Output):
    """The instance as `record` inserted it."""

    generation: int
    silo_id: uuid.UUID


async def record(ctx: Context[CreateParams]) -> Recorded:
    p = ctx.params
    try:
        async with ctx.tx.transaction():  # a savepoint: a name clash must not poison the caller's tx
            inserted = await ctx.tx.execute(
                Q["instance_insert"],
                p.instance_id,
                p.project_id,
                p.name,
                p.vcpus,
                p.ram_bytes,
                p.disk_bytes,
                p.auto_restart.value,
                p.pool_id,
            )
    except asyncpg.UniqueViolationError:
        raise bus.Conflict(f"instance {p.silo}/{p.project}/{p.name} already exists") from None
    if inserted == "INSERT 0 0":  # the project was deleted meanwhile (instance_insert)
        raise bus.NotFound(f"no project {p.silo}/{p.project}")
    v = await views.instance_changed(ctx.app, ctx.tx, p.instance_id)
    return Recorded(generation=v.generation, silo_id=v.silo_id)


async def record_undo(ctx: Context[CreateParams]) -> None:
    instance_id = ctx.params.instance_id
    await ctx.tx.execute(Q["instance_create_undo"], instance_id, f"create failed: {ctx.error}")
    await views.instance_changed(ctx.app, ctx.tx, instance_id)


async def charge_disk(ctx: Context[CreateParams]) -> None:
    p, r = ctx.params, ctx.get(Recorded)
    account = p.account(r.silo_id)
    delta = charging.delta(account, r.generation, vcpus=0, ram_bytes=0, disk_bytes=p.disk_bytes)
    outcome, reason = await ctx.app.charging.charge(account, delta)
    if outcome is not Outcome.applied:
        raise StepFailed(reason or f"disk charge {outcome.value}")


async def charge_disk_undo(ctx: Context[CreateParams]) -> None:
    gen = await ctx.tx.fetchval(Q["instance_bump"], ctx.params.instance_id)
    v = await views.view(ctx.tx, ctx.params.instance_id, ctx.app.settings)
    account = charging.Account.of(v)
    released = charging.delta(account, gen, vcpus=0, ram_bytes=0, disk_bytes=0)
    await charging.queue(ctx.tx, [(account, released)])


async def ready(ctx: Context[CreateParams]) -> None:
    await ctx.tx.execute(Q["instance_create_ready"], ctx.params.instance_id)
    await views.instance_changed(ctx.app, ctx.tx, ctx.params.instance_id)


CREATE = Saga(
    "instance-create",
    [
        Step("record", record, record_undo),
        Step("charge_disk", charge_disk, charge_disk_undo, local=False),
        Step("ready", ready),
    ],
    CreateParams,
)
