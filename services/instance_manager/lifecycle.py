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
from shared.db import enqueue, enqueue_many
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
            await _active_vmms_ended(app, conn, [Ended(inst, vmm, reason, evidence)])
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


@dataclass(frozen=True)
class Ended:
    """An instance whose active VMM is gone, and why."""

    inst: asyncpg.Record
    vmm: asyncpg.Record
    reason: str
    evidence: Evidence | None
    """Why it failed; None for a VMM that stopped as asked."""

    @property
    def state(self) -> str:
        """Failed if it did not mean to stop; stopped otherwise."""
        return "failed" if self.evidence is not None and self.inst["state"] != "stopping" else "stopped"


async def _active_vmms_ended(app: App, conn: asyncpg.Connection, ended: list[Ended]) -> None:
    """Instances whose VMMs are gone let go of them and of their vCPU/RAM charges, and are stopped or
    failed (Ended.state). A migration under way ends with its source: its target has nothing to take
    over. A fixed number of statements however many there are: a sled's reboot ends hundreds at once."""
    if not ended:
        return
    await _end_vmms(conn, [e.inst["target_vmm_id"] for e in ended if e.inst["target_vmm_id"]], "destroyed")
    failed = [e for e in ended if e.evidence is not None]
    if failed:
        await conn.execute(
            Q["failures_record"],
            [e.inst["id"] for e in failed],
            [e.vmm["id"] for e in failed],
            [e.vmm["sled_id"] for e in failed],
            [e.evidence.kind for e in failed if e.evidence],
            [e.reason for e in failed],
            [e.evidence.vmm_boot for e in failed if e.evidence],
            [e.evidence.proof_boot for e in failed if e.evidence],
        )
    rows = await conn.fetch(
        Q["instances_vmm_ended"],
        [e.inst["id"] for e in ended],
        [e.state for e in ended],
        [e.reason if e.state == "failed" else None for e in ended],
    )
    generation = {r["id"]: r["generation"] for r in rows}
    views = await app.instances_changed(conn, [e.inst["id"] for e in ended])
    await app.release_charges(conn, [(v, generation[v.id]) for v in views])


async def _migration_end(
    app: App, conn: asyncpg.Connection, inst: asyncpg.Record, took_over: bool, reason: str | None = None
) -> None:
    """A migration is over. If the target took over, it becomes the active VMM and the source's record
    ends (the sled is told to destroy it, in case it still runs); if not, the instance stays on the
    source. Either way it is running again, and its charge never moved."""
    source, target = inst["active_vmm_id"], inst["target_vmm_id"]
    if took_over:
        await _end_vmms(conn, [source], "destroyed")
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
    vmm = await conn.fetchrow(Q["vmms_lock"], [vmm_id], 0)
    if vmm is None or vmm["ended_at"] is not None:
        return
    inst = await conn.fetchrow(Q["instance_lock"], vmm["instance_id"])
    if inst["active_vmm_id"] == vmm_id and inst["state"] in ("running", "stopping", "migrating"):
        telemetry.count("saga.undo_spared_active_vmm")
        log.warning("undo of VMM %s left it alone: instance %s runs on it", vmm_id, inst["id"])
        return
    await _end_vmms(conn, [vmm_id], "destroyed")


async def _end_vmms(conn: asyncpg.Connection, vmm_ids: list[uuid.UUID], state: str) -> list[asyncpg.Record]:
    """End VMM records the control plane gives up on, and release their room; their sleds are told to
    destroy them, in case they still run there (through the outbox, so the order always follows the
    record's end). Idempotent: returns only the records this call ended."""
    if not vmm_ids:
        return []
    ended = await conn.fetch(Q["vmms_end"], vmm_ids, state)
    await enqueue_many(
        conn,
        [
            (
                subjects.sled_command(v["sled_id"], "vmm.destroy"),
                VmmDestroy(vmm_id=v["id"]),
                f"destroy:{v['id']}",
            )
            for v in ended
        ],
        source=SOURCE,
    )
    return ended


@dataclass(frozen=True)
class Lost:
    """A VMM that runs nowhere any more, and why."""

    vmm_id: uuid.UUID
    reason: str
    evidence: Evidence


async def fail_vmms(app: App, conn: asyncpg.Connection, lost: list[Lost]) -> dict[uuid.UUID, str]:
    """VMMs that run nowhere any more (their sled rebooted or was expunged, or they never answered in
    time). Returns what became of each: failed (its instance failed), migration called off (it was a
    migration's target), detached (no instance ran on it), or already ended (left alone).

    Idempotent. Each sled is told to destroy its VMMs all the same, in case one does still run (it would be
    a zombie). The caller has checked that each is lost (orders.py): this only carries it out, in a fixed
    number of statements (a migration called off takes its own few).
    """
    why = {x.vmm_id: x for x in lost}
    results = dict.fromkeys(why, "already ended")
    ended = await _end_vmms(conn, sorted(why, key=lambda u: u.int), "failed")
    telemetry.count("vmms.lost_already_ended", len(lost) - len(ended))
    telemetry.count("vmms.lost", len(ended))
    insts = {r["id"]: r for r in await conn.fetch(Q["instances_lock"], [v["instance_id"] for v in ended])}
    gone: list[Ended] = []
    for vmm in ended:
        inst, x = insts[vmm["instance_id"]], why[vmm["id"]]
        if inst["target_vmm_id"] == vmm["id"]:
            await _migration_end(app, conn, inst, took_over=False, reason=x.reason)
            results[vmm["id"]] = "migration called off"
        elif inst["active_vmm_id"] != vmm["id"]:
            results[vmm["id"]] = "detached"
        else:
            gone.append(Ended(inst, vmm, x.reason, x.evidence))
            results[vmm["id"]] = "failed"
    await _active_vmms_ended(app, conn, gone)
    return results


async def expunge(app: App, conn: asyncpg.Connection, sled_id: str) -> int:
    """Take a sled out of the rack for good; fail every VMM it held. Returns how many."""
    sled = await conn.fetchrow(Q["sled_lock"], sled_id)
    if sled is None:
        raise bus.NotFound(f"no sled {sled_id}")
    await conn.execute(Q["sled_expunge"], sled_id)
    vmms = await conn.fetch(Q["vmms_live_on_sled"], sled_id)
    reason = f"sled {sled_id} was expunged"
    await fail_vmms(
        app,
        conn,
        [Lost(v["id"], reason, Evidence("expunged", v["boot_number"], sled["boot_number"])) for v in vmms],
    )
    return len(vmms)


async def settle(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID, generation: int) -> bool:
    """A failed instance that will not be restarted comes to rest as stopped (unless it changed since)."""
    if await conn.fetchval(Q["settle_failed"], instance_id, generation) is None:
        return False
    await app.instance_changed(conn, instance_id)
    return True
