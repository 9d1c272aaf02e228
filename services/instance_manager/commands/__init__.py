"""Operator commands served by the instance-manager (request/reply on rp.cmd.<silo>.<resource>.<verb>),
one module per resource: `tenants` (silos, projects and their limits), `instances`, `orders` (recovery's
orders) and `sleds`. `Commands` puts their handlers on the bus."""

from __future__ import annotations

import asyncio

from services.instance_manager import limits
from services.instance_manager.app import App
from services.instance_manager.base import SOURCE
from services.instance_manager.commands.instances import (
    BEGINS_AT_ONCE,
    SAGA_POLL,
    SAGA_REPLY_WAIT,
    InstanceCommands,
)
from services.instance_manager.commands.orders import (
    LOST_ORDERS_TOGETHER,
    OrderCommands,
)
from services.instance_manager.commands.sleds import SledCommands
from services.instance_manager.commands.tenants import NAMES_SHOWN, TenantCommands
from services.instance_manager.pools import Pools
from shared import bus
from shared.config import Settings
from shared.db import GroupCommit
from shared.messages import (
    InstanceCreate,
    InstanceDelete,
    InstanceList,
    InstanceMigrate,
    InstanceRestart,
    InstanceSettle,
    InstanceShow,
    InstanceStart,
    InstanceStop,
    ProjectCreate,
    ProjectDelete,
    ProjectList,
    SiloCreate,
    SiloDelete,
    SiloLimitsSet,
    SiloList,
    SiloShow,
    SledExpunge,
    SledList,
    VmmLost,
    VmmLostV2,
    VmmStuck,
    VmmZombie,
)
from shared.topology import subjects

__all__ = [
    "BEGINS_AT_ONCE",
    "LOST_ORDERS_TOGETHER",
    "NAMES_SHOWN",
    "SAGA_POLL",
    "SAGA_REPLY_WAIT",
    "Commands",
]


class Commands(TenantCommands, InstanceCommands, OrderCommands, SledCommands):
    """Every command handler, one resource a base class; the rate limits come from `settings`."""

    def __init__(self, app: App, pools: Pools, settings: Settings) -> None:
        self.app = app
        self.pools = pools
        self.lost_orders = GroupCommit(self._apply_lost, most=LOST_ORDERS_TOGETHER)
        """Lost orders come one a sled: after a rack's power loss, thousands at once."""
        self.limiter = limits.Limiter(
            settings.identity_command_rate, settings.silo_command_rate, settings.command_burst
        )
        self._rates_task: asyncio.Task[None] | None = None
        self.starting = 0
        self.restarting = 0
        """Restart orders being begun: counted in hand with the sagas nobody waits for."""
        self._begins = asyncio.Semaphore(BEGINS_AT_ONCE)
        """Creates, starts and migrations not yet launched (waiting for a connection, or in `begin`):
        in hand as much as the sagas being driven, and counted with them by the backpressure."""

    async def serve(self) -> None:
        """Answer every resource's commands (one queue group across replicas), each through the rate
        limits but recovery's lost, stuck and zombie orders."""
        await self._read_rates()
        self._rates_task = asyncio.create_task(self._refresh_rates())
        limited = {
            "silo": {
                SiloCreate: self.silo_create,
                SiloList: self.silo_list,
                SiloShow: self.silo_show,
                SiloLimitsSet: self.silo_limits_set,
                SiloDelete: self.silo_delete,
            },
            "project": {
                ProjectCreate: self.project_create,
                ProjectList: self.project_list,
                ProjectDelete: self.project_delete,
            },
            "instance": {
                InstanceCreate: self.instance_create,
                InstanceStart: self.instance_start,
                InstanceStop: self.instance_stop,
                InstanceMigrate: self.instance_migrate,
                InstanceDelete: self.instance_delete,
                InstanceShow: self.instance_show,
                InstanceList: self.instance_list,
                InstanceRestart: self.instance_restart,  # recovery's orders: never limited (limits.exempt)
                InstanceSettle: self.instance_settle,
            },
            "sled": {SledList: self.sled_list, SledExpunge: self.sled_expunge},
        }
        for resource, handlers in limited.items():
            await bus.serve(
                self.app.nc, subjects.command_pattern(resource), handlers, queue=SOURCE, admit=self.admit
            )
        orders = {
            VmmLost: self.vmm_lost_one,
            VmmLostV2: self.vmm_lost,
            VmmStuck: self.vmm_stuck,
            VmmZombie: self.vmm_zombie,
        }
        await bus.serve(self.app.nc, subjects.command_pattern("vmm"), orders, queue=SOURCE)
