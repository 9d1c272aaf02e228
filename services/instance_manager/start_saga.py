"""The instance start saga.

    interlock       pass the "one start at a time" compare-and-set    undo: give the instance back
    charge          charge vCPUs and RAM through accounting (quota)   undo: release the charge
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
from typing import Any

import asyncpg

from services.instance_manager import lifecycle, sleds
from services.instance_manager.app import SOURCE, App, Q
from services.instance_manager.orders import Stale
from services.instance_manager.saga import Context, Saga, Step, StepFailed
from shared import bus, subjects
from shared.config import restart_backoff_max, restart_cooldown
from shared.messages import MigrationSource, ProvisionDelta, VmmEnsure


class AlreadyRunning(Exception):
    """Start of an instance that is starting or running already: a successful no-op."""


async def interlock(ctx: Context) -> dict[str, Any]:
    """Pass the interlock (queries.sql start_interlock), or say why not. An automatic restart is an
    order: refused as `stale` unless, under the row lock and by this service's clock, the instance is
    failed at the generation it names, best_effort, meant to run and due (next_restart_at). A pool
    keeper's start is refused once its VM is no longer meant to run (retired)."""
    instance_id = uuid.UUID(ctx.params["instance_id"])
    vmm_id = uuid.uuid4()
    by = asked_by(ctx.params)
    expected = ctx.params.get("expected_generation")  # set by an automatic restart
    rule = (restart_cooldown(), restart_backoff_max())
    won = await ctx.tx.fetchrow(Q["start_interlock"], instance_id, vmm_id, expected, by, *rule)
    if won is None:
        current = await ctx.tx.fetchrow(Q["start_refused"], instance_id, *rule)
        state = current["state"] if current else "destroyed"
        if by == "restart":
            raise Stale("restart", _not_restartable(current, expected))
        if state in ("starting", "running", "migrating"):
            raise AlreadyRunning(state)
        if state == "destroyed":
            raise bus.NotFound("instance not found")
        if by == "pool" and current["intended_state"] != "running":
            raise bus.Conflict("pool VM is retired: its pool no longer means it to run")
        raise bus.Conflict(f"instance is {state}; it can be started once it is stopped")
    app: App = ctx.app
    v = await app.instance_changed(ctx.tx, instance_id)
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


def _not_restartable(current: asyncpg.Record | None, expected: int) -> str:
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


def asked_by(params: dict[str, Any]) -> str:
    """Who asked for the start: recovery (`restart`, naming the generation it saw), a pool's keeper
    (`pool`), or a user."""
    if params.get("expected_generation") is not None:
        return "restart"
    return "pool" if params.get("by") == "pool" else "user"


async def interlock_undo(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    by = asked_by(ctx.params)
    released = await ctx.tx.fetchrow(
        Q["start_interlock_release"],
        instance_id,
        uuid.UUID(ctx.data["vmm_id"]),
        f"{'automatic restart' if by == 'restart' else 'start'} failed: {ctx.error}",
        by,
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


def placement(placed: asyncpg.Record) -> dict[str, Any]:
    """What a saga keeps of a placement: the sled, and the boot of it the VMM is placed on."""
    boot_id = str(placed["boot_id"]) if placed["boot_id"] else None
    return {"sled_id": placed["id"], "boot_id": boot_id, "boot_number": placed["boot_number"]}


async def place(ctx: Context) -> dict[str, Any]:
    d = ctx.data
    placed = await sleds.reserve(ctx.tx, d["vcpus"], d["ram_bytes"], judge_silence=ctx.app.hears_sleds())
    return placement(placed)


async def place_undo(ctx: Context) -> None:
    # Once the VMM record exists, the reservation is the VMM's: whoever ends the record releases it.
    if not await ctx.tx.fetchval(Q["vmm_exists"], uuid.UUID(ctx.data["vmm_id"])):
        await ctx.tx.execute(Q["unreserve"], ctx.data["sled_id"], ctx.data["vcpus"], ctx.data["ram_bytes"])


async def record_vmm(ctx: Context, state: str) -> None:
    """Write the VMM record on the sled placed on (which `sleds.still_placeable` has looked at again,
    first: sled locks come before instance locks, as an expunge takes them)."""
    d = ctx.data
    await ctx.tx.execute(
        Q["vmm_insert"],
        uuid.UUID(d["vmm_id"]),
        uuid.UUID(ctx.params["instance_id"]),
        d["sled_id"],
        d["vcpus"],
        d["ram_bytes"],
        uuid.UUID(d["boot_id"]) if d.get("boot_id") else None,
        d.get("boot_number"),
        state,
    )


async def create_vmm(ctx: Context) -> None:
    instance_id = uuid.UUID(ctx.params["instance_id"])
    await sleds.still_placeable(ctx.tx, ctx.data["sled_id"], judge_silence=ctx.app.hears_sleds())
    await record_vmm(ctx, "starting")
    # Tell everyone where the instance is going (recovery watches that sled's boots from now on).
    vmm_id = uuid.UUID(ctx.data["vmm_id"])
    if await ctx.tx.fetchrow(Q["instance_bump_if_active"], instance_id, vmm_id) is not None:
        await ctx.app.instance_changed(ctx.tx, instance_id)


async def create_vmm_undo(ctx: Context) -> None:
    await lifecycle.end_unclaimed_vmm(ctx.tx, uuid.UUID(ctx.data["vmm_id"]))


async def ensure_on_sled(ctx: Context, migrate_from: MigrationSource | None = None) -> None:
    """Ask the sled to run the VMM, holding its record's lock meanwhile: an order that ends the record (an
    expunge, a lost VMM) waits, and its destroy follows this ensure on the sled's stream. A record that
    has ended already (before this step, or since a first try that crashed) is asked for nothing. The
    record notes when the sled was asked, once it was (its transition timeout counts from then: a VMM
    whose sled was not asked yet is never stuck)."""
    d = ctx.data
    vmm_id = uuid.UUID(d["vmm_id"])
    cmd = VmmEnsure(
        vmm_id=vmm_id,
        instance_id=uuid.UUID(ctx.params["instance_id"]),
        vcpus=d["vcpus"],
        ram_bytes=d["ram_bytes"],
        boot_number=d.get("boot_number"),
        migrate_from=migrate_from,
    )
    async with ctx.app.pool.acquire() as conn, conn.transaction():
        vmm = await conn.fetchrow(Q["vmms_lock"], [vmm_id], 0)
        if vmm is None or vmm["ended_at"] is not None:
            if vmm is not None and vmm["generation"] > 0:
                return  # its sled had it, and reported on it: what this step asked for was done
            raise StepFailed(f"VMM {vmm_id} was ended before its sled was asked to run it")
        await bus.publish(
            ctx.app.js,
            subjects.sled_command(d["sled_id"], "vmm.ensure"),
            cmd,
            source=SOURCE,
            key=f"ensure:{d['vmm_id']}",
        )
        await conn.execute(Q["vmm_asked"], vmm_id)


START = Saga(
    "instance-start",
    [
        Step("interlock", interlock, interlock_undo),
        Step("charge", charge, charge_undo, local=False),
        Step("place", place, place_undo),
        Step("create_vmm", create_vmm, create_vmm_undo),
        Step("ensure_on_sled", ensure_on_sled, local=False),
    ],
)
