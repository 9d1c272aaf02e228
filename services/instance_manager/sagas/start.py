"""The instance start saga.

    interlock       pass the "one start at a time" compare-and-set,   undo: give the instance back
                    and send the charge (in the same transaction)
    charge          await accounting's outcome for the charge        undo: release the charge
                    (vCPUs and RAM, against the quota)
    place           reserve room on an active sled that answers       undo: release the reservation
    create_vmm      look at the sled again; record the VMM on it      undo: end the VMM record, and
                                                                            have the sled destroy it
    ensure_on_sled  ask the sled agent to run the VMM                 (last step: nothing to undo)

The instance becomes running when the sled reports its VMM running (see lifecycle.py), not here: the
saga's job ends once the sled has been asked. A failure at any step unwinds the earlier ones, so a
refused or failed start leaves no charge, reservation or VMM. A user's start that fails leaves the
instance stopped, with the reason; an automatic restart that fails leaves it failed and still meant to
run, and recovery tries again later, backing off; a pool keeper's leaves its VM stopped and meant to run,
for the keeper's next pass.

The remote steps are safe to repeat after a crash between their action and the commit of their progress:
a charge's outcome is kept, and asked again only if missing; an ensure goes out again with the same
message id, and a sled ignores an ensure for a VMM it has.
"""

from __future__ import annotations

import uuid
from enum import StrEnum

import asyncpg

from services.instance_manager import charging, sleds, views
from services.instance_manager.base import Q
from services.instance_manager.orders import Stale
from services.instance_manager.sagas import common
from services.instance_manager.sagas.common import InstanceParams, Placed, Reserved
from services.instance_manager.sagas.definition import Context, Saga, Step, StepFailed
from shared import bus
from shared.messages import Outcome, ProvisionDelta, VmmState


class AlreadyRunning(Exception):
    """Start of an instance that is starting or running already: a successful no-op."""


class Starter(StrEnum):
    """Who asked for a start (the interlock's rule and the failure's wording depend on it)."""

    user = "user"
    pool = "pool"
    """A pool's keeper, starting one of its VMs."""
    restart = "restart"
    """Recovery, restarting a failed instance at the generation it saw."""


class StartParams(InstanceParams):
    expected_generation: int | None = None
    """Set by an automatic restart: the generation at which recovery saw the instance failed."""
    by: Starter | None = None
    """`pool` for a pool keeper's start; stored only then."""

    @property
    def asked_by(self) -> Starter:
        if self.expected_generation is not None:
            return Starter.restart
        return Starter.pool if self.by is Starter.pool else Starter.user


class Interlocked(Reserved):
    """The instance as the interlock won it: the VMM to be, its shape, and whom it is charged to."""

    generation: int
    silo: str
    project: str
    silo_id: uuid.UUID
    project_id: uuid.UUID
    disk_bytes: int
    charge_sent: bool = False
    """Whether the interlock's transaction sent the charge (a saga begun by an older version did not:
    its charge step sends it)."""

    def account(self, instance_id: uuid.UUID) -> charging.Account:
        return charging.Account(instance_id, self.project_id, self.silo_id, self.silo, self.project)

    def charge(self, instance_id: uuid.UUID) -> ProvisionDelta:
        """The charge of the instance once it runs: its vCPUs, RAM and disk, as of the interlock's
        generation."""
        return charging.delta(
            self.account(instance_id),
            self.generation,
            vcpus=self.vcpus,
            ram_bytes=self.ram_bytes,
            disk_bytes=self.disk_bytes,
        )


