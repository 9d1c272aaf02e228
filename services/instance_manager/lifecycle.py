"""Instance changes that are single transactions: stop, delete, and what a sled's VMM report means for
the instance."""

from __future__ import annotations

import logging
import uuid

import asyncpg

from services.instance_manager.app import SOURCE, App, Q
from shared import bus, subjects, telemetry
from shared.db import enqueue
from shared.messages import InstanceView, VmmReport, VmmState, VmmStop

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


async def delete(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    inst = await conn.fetchrow(Q["instance_lock"], instance_id)
    if inst["state"] not in ("stopped", "failed") or inst["active_vmm_id"] is not None:
        raise bus.Conflict(f"instance is {inst['state']}; only a stopped or failed instance can be deleted")
    gen = await conn.fetchval(Q["instance_set_state"], instance_id, "destroyed", None)
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
            Q["vmm_apply_report"], report.vmm_id, report.state.value, report.generation, terminal
        )
        if vmm is None:
            known = await conn.fetchval(Q["vmm_exists"], report.vmm_id)
            result = "stale" if known else "unknown"
            telemetry.count(f"reports.{result}")
            return result
        if terminal:  # this report ended the VMM record: its sled reservation goes with it, exactly once
            await conn.execute(Q["unreserve"], vmm["sled_id"], vmm["vcpus"], vmm["ram_bytes"])
        inst = await conn.fetchrow(Q["instance_lock"], vmm["instance_id"])
        if inst["active_vmm_id"] != report.vmm_id:
            telemetry.count("reports.detached")
            return "detached"
        if report.state is VmmState.running and inst["state"] == "starting":
            await conn.execute(Q["instance_set_state"], inst["id"], "running", None)
            await app.instance_changed(conn, inst["id"])
        elif report.state is VmmState.stopping and inst["state"] == "running":
            await conn.execute(Q["instance_set_state"], inst["id"], "stopping", None)
            await app.instance_changed(conn, inst["id"])
        elif terminal:
            new_state = "failed" if report.state is VmmState.failed else "stopped"
            reason = (
                f"VMM {report.vmm_id} {report.state.value} on {report.sled_id}"
                if new_state == "failed"
                else None
            )
            gen = await conn.fetchval(Q["instance_vmm_ended"], inst["id"], new_state, reason)
            await app.release_charge(conn, inst["id"], gen)
            await app.instance_changed(conn, inst["id"])
        telemetry.count("reports.applied")
        return "applied"
