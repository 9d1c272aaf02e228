"""Instance changes that are single transactions: stop, delete, and what a sled's VMM report means for
the instance (the end of a migration among them), and failing a VMM that runs nowhere any more, with the
evidence of why."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import asyncpg

from services.instance_manager.app import SOURCE, App, Q
from shared import bus, subjects, telemetry
from shared.db import enqueue
from shared.messages import InstanceView, VmmDestroy, VmmReport, VmmState, VmmStop

log = logging.getLogger(__name__)


async def stop(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    state = inst["state"]
    if state in ("stopped", "stopping"):
        return await app.view(conn, instance_id)
    if state == "running":
        sled_id = await conn.fetchval(Q["vmm_sled"], inst["active_vmm_id"])
        await conn.execute(Q["instance_set_state"], instance_id, "stopping", None)
        await conn.execute(Q["instance_set_intent"], instance_id, "stopped")
        await enqueue(
            conn,
            subjects.sled_command(sled_id, "vmm.stop"),
            VmmStop(vmm_id=inst["active_vmm_id"]),
            source=SOURCE,
            key=f"stop:{inst['active_vmm_id']}",
        )
        return await app.instance_changed(conn, instance_id)
    if state == "failed":  # a failed instance runs nowhere and holds no vCPU/RAM charge
        await conn.execute(Q["instance_set_state"], instance_id, "stopped", None)
        await conn.execute(Q["instance_set_intent"], instance_id, "stopped")
        return await app.instance_changed(conn, instance_id)
    raise bus.Conflict(f"instance is {state}; it can be stopped once it is running")


async def retire(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> None:
    """A pool VM its pool no longer needs is stopped, then deleted by the keeper. Checked under the row
    lock: a VM handed out meanwhile is a customer's now, and is left alone."""
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    if inst["pool_id"] is None or inst["has_customer_data_at"] is not None:
        return
    if inst["state"] == "running":
        await stop(app, conn, instance_id)
    else:
        await conn.execute(Q["instance_set_intent"], instance_id, "stopped")