async def interlock(ctx: Context[StartParams]) -> Interlocked:
    """Pass the interlock (queries.sql start_interlock), or say why not; once passed, send the charge in
    the same transaction (the charge step awaits its outcome). An automatic restart is an
    order: refused as `stale` unless, under the row lock and by this service's clock, the instance is
    failed at the generation it names, best_effort, meant to run and due (next_restart_at). A pool
    keeper's start is refused once its VM is no longer meant to run (retired)."""
    p = ctx.params
    vmm_id = uuid.uuid4()
    by = p.asked_by
    expected = p.expected_generation
    rule = (ctx.app.settings.restart_cooldown, ctx.app.settings.restart_backoff_max)
    won = await ctx.tx.fetchrow(Q["start_interlock"], p.instance_id, vmm_id, expected, by.value, *rule)
    if won is None:
        current = await ctx.tx.fetchrow(Q["start_refused"], p.instance_id, *rule)
        state = current["state"] if current else "destroyed"
        if by is Starter.restart:
            raise Stale("restart", _not_restartable(current, expected))
        if state in ("starting", "running", "migrating"):
            raise AlreadyRunning(state)
        if state == "destroyed":
            raise bus.NotFound("instance not found")
        if by is Starter.pool and current["intended_state"] != "running":
            raise bus.Conflict("pool VM is retired: its pool no longer means it to run")
        raise bus.Conflict(f"instance is {state}; it can be started once it is stopped")
    v = await views.view(ctx.tx, p.instance_id, ctx.app.settings)
    interlocked = Interlocked(
        vmm_id=vmm_id,
        generation=won["generation"],
        silo=v.silo,
        project=v.project,
        silo_id=v.silo_id,
        project_id=v.project_id,
        vcpus=won["vcpus"],
        ram_bytes=won["ram_bytes"],
        disk_bytes=won["disk_bytes"],
        charge_sent=True,
    )
    events = views.instance_events(v, v1=ctx.app.send_v1)  # the change, then the charge: one statement
    charge = [(interlocked.account(p.instance_id), interlocked.charge(p.instance_id))]
    await charging.queue(ctx.tx, charge, before=events)
    return interlocked


def _not_restartable(current: asyncpg.Record | None, expected: int | None) -> str:
    """Which of an automatic restart's conditions no longer holds (start_refused's row)."""
    if current is None:
        return "instance is destroyed"
    if current["state"] != "failed" or current["generation"] != expected:
        now = f"{current['state']} at generation {current['generation']}"
        return f"instance is {now}, not failed at generation {expected}"
    if current["auto_restart"] != "best_effort":
        return f"instance's auto-restart policy is {current['auto_restart']}"
    if current["intended_state"] != "running":
        return "instance is meant to stay stopped"
    due = current["next_restart_at"]
    if due is not None and due > current["now"]:
        return f"its next restart is due in {(due - current['now']).total_seconds():.1f}s, not yet"
    return "instance is not failed with nothing running"


async def interlock_undo(ctx: Context[StartParams]) -> None:
    p = ctx.params
    by = p.asked_by
    released = await ctx.tx.fetchrow(
        Q["start_interlock_release"],
        p.instance_id,
        ctx.get(Interlocked).vmm_id,
        f"{'automatic restart' if by is Starter.restart else 'start'} failed: {ctx.error}",
        by.value,
    )
    if released is not None:
        await views.instance_changed(ctx.app, ctx.tx, p.instance_id)


async def charge(ctx: Context[StartParams]) -> None:
    i, instance_id = ctx.get(Interlocked), ctx.params.instance_id
    outcome, reason = await ctx.app.charging.charge(
        i.account(instance_id), i.charge(instance_id), sent=i.charge_sent
    )
    if outcome is Outcome.refused:
        raise StepFailed(reason)
    if outcome is Outcome.stale:
        raise StepFailed("the instance changed while it was starting")


async def charge_undo(ctx: Context[StartParams]) -> None:
    instance_id = ctx.params.instance_id
    bumped = await ctx.tx.fetchrow(Q["instance_bump_if_active"], instance_id, ctx.get(Interlocked).vmm_id)
    if bumped is not None:  # otherwise whoever took the VMM away released the charge with it
        v = await views.view(ctx.tx, instance_id, ctx.app.settings)
        await charging.release(ctx.tx, [(v, bumped["generation"])])


async def place(ctx: Context[StartParams]) -> Placed:
    r = ctx.get(Reserved)
    reserved = await sleds.reserve(
        ctx.tx,
        r.vcpus,
        r.ram_bytes,
        judge_silence=ctx.app.hears_sleds(),
        silent_after=ctx.app.settings.unknown_after(),
    )
    return common.placed(reserved)


async def create_vmm(ctx: Context[StartParams]) -> None:
    await common.still_placeable(ctx)
    await common.record_vmm(ctx, VmmState.starting)
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    instance_id, vmm_id = ctx.params.instance_id, ctx.get(Reserved).vmm_id
    if await ctx.tx.fetchrow(Q["instance_bump_if_active"], instance_id, vmm_id) is not None:
        await views.instance_changed(ctx.app, ctx.tx, instance_id)


START = Saga(
    "instance-start",
    [
        Step("interlock", interlock, interlock_undo),
        Step("charge", charge, charge_undo, local=False),
        Step("place", place, common.place_undo),
        Step("create_vmm", create_vmm, common.create_vmm_undo),
        Step("ensure_on_sled", common.ensure_on_sled, local=False),
    ],
    StartParams,
)
