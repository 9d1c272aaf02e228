"""Instance changes that are single transactions: stop, delete, and what a sled's VMM report means for
the instance (the end of a migration among them), and failing a VMM that runs nowhere any more, with the
evidence of why."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field

import asyncpg

from services.instance_manager import charging
from services.instance_manager.app import App
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.views import instance_changed, instances_changed, view
from shared import bus, telemetry
from shared.db import enqueue, enqueue_many
from shared.messages import InstanceView, VmmDestroy, VmmReport, VmmState, VmmStop
from shared.topology import subjects

log = logging.getLogger(__name__)


async def stop(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    state = inst["state"]
    if state in ("stopped", "stopping"):
        return await view(conn, instance_id, app.settings)
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
        return await instance_changed(app, conn, instance_id)
    if state == "failed":  # a failed instance runs nowhere and holds no vCPU/RAM charge
        await conn.execute(Q["instance_set_state"], instance_id, "stopped", None)
        await conn.execute(Q["instance_set_intent"], instance_id, "stopped")
        return await instance_changed(app, conn, instance_id)
    raise bus.Conflict(f"instance is {state}; it can be stopped once it is running")


async def retire(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> None:
    """A pool VM its pool no longer needs is meant to be stopped from now on (a change of intent: a new
    generation, and an event), stopped if it runs, then deleted by the keeper. Whatever state it is in
    (starting, say), the keeper's later passes stop it once it runs (pool_keeper.Keeper.keep). Checked under
    the row lock: a VM handed out meanwhile is a customer's now, and is left alone."""
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    if inst["pool_id"] is None or inst["has_customer_data_at"] is not None:
        return
    if inst["state"] == "running":
        await stop(app, conn, instance_id)
    elif await conn.fetchval(Q["instance_set_intent"], instance_id, "stopped") is not None:
        await instance_changed(app, conn, instance_id)


