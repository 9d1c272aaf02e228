"""The recovery process. It builds its picture of the rack from instance events and sled inventories,
and runs a level-triggered pass that compares what should run on each sled with what does.

This first version observes: each pass counts the instances that the control plane expects on a sled
but that the sled's latest inventory does not list, and answers them on its stats subject.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from shared import bus, db, subjects, telemetry
from shared.config import Settings, env_float
from shared.messages import Envelope, InstanceChanged, SledInventory
from shared.service import run_forever, serve_stats

log = logging.getLogger(__name__)
SOURCE = "recovery"
SCHEMA = "recovery"
Q = db.queries(Path(__file__).parent / "queries.sql")


async def reconcile_pass(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch(Q["discrepancies"])
    telemetry.COUNTERS["reconcile.missing_vmms"] = len(rows)
    telemetry.count("reconcile.passes")
    return [{k: str(v) for k, v in dict(r).items()} for r in rows]


async def reconcile_forever(pool: asyncpg.Pool, interval: float) -> None:
    while True:
        try:
            await reconcile_pass(pool)
        except Exception as e:
            log.warning("reconcile pass failed: %s", e)
        await asyncio.sleep(interval)


async def main(settings: Settings) -> None:
    pool = await db.create_pool(settings.database_url, SCHEMA)
    await db.migrate(pool, SCHEMA, Path(__file__).parent / "migrations")
    nc = await bus.connect(settings.nats_url, SOURCE)
    js = nc.jetstream()
    await bus.ensure_streams(js)

    async def on_instance(env: Envelope, e: InstanceChanged, msg: Msg) -> None:
        i = e.instance
        await pool.execute(
            Q["instance_upsert"],
            i.id,
            i.silo,
            i.project,
            i.name,
            i.state.value,
            i.generation,
            i.auto_restart.value,
            i.active_vmm_id,
            i.sled_id,
        )

    async def on_inventory(env: Envelope, inv: SledInventory, msg: Msg) -> None:
        await pool.execute(
            Q["sled_upsert"], inv.sled_id, inv.boot_id, [v.model_dump(mode="json") for v in inv.vmms]
        )

    async def discrepancies() -> dict[str, Any]:
        return {"missing": await reconcile_pass(pool)}

    await serve_stats(nc, SOURCE, discrepancies)
    common: dict[str, Any] = {"service": SOURCE}
    log.info("recovery ready")
    await run_forever(
        reconcile_forever(pool, env_float("RACKPLANE_RECONCILE_INTERVAL", 10.0)),
        bus.Consumer(
            js,
            **common,
            stream=subjects.EVENTS_STREAM,
            durable="recovery-instances",
            filter_subject=subjects.event("*", "instance", "changed"),
            handler=on_instance,
            expect=InstanceChanged,
        ).run(),
        bus.Consumer(
            js,
            **common,
            stream=subjects.SLED_REPORT_STREAM,
            durable="recovery-inventory",
            filter_subject=subjects.sled_report("*", "inventory"),
            handler=on_inventory,
            verify=subjects.sled_claim_error,
            expect=SledInventory,
        ).run(),
    )