async def delete(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    if inst["state"] not in ("stopped", "failed") or inst["active_vmm_id"] is not None:
        raise bus.Conflict(f"instance is {inst['state']}; only a stopped or failed instance can be deleted")
    gen = await conn.fetchval(Q["instance_destroy"], instance_id)
    await app.release_charge(conn, instance_id, gen)
    return await app.instance_changed(conn, instance_id)


async def apply_vmm_report(app: App, report: VmmReport) -> str:
    """Write a sled's report about a VMM, fenced by the VMM's generation; move the instance accordingly.

    Returns what happened, for counters and tests: applied, stale (not newer, or about an ended VMM),
    unknown (no such VMM), or detached (about a VMM that is no longer the instance's active one).
    """
    terminal = report.state.terminal
    async with app.pool.acquire() as conn, conn.transaction():
        vmm = await conn.fetchrow(
            Q["vmm_apply_report"],
            report.vmm_id,
            report.state.value,
            report.generation,
            terminal,
            report.sled_id,
            report.boot_number,
        )
        if vmm is None:
            placed = await conn.fetchrow(Q["vmm_placed"], report.vmm_id)
            if placed is not None and placed["sled_id"] != report.sled_id:
                telemetry.count("reports.wrong_sled")
                raise bus.Reject(
                    f"forbidden: {report.sled_id} reports on VMM {report.vmm_id}, which runs on "
                    f"{placed['sled_id']}: a sled speaks only for its own VMMs"
                )
            result = "unknown" if placed is None else "stale"
            telemetry.count(f"reports.{result}")
            return result
        if terminal:  # this report ended the VMM record: its sled reservation goes with it, exactly once
            await conn.execute(Q["unreserve"], vmm["sled_id"], vmm["vcpus"], vmm["ram_bytes"])
        inst = await conn.fetchrow(Q["instance_lock"], vmm["instance_id"])
        if inst["target_vmm_id"] == report.vmm_id:
            if report.state is VmmState.running:
                await _migration_end(app, conn, inst, took_over=True)
            elif terminal:
                reason = f"migration target {report.vmm_id} {report.state.value} on {report.sled_id}"
                await _migration_end(app, conn, inst, took_over=False, reason=reason)
            telemetry.count("reports.applied")
            return "applied"
        if inst["active_vmm_id"] != report.vmm_id:
            telemetry.count("reports.detached")
            return "detached"
        if terminal and inst["target_vmm_id"] is not None and report.migrated_to == inst["target_vmm_id"]:
            await _migration_end(app, conn, inst, took_over=True)  # the source handed over, and ended
        elif report.state is VmmState.running and inst["state"] == "starting":
            await conn.execute(Q["instance_set_state"], inst["id"], "running", None)
            await app.instance_changed(conn, inst["id"])
        elif report.state is VmmState.stopping and inst["state"] == "running":
            await conn.execute(Q["instance_set_state"], inst["id"], "stopping", None)
            await app.instance_changed(conn, inst["id"])
        elif terminal:
            failed = report.state is not VmmState.stopped
            reason = f"VMM {report.vmm_id} {report.state.value} on {report.sled_id}"
            evidence = Evidence("vmm", vmm["boot_number"], report.boot_number) if failed else None
            await _active_vmm_ended(app, conn, inst, vmm, reason, evidence)
        telemetry.count("reports.applied")
        return "applied"


@dataclass(frozen=True)
class Evidence:
    """Why the control plane ended a VMM that an instance relied on: kept with the failure, so that the
    checker can hold it against the sleds' own boot history."""

    kind: str
    """rebooted, stuck, expunged, or vmm (its sled reported it failed)."""
    vmm_boot: int | None
    """The boot of its sled the VMM was placed on."""
    proof_boot: int | None
    """The sled's boot that shows it gone (for `rebooted`: a later one)."""


async def _active_vmm_ended(
    app: App,
    conn: asyncpg.Connection,
    inst: asyncpg.Record,
    vmm: asyncpg.Record,
    reason: str,
    evidence: Evidence | None,
) -> None:
    """The instance's VMM is gone: it lets go of it and of its vCPU/RAM charge, and is stopped, or failed
    if it did not mean to stop (`evidence` says why it failed; None for a VMM that stopped as asked). A
    migration under way ends with it: its target has nothing to take over."""
    instance_id = inst["id"]
    if inst["target_vmm_id"] is not None:
        await _end_vmm(conn, inst["target_vmm_id"], "destroyed")
    if evidence is not None:
        await conn.execute(
            Q["failure_record"],
            instance_id,
            vmm["id"],
            vmm["sled_id"],
            evidence.kind,
            reason,
            evidence.vmm_boot,
            evidence.proof_boot,
        )
    new_state = "failed" if evidence is not None and inst["state"] != "stopping" else "stopped"
    gen = await conn.fetchval(
        Q["instance_vmm_ended"], instance_id, new_state, reason if new_state == "failed" else None
    )
    await app.release_charge(conn, instance_id, gen)
    await app.instance_changed(conn, instance_id)


async def _migration_end(
    app: App, conn: asyncpg.Connection, inst: asyncpg.Record, took_over: bool, reason: str | None = None
) -> None:
    """A migration is over. If the target took over, it becomes the active VMM and the source's record
    ends (the sled is told to destroy it, in case it still runs); if not, the instance stays on the
    source. Either way it is running again, and its charge never moved."""
    source, target = inst["active_vmm_id"], inst["target_vmm_id"]
    if took_over:
        await _end_vmm(conn, source, "destroyed")
        await conn.fetchval(Q["migration_end"], inst["id"], target, target, None)
        telemetry.count("migrations.done")
    else:
        await conn.fetchval(Q["migration_end"], inst["id"], target, source, f"migration failed: {reason}")
        telemetry.count("migrations.failed")
    await app.instance_changed(conn, inst["id"])


async def end_unclaimed_vmm(conn: asyncpg.Connection, vmm_id: uuid.UUID) -> None:
    """A saga's undo of a VMM it made: end the record (and have the sled destroy it), unless an instance
    runs on it by now. No undo ever ends an instance's active VMM: a step retried after the move or the
    start it began had already completed finds the VMM in use, and leaves it so."""
    vmm = await conn.fetchrow(Q["vmm_lock"], vmm_id, 0)
    if vmm is None or vmm["ended_at"] is not None:
        return
    inst = await conn.fetchrow(Q["instance_lock"], vmm["instance_id"])
    if inst["active_vmm_id"] == vmm_id and inst["state"] in ("running", "stopping", "migrating"):
        telemetry.count("saga.undo_spared_active_vmm")
        log.warning("undo of VMM %s left it alone: instance %s runs on it", vmm_id, inst["id"])
        return
    await _end_vmm(conn, vmm_id, "destroyed")


async def _end_vmm(conn: asyncpg.Connection, vmm_id: uuid.UUID, state: str) -> asyncpg.Record | None:
    """End a VMM record the control plane gives up on, and release its room; its sled is told to destroy
    it, in case it still runs there (through the outbox, so the order always follows the record's end).
    Idempotent: returns the record only if this call ended it."""
    vmm = await conn.fetchrow(Q["vmm_end"], vmm_id, state)
    if vmm is None:
        return None
    await conn.execute(Q["unreserve"], vmm["sled_id"], vmm["vcpus"], vmm["ram_bytes"])
    await enqueue(
        conn,
        subjects.sled_command(vmm["sled_id"], "vmm.destroy"),
        VmmDestroy(vmm_id=vmm_id),
        source=SOURCE,
        key=f"destroy:{vmm_id}",
    )
    return vmm


async def fail_vmm(
    app: App, conn: asyncpg.Connection, vmm_id: uuid.UUID, reason: str, evidence: Evidence
) -> str:
    """A VMM runs nowhere any more (its sled rebooted or was expunged, or it never answered in time).

    Idempotent: a VMM that has already ended is left alone. The sled is told to destroy it all the same,
    in case it does still run somewhere (it would be a zombie). The caller has checked that this is so
    (orders.py): this only carries it out.
    """
    vmm = await _end_vmm(conn, vmm_id, "failed")
    if vmm is None:
        telemetry.count("vmms.lost_already_ended")
        return "already ended"
    telemetry.count("vmms.lost")
    inst = await conn.fetchrow(Q["instance_lock"], vmm["instance_id"])
    if inst["target_vmm_id"] == vmm_id:
        await _migration_end(app, conn, inst, took_over=False, reason=reason)
        return "migration called off"
    if inst["active_vmm_id"] != vmm_id:
        return "detached"
    await _active_vmm_ended(app, conn, inst, vmm, reason, evidence)
    return "failed"


async def expunge(app: App, conn: asyncpg.Connection, sled_id: str) -> int:
    """Take a sled out of the rack for good; fail every VMM it held. Returns how many."""
    sled = await conn.fetchrow(Q["sled_lock"], sled_id)
    if sled is None:
        raise bus.NotFound(f"no sled {sled_id}")
    await conn.execute(Q["sled_expunge"], sled_id)
    vmms = await conn.fetch(Q["vmms_live_on_sled"], sled_id)
    for v in vmms:
        evidence = Evidence("expunged", v["boot_number"], sled["boot_number"])
        await fail_vmm(app, conn, v["id"], f"sled {sled_id} was expunged", evidence)
    return len(vmms)


async def settle(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID, generation: int) -> bool:
    """A failed instance that will not be restarted comes to rest as stopped (unless it changed since)."""
    if await conn.fetchval(Q["settle_failed"], instance_id, generation) is None:
        return False
    await app.instance_changed(conn, instance_id)
    return True