async def delete(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    if inst["state"] not in ("stopped", "failed") or inst["active_vmm_id"] is not None:
        raise bus.Conflict(f"instance is {inst['state']}; only a stopped or failed instance can be deleted")
    gen = await conn.fetchval(Q["instance_destroy"], instance_id)
    await charging.release(conn, [(await view(conn, instance_id, app.settings), gen)])
    return await instance_changed(app, conn, instance_id)


async def apply_vmm_reports(app: App, batch: list[bus.Delivery]) -> None:
    """Write a batch of sleds' VMM reports, fenced by each VMM's generation, and move the instances
    accordingly: one transaction, a fixed number of statements for the common cases (a VMM running,
    stopping or gone), so that a rack's reports keep up with its sleds.

    A report counts only for the VMM's own sled. Reports are taken by VMM and sled: of one sled's about
    a VMM, the newest counts, and a written one moves its VMM's instance only as its own sled reported
    it. A sled's reports about a VMM placed on another sled are never written (the fence): each of them is
    refused as forbidden (dead-lettered with the reason), also when the VMM's own sled's report is in the
    same batch. A report not written is otherwise stale (not newer, or about an ended VMM) or unknown (no
    such VMM). An instance named by more than one written report, or in a migration, is moved report by
    report.
    """
    sent: dict[tuple[uuid.UUID, str], list[bus.Delivery]] = {}
    for d in batch:
        sent.setdefault((d.body.vmm_id, d.body.sled_id), []).append(d)
    reports = {k: max((d.body for d in ds), key=lambda r: r.generation) for k, ds in sent.items()}
    async with app.pool.acquire() as conn, conn.transaction():
        written = await conn.fetch(
            Q["vmms_apply_reports"],
            [r.vmm_id for r in reports.values()],
            [r.state.value for r in reports.values()],
            [r.generation for r in reports.values()],
            [r.state.terminal for r in reports.values()],
            [r.sled_id for r in reports.values()],
            [r.boot_number for r in reports.values()],
        )
        wrote = {(w["id"], w["sled_id"]) for w in written}
        await _unwritten(conn, [ds for k, ds in sent.items() if k not in wrote])
        telemetry.count("reports.stale", sum(len(ds) - 1 for ds in sent.values() if ds[0].refused is None))
        insts = {
            r["id"]: r for r in await conn.fetch(Q["instances_lock"], [w["instance_id"] for w in written])
        }
        ended = [w for w in written if w["ended"]]  # their sled reservations go with them, exactly once
        await conn.execute(  # sleds after instances: the lock order (docs/architecture.md)
            Q["sleds_unreserve"],
            [w["sled_id"] for w in ended],
            [w["vcpus"] for w in ended],
            [w["ram_bytes"] for w in ended],
        )
        named = Counter(w["instance_id"] for w in written)
        moves = _Moves()
        for vmm in sorted(written, key=lambda w: w["id"]):
            inst = insts[vmm["instance_id"]]
            report = reports[vmm["id"], vmm["sled_id"]]  # its own sled's, as written: never another's
            if named[inst["id"]] > 1 or inst["target_vmm_id"] is not None:
                alone = _Moves()  # after the instance's earlier reports in this batch: read it afresh
                alone.add(await conn.fetchrow(Q["instance_lock"], inst["id"]), vmm, report)
                await alone.apply(app, conn)
            else:
                moves.add(inst, vmm, report)
        await moves.apply(app, conn)
    telemetry.count("reports.applied", len(written))
    if written:
        app.relay.kick()


async def _unwritten(conn: asyncpg.Connection, unwritten: list[list[bus.Delivery]]) -> None:
    """Reports the fence turned down, by VMM and sled: every one about a VMM placed on another sled than
    the one reporting is forbidden (dead-lettered with the reason); the others are stale or unknown. The
    broker has checked that the reporting sled is who it says (its subject: main.consumers' `verify`);
    that it speaks only of its own VMMs is checked here, against the VMM's record."""
    if not unwritten:
        return
    placed = {
        r["id"]: r["sled_id"]
        for r in await conn.fetch(Q["vmms_placed"], list({ds[0].body.vmm_id for ds in unwritten}))
    }
    for ds in unwritten:
        report: VmmReport = ds[0].body
        sled_id = placed.get(report.vmm_id)
        if sled_id is not None and sled_id != report.sled_id:
            telemetry.count("reports.wrong_sled", len(ds))
            for d in ds:
                d.refused = bus.Reject(
                    f"forbidden: {report.sled_id} reports on VMM {report.vmm_id}, which runs on "
                    f"{sled_id}: a sled speaks only for its own VMMs"
                )
        else:
            telemetry.count("reports.unknown" if sled_id is None else "reports.stale")


@dataclass
class _Moves:
    """What a batch of written reports does to their instances, gathered, then done in a few statements:
    instances that start running or stopping, and instances whose active VMM ended. A migration's end is
    done on its own (rare, and it touches two VMMs)."""

    states: dict[uuid.UUID, str] = field(default_factory=dict)
    ended: list[Ended] = field(default_factory=list)
    migrations: list[tuple[asyncpg.Record, bool, str | None]] = field(default_factory=list)

    def add(self, inst: asyncpg.Record, vmm: asyncpg.Record, report: VmmReport) -> None:
        terminal = report.state.terminal
        if inst["target_vmm_id"] == report.vmm_id:
            if report.state is VmmState.running:
                self.migrations.append((inst, True, None))
            elif terminal:
                reason = f"migration target {report.vmm_id} {report.state.value} on {report.sled_id}"
                self.migrations.append((inst, False, reason))
        elif inst["active_vmm_id"] != report.vmm_id:
            telemetry.count("reports.detached")
        elif terminal and inst["target_vmm_id"] is not None and report.migrated_to == inst["target_vmm_id"]:
            self.migrations.append((inst, True, None))  # the source handed over, and ended
        elif report.state is VmmState.running and inst["state"] == "starting":
            self.states[inst["id"]] = "running"
        elif report.state is VmmState.stopping and inst["state"] == "running":
            self.states[inst["id"]] = "stopping"
        elif terminal:
            failed = report.state is not VmmState.stopped
            reason = f"VMM {report.vmm_id} {report.state.value} on {report.sled_id}"
            evidence = Evidence("vmm", vmm["boot_number"], report.boot_number) if failed else None
            self.ended.append(Ended(inst, vmm, reason, evidence))

    async def apply(self, app: App, conn: asyncpg.Connection) -> None:
        for inst, took_over, reason in self.migrations:
            await _migration_end(app, conn, inst, took_over, reason)
        if self.states:
            await conn.execute(Q["instances_set_state"], list(self.states), list(self.states.values()))
            await instances_changed(app, conn, list(self.states))
        await _active_vmms_ended(app, conn, self.ended)


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
    proof_seq: int | None = None
    """For `stuck`: the sequence (within `proof_boot`) of the sled's inventory that did not show it."""


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
            [e.evidence.proof_seq for e in failed if e.evidence],
        )
    rows = await conn.fetch(
        Q["instances_vmm_ended"],
        [e.inst["id"] for e in ended],
        [e.state for e in ended],
        [e.reason if e.state == "failed" else None for e in ended],
    )
    generation = {r["id"]: r["generation"] for r in rows}
    views = await instances_changed(app, conn, [e.inst["id"] for e in ended])
    await charging.release(conn, [(v, generation[v.id]) for v in views])


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
    await instance_changed(app, conn, inst["id"])


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


class _LookAgain(Exception):
    """A VMM was recorded on the sled being expunged between its first look and the sled's lock."""


async def expunge(app: App, conn: asyncpg.Connection, sled_id: str) -> int:
    """Take a sled out of the rack for good; fail every VMM it held. Returns how many.

    Locks in the one lock order (docs/architecture.md): the sled's live VMM records, then their
    instances, then the sled, each in id order, as a report or an order takes them; locking the sled
    first deadlocked with a report ending one of its VMMs. A start records its VMM under a lock on the
    sled that waits for this one (sleds.still_placeable), so a VMM recorded after the first look is
    seen under the sled's lock: then the locks are let go (a savepoint rolled back) and taken again."""
    while True:
        seen = {v["id"] for v in await conn.fetch(Q["vmms_live_on_sled"], sled_id)}
        try:
            async with conn.transaction():  # a savepoint: rolled back, it lets go of what it locked
                vmms = await conn.fetch(Q["vmms_lock"], sorted(seen, key=lambda u: u.int), 0)
                instances = sorted({v["instance_id"] for v in vmms}, key=lambda u: u.int)
                await conn.fetch(Q["instances_lock"], instances)
                sled = await conn.fetchrow(Q["sled_lock"], sled_id)
                if sled is None:
                    raise bus.NotFound(f"no sled {sled_id}")
                vmms = await conn.fetch(Q["vmms_live_on_sled"], sled_id)
                if not {v["id"] for v in vmms} <= seen:
                    raise _LookAgain
                break
        except _LookAgain:
            continue
    await conn.execute(Q["sled_expunge"], sled_id)
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
    await instance_changed(app, conn, instance_id)
    return True
