"""Steps and outputs that the start and migrate sagas share: placing a VMM on a sled, recording it, and
asking its sled to run it. Each saga lists them in its own step table (start.py, migrate.py)."""

from __future__ import annotations

import uuid

import asyncpg

from services.instance_manager import lifecycle, sleds
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.sagas.definition import Context, Output, Params, StepFailed
from shared import bus
from shared.messages import MigrationSource, VmmEnsure, VmmState
from shared.topology import subjects


class InstanceParams(Params):
    """A saga about one instance."""

    instance_id: uuid.UUID


class Reserved(Output):
    """What an interlock hands to the placement: the VMM to be, and the room it needs."""

    vmm_id: uuid.UUID
    vcpus: int
    ram_bytes: int


class Placed(Output):
    """Where the VMM goes: the sled, and the boot of it the VMM is placed on."""

    sled_id: str
    boot_id: uuid.UUID | None = None
    boot_number: int | None = None


def placed(row: asyncpg.Record) -> Placed:
    """What a saga keeps of a placement (sleds.reserve's row)."""
    return Placed(sled_id=row["id"], boot_id=row["boot_id"], boot_number=row["boot_number"])


async def place_undo(ctx: Context[InstanceParams]) -> None:
    # Once the VMM record exists, the reservation is the VMM's: whoever ends the record releases it.
    r, p = ctx.get(Reserved), ctx.get(Placed)
    if not await ctx.tx.fetchval(Q["vmm_exists"], r.vmm_id):
        await ctx.tx.execute(Q["unreserve"], p.sled_id, r.vcpus, r.ram_bytes)


async def record_vmm(ctx: Context[InstanceParams], state: VmmState) -> None:
    """Write the VMM record on the sled placed on (which `sleds.still_placeable` has looked at again,
    first: sled locks come before instance locks, as an expunge takes them)."""
    r, p = ctx.get(Reserved), ctx.get(Placed)
    await ctx.tx.execute(
        Q["vmm_insert"],
        r.vmm_id,
        ctx.params.instance_id,
        p.sled_id,
        r.vcpus,
        r.ram_bytes,
        p.boot_id,
        p.boot_number,
        state.value,
    )


async def create_vmm_undo(ctx: Context[InstanceParams]) -> None:
    await lifecycle.end_unclaimed_vmm(ctx.tx, ctx.get(Reserved).vmm_id)


async def still_placeable(ctx: Context[InstanceParams]) -> None:
    """The second look at the sled placed on, before its VMM record is written; none when `place` ran in
    this very transaction (its reservation holds the sled's row locked since it looked)."""
    if "place" in ctx.done_here:
        return
    await sleds.still_placeable(
        ctx.tx,
        ctx.get(Placed).sled_id,
        judge_silence=ctx.app.hears_sleds(),
        silent_after=ctx.app.settings.unknown_after(),
    )


async def ensure_on_sled(ctx: Context[InstanceParams], migrate_from: MigrationSource | None = None) -> None:
    """Ask the sled to run the VMM, holding its record's lock meanwhile: an order that ends the record (an
    expunge, a lost VMM) waits, and its destroy follows this ensure on the sled's stream. A record that
    has ended already (before this step, or since a first try that crashed) is asked for nothing. The
    record notes when the sled was asked, once it was, and where on the stream the order waits (its
    transition timeout counts from then, and a VMM whose sled has not read the order is never stuck). No
    outbox: the step runs again until its progress is recorded, and a sled ignores an ensure for a VMM
    it has."""
    r, p = ctx.get(Reserved), ctx.get(Placed)
    cmd = VmmEnsure(
        vmm_id=r.vmm_id,
        instance_id=ctx.params.instance_id,
        vcpus=r.vcpus,
        ram_bytes=r.ram_bytes,
        boot_number=p.boot_number,
        migrate_from=migrate_from,
    )
    async with ctx.app.pool.acquire() as conn, conn.transaction():
        vmm = await conn.fetchrow(Q["vmms_lock"], [r.vmm_id], 0)
        if vmm is None or vmm["ended_at"] is not None:
            if vmm is not None and vmm["generation"] > 0:
                return  # its sled had it, and reported on it: what this step asked for was done
            raise StepFailed(f"VMM {r.vmm_id} was ended before its sled was asked to run it")
        stored = await bus.publish(
            ctx.app.js,
            subjects.sled_command(p.sled_id, "vmm.ensure"),
            cmd,
            source=SOURCE,
            key=f"ensure:{r.vmm_id}",
        )
        await conn.execute(Q["vmm_asked"], r.vmm_id, stored.seq if stored else None)
