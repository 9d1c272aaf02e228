"""The instance-manager process: commands, sled reports, charge outcomes, sagas, the outbox relay and
the pruner."""

from __future__ import annotations

import logging
import time
from typing import Any

from services.instance_manager import lifecycle, sleds
from services.instance_manager.app import SOURCE, App
from services.instance_manager.commands import Commands
from services.instance_manager.create_saga import CREATE
from services.instance_manager.migrate_saga import MIGRATE
from services.instance_manager.pools import Keeper, Pools
from services.instance_manager.prune import Pruner
from services.instance_manager.start_saga import START
from shared import bus, db, subjects
from shared.config import Settings
from shared.messages import ProvisionOutcome, SledInventory, VmmReport
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "instance_manager"


async def build(settings: Settings) -> App:
    pool = await open_database(settings, SCHEMA)
    saga_pool = await db.create_pool(settings.database_url, SCHEMA)
    nc, js = await connect_bus(settings, SOURCE)
    app = App(pool, nc, js, settings.database_url, saga_pool)
    app.sagas.register(CREATE)
    app.sagas.register(START)
    app.sagas.register(MIGRATE)
    return app


def consumers(app: App) -> list[bus.Consumer]:
    """Each consumer applies what one fetch returned in one transaction: inventories
    (sleds.apply_inventories), VMM reports (lifecycle.apply_vmm_reports), charge outcomes
    (App.record_outcomes). The inventories' and the reports' consumers say when they have caught up
    (`App.inventories_first`, `App.reports_first`)."""

    common: dict[str, Any] = {"service": SOURCE}
    return [
        bus.BatchConsumer(
            app.js,
            **common,
            stream=subjects.SLED_REPORT_STREAM,
            durable="instance-manager-vmm-reports",
            filter_subject=subjects.sled_report("*", "vmm"),
            batch_handler=lambda batch: lifecycle.apply_vmm_reports(app, batch),
            expect=VmmReport,
            verify=subjects.sled_claim_error,
            caught_up=app.reports_caught_up,
        ),
        bus.BatchConsumer(
            app.js,
            **common,
            stream=subjects.SLED_REPORT_STREAM,
            durable="instance-manager-inventory",
            filter_subject=subjects.sled_report("*", "inventory"),
            batch_handler=lambda batch: sleds.apply_inventories(app, batch),
            verify=subjects.sled_claim_error,
            expect=SledInventory,
            caught_up=app.inventories_caught_up,
        ),
        bus.BatchConsumer(
            app.js,
            **common,
            stream=subjects.EVENTS_STREAM,
            durable="instance-manager-outcomes",
            filter_subject=subjects.event("*", "provision", "outcome"),
            batch_handler=app.record_outcomes,
            expect=ProvisionOutcome,
        ),
    ]


async def main(settings: Settings) -> None:
    app = await build(settings)
    pruner = Pruner(app.pool, settings.database_url, settings.retention, settings.prune_interval)
    keeper = Keeper(app, settings.database_url)
    pools = Pools(app, keeper)
    commands = Commands(app, pools)
    await commands.serve()
    await pools.serve(admit=commands.admit)
    await serve_faults(app.nc, SOURCE)
    await serve_stats(app.nc, SOURCE)
    log.info("instance-manager ready")
    app.listening_since = time.monotonic()  # the consumers start now
    await run_forever(
        app.relay.run(),
        app.hear_outcomes(),
        app.sagas.resume_forever(),
        keeper.run(),
        pruner.run(),
        *(c.run() for c in consumers(app)),
    )
