"""The recovery process: it builds its own picture of the rack from instance and sled events and sled
inventories, and runs the reconcilers of reconcile.py over it, every interval and at once when a sled
comes back with a new boot id."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from services.recovery import MIGRATIONS
from services.recovery.reconcile import SOURCE, Q, Reconciler
from shared import bus, telemetry, topology
from shared.config import Settings
from shared.messages import InstanceChanged, InstanceChangedV2, InstanceView, SledChanged, SledInventory
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "recovery"


async def main(settings: Settings) -> None:
    pool = await open_database(settings, SCHEMA, MIGRATIONS)
    nc, js = await connect_bus(settings, SOURCE)
    reconciler = Reconciler(
        pool,
        nc,
        settings.database_url,
        interval=settings.reconcile_interval,
        zombie_grace=settings.zombie_grace,
        transition_timeout=settings.transition_timeout,
        unknown_after=settings.unknown_after(),
    )

    async def on_instances(batch: list[bus.Delivery]) -> None:
        """A batch of instance events, both versions (while producers send both, the second copy of a
        change is at the generation already held), in one statement: of one instance's, the newest."""
        newest: dict[uuid.UUID, InstanceView] = {}
        for d in batch:
            i = d.body.instance
            if i.id not in newest or newest[i.id].generation < i.generation:
                newest[i.id] = i
        rows = [_instance_row(i) for i in sorted(newest.values(), key=lambda i: i.id.int)]
        await pool.execute(Q["instances_apply"], *(list(column) for column in zip(*rows, strict=True)))
        if any(i.state == "failed" for i in newest.values()):
            reconciler.wake_restarts.set()

    async def on_inventories(batch: list[bus.Delivery]) -> None:
        """A batch of inventories, in one transaction of two statements; of one sled's, the newest counts.
        Fenced by (boot number, sequence): an inventory from before a reboot, redelivered after it,
        changes nothing. A reboot is known from a later boot number, and reconciled at once. When the
        sled made it (its envelope's time) is kept with its VMMs: the evidence stuck orders need."""
        invs = SledInventory.newest([d.body for d in batch])
        made = {(d.body.sled_id, d.body.boot_number, d.body.seq): d.env.time for d in batch}
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
                [made[i.sled_id, i.boot_number, i.seq] for i in invs],
            )
        telemetry.count("inventories.applied", len(applied))
        telemetry.count("inventories.stale", len(batch) - len(applied))
        rebooted = [r["id"] for r in applied if r["id"] in before and before[r["id"]] < r["boot_number"]]
        if rebooted:
            log.info("sleds came back on a new boot: %s: reconciling now", ", ".join(rebooted[:10]))
            reconciler.wake.set()

    async def on_sleds(batch: list[bus.Delivery]) -> None:
        """A batch of sled events, in one statement: of one sled's, the latest."""
        latest = {d.body.sled.id: d.body.sled for d in batch if d.body.sled.boot_number is not None}
        sleds = [latest[k] for k in sorted(latest)]
        await pool.execute(
            Q["sleds_state"],
            [s.id for s in sleds], [s.boot_id for s in sleds], [s.boot_number for s in sleds],
            [s.state for s in sleds],
        )  # fmt: skip

    async def stats() -> dict[str, Any]:
        return {"failed": await pool.fetchval("SELECT count(*) FROM instances WHERE state = 'failed'")}

    await serve_faults(nc, SOURCE)
    await serve_stats(nc, SOURCE, stats)
    common: dict[str, Any] = {
        "service": SOURCE,
        "verify": None,
        "ack_wait": settings.ack_wait,
        "linger": settings.batch_linger,
    }
    log.info("recovery ready")
    await run_forever(
        reconciler.run(),
        bus.Consumer(
            js, **common, **topology.RECOVERY_INSTANCES.binding, batch_handler=on_instances,
            expect=InstanceChanged,
        ).run(),
        bus.Consumer(
            js, **common, **topology.RECOVERY_INSTANCES_V2.binding, batch_handler=on_instances,
            expect=InstanceChangedV2,
        ).run(),
        bus.Consumer(
            js, **{**common, "verify": topology.sled_claim_error}, **topology.RECOVERY_INVENTORY.binding,
            batch_handler=on_inventories, expect=SledInventory,
        ).run(),
        bus.Consumer(
            js, **common, **topology.RECOVERY_SLEDS.binding, batch_handler=on_sleds, expect=SledChanged,
        ).run(),
    )  # fmt: skip


def _instance_row(i: InstanceView) -> tuple[Any, ...]:
    """An instance event's columns, in the order of `instances_apply`."""
    return (
        i.id, i.silo, i.project, i.name, i.state.value, i.generation, i.auto_restart.value,
        i.intended_state, i.active_vmm_id, i.sled_id, i.vmm_boot_id, i.failed_at, i.last_auto_restart_at,
        i.updated_at, i.target_vmm_id, i.target_sled_id, i.target_vmm_boot_id, i.vmm_boot_number,
        i.target_vmm_boot_number, i.next_restart_at,
    )  # fmt: skip
