"""The recovery process: it builds its own picture of the rack from instance and sled events and sled
inventories, and runs the reconcilers of reconcile.py over it, every interval and at once when a sled
comes back with a new boot id."""

from __future__ import annotations

import json
import logging
from typing import Any

from nats.aio.msg import Msg

from services.recovery.reconcile import SOURCE, Q, Reconciler
from shared import bus, subjects, telemetry
from shared.config import Settings
from shared.messages import Envelope, InstanceChanged, InstanceChangedV2, SledChanged, SledInventory
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "recovery"


async def main(settings: Settings) -> None:
    pool = await open_database(settings, SCHEMA)
    nc, js = await connect_bus(settings, SOURCE)
    reconciler = Reconciler(pool, nc, settings.database_url)

    async def on_instance(env: Envelope, e: InstanceChanged | InstanceChangedV2, msg: Msg) -> None:
        """Both versions of the event, one handler: while producers send both, the second copy of a change
        is at the generation already held, and the fence makes it a no-op."""
        i = e.instance
        await pool.execute(
            Q["instance_upsert"], i.id, i.silo, i.project, i.name, i.state.value, i.generation,
            i.auto_restart.value, i.intended_state, i.active_vmm_id, i.sled_id, i.vmm_boot_id,
            i.failed_at, i.last_auto_restart_at, i.updated_at, i.target_vmm_id, i.target_sled_id,
            i.target_vmm_boot_id, i.vmm_boot_number, i.target_vmm_boot_number, i.next_restart_at,
        )  # fmt: skip
        if i.state == "failed":
            reconciler.wake_restarts.set()

    async def on_inventories(batch: list[bus.Delivery]) -> None:
        """A batch of inventories, in one transaction of two statements; of one sled's, the newest counts.
        Fenced by (boot number, sequence): an inventory from before a reboot, redelivered after it,
        changes nothing. A reboot is known from a later boot number, and reconciled at once."""
        invs = SledInventory.newest([d.body for d in batch])
        async with pool.acquire() as conn, conn.transaction():
            held = await conn.fetch(Q["sleds_lock"], [i.sled_id for i in invs])
            before = {r["id"]: r["boot_number"] for r in held}
            applied = await conn.fetch(
                Q["sleds_apply_inventories"],
                [i.sled_id for i in invs],
                [i.boot_id for i in invs],
                [i.boot_number for i in invs],
                [i.seq for i in invs],
                [json.dumps([v.model_dump(mode="json") for v in i.vmms]) for i in invs],
            )
        telemetry.count("inventories.applied", len(applied))
        telemetry.count("inventories.stale", len(batch) - len(applied))
        rebooted = [r["id"] for r in applied if r["id"] in before and before[r["id"]] < r["boot_number"]]
        if rebooted:
            log.info("sleds came back on a new boot: %s: reconciling now", ", ".join(rebooted[:10]))
            reconciler.wake.set()

    async def on_sled(env: Envelope, e: SledChanged, msg: Msg) -> None:
        if e.sled.boot_number is not None:
            await pool.execute(Q["sled_state"], e.sled.id, e.sled.boot_id, e.sled.boot_number, e.sled.state)

    async def stats() -> dict[str, Any]:
        return {"failed": await pool.fetchval("SELECT count(*) FROM instances WHERE state = 'failed'")}

    await serve_faults(nc, SOURCE)
    await serve_stats(nc, SOURCE, stats)
    common: dict[str, Any] = {"service": SOURCE, "verify": None}
    log.info("recovery ready")
    await run_forever(
        reconciler.run(),
        bus.Consumer(
            js, **common, stream=subjects.EVENTS_STREAM, durable="recovery-instances",
            filter_subject=subjects.event("*", "instance", "changed"), handler=on_instance,
            expect=InstanceChanged,
        ).run(),
        bus.Consumer(
            js, **common, stream=subjects.EVENTS_STREAM, durable="recovery-instances-v2",
            filter_subject=subjects.event("*", "instance", "changed", version=2), handler=on_instance,
            expect=InstanceChangedV2,
        ).run(),
        bus.BatchConsumer(
            js, **{**common, "verify": subjects.sled_claim_error}, stream=subjects.SLED_REPORT_STREAM,
            durable="recovery-inventory", filter_subject=subjects.sled_report("*", "inventory"),
            batch_handler=on_inventories, expect=SledInventory,
        ).run(),
        bus.Consumer(
            js, **common, stream=subjects.EVENTS_STREAM, durable="recovery-sleds",
            filter_subject=subjects.event(None, "sled", "changed"), handler=on_sled, expect=SledChanged,
        ).run(),
    )  # fmt: skip
