"""The instance-manager process: commands, sled reports, charge outcomes, sagas, the outbox relay and
the pruner."""

from __future__ import annotations

import logging
import time
from typing import Any

from services.instance_manager import MIGRATIONS, lifecycle, sleds
from services.instance_manager.app import App
from services.instance_manager.base import SOURCE
from services.instance_manager.commands import Commands
from services.instance_manager.pool_keeper import Keeper
from services.instance_manager.pools import Pools
from services.instance_manager.prune import Pruner
from services.instance_manager.sagas.create import CREATE
from services.instance_manager.sagas.migrate import MIGRATE
from services.instance_manager.sagas.start import START
from shared import bus, db, topology
from shared.config import Settings
from shared.messages import ProvisionOutcome, SledInventory, VmmReport
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "instance_manager"


async def build(settings: Settings) -> App:
    pool = await open_database(settings, SCHEMA, MIGRATIONS)
    saga_pool = await db.create_pool(settings.database_url, SCHEMA)
    nc, js = await connect_bus(settings, SOURCE)
    app = App(pool, nc, js, settings.database_url, saga_pool, settings)
    app.sagas.register(CREATE)
    app.sagas.register(START)
    app.sagas.register(MIGRATE)
    return app


def consumers(app: App) -> list[bus.Consumer]:
    """Each consumer applies what one fetch returned in one transaction: inventories
    (sleds.apply_inventories), VMM reports (lifecycle.apply_vmm_reports), charge outcomes
    (Charging.record_outcomes). The inventories' and the reports' consumers say when they have caught up
    (`App.inventories_first`, `App.reports_first`)."""

    common: dict[str, Any] = {
        "service": SOURCE,
        "ack_wait": app.settings.ack_wait,
        "linger": app.settings.batch_linger,
    }
    return [
        bus.Consumer(
            app.js,
            **common,
            **topology.IM_VMM_REPORTS.binding,
            batch_handler=lambda batch: lifecycle.apply_vmm_reports(app, batch),
            expect=VmmReport,
            verify=topology.sled_claim_error,
            caught_up=app.reports_caught_up,
        ),
        bus.Consumer(
            app.js,
            **common,
            **topology.IM_INVENTORY.binding,
            batch_handler=lambda batch: sleds.apply_inventories(app, batch),
            verify=topology.sled_claim_error,
            expect=SledInventory,
            caught_up=app.inventories_caught_up,
        ),
        bus.Consumer(
            app.js,
            **common,
            **topology.IM_OUTCOMES.binding,
            batch_handler=app.charging.record_outcomes,
            expect=ProvisionOutcome,
        ),
    ]


async def main(settings: Settings) -> None:
    app = await build(settings)
    pruner = Pruner(app.pool, settings.database_url, settings.retention, settings.prune_interval)
    keeper = Keeper(app, settings.database_url)
    pools = Pools(app, keeper)
    commands = Commands(app, pools, settings)
    await commands.serve()
    await pools.serve(admit=commands.admit)
    await serve_faults(app.nc, SOURCE)
    await serve_stats(app.nc, SOURCE)
    log.info("instance-manager ready")
    app.listening_since = time.monotonic()  # the consumers start now
    await run_forever(
        app.relay.run(),
        app.charging.hear_outcomes(),
        app.sagas.resume_forever(),
        keeper.run(),
        pruner.run(),
        *(c.run() for c in consumers(app)),
    )
