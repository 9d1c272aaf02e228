"""Recovery's orders: restart, settle, and a VMM lost, stuck or a zombie, each applied only if what
recovery saw still holds (services/instance_manager/orders.py), else answered stale."""

from __future__ import annotations

import uuid
from typing import Any

from nats.aio.msg import Msg

from services.instance_manager import lifecycle, orders
from services.instance_manager.app import App
from services.instance_manager.sagas import pace as pacing
from services.instance_manager.sagas.start import START, AlreadyRunning, StartParams
from shared import bus
from shared.db import GroupCommit
from shared.messages import (
    InstanceRestart,
    InstanceSettle,
    VmmLost,
    VmmLostV2,
    VmmStuck,
    VmmZombie,
)

LOST_ORDERS_TOGETHER = 64
"""Most lost orders applied in one transaction (each names up to LOST_BATCH VMMs of one sled)."""


class OrderCommands:
    """The handlers of recovery's orders (`rp.cmd._fleet.vmm.*`, `instance.restart`, `instance.settle`)."""

    app: App
    restarting: int
    lost_orders: GroupCommit[VmmLostV2, dict[uuid.UUID, str]]
    """Lost orders come one a sled: after a rack's power loss, thousands at once."""

    async def instance_restart(self, body: InstanceRestart, msg: Msg) -> dict[str, Any]:
        """Begin a start saga that runs in the background; refused `busy` at once, having done nothing,
        while this replica holds more such sagas than it finishes in RACKPLANE_SAGA_BACKLOG seconds
        (recovery waits the time it is told and orders it again)."""
        if busy := self.app.sagas.busy(self.restarting, waited_for=False):
            raise pacing.refusal(*busy)
        params = StartParams(instance_id=body.instance_id, expected_generation=body.generation)
        self.restarting += 1  # counted in hand from here: orders that come meanwhile see it
        try:
            async with self.app.pool.acquire() as conn:
                try:
                    async with conn.transaction():
                        saga_id = await self.app.sagas.begin(conn, START, params)
                except AlreadyRunning:
                    raise orders.Stale("restart", "instance is already running") from None
            self.app.sagas.launch(saga_id)
        finally:
            self.restarting -= 1
        self.app.relay.kick()
        return {"saga_id": str(saga_id)}

    async def instance_settle(self, body: InstanceSettle, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn, conn.transaction():
            if not await lifecycle.settle(self.app, conn, body.instance_id, body.generation):
                raise orders.Stale("settle", f"instance is not failed at generation {body.generation}")
        self.app.relay.kick()
        return {"settled": True}

    async def vmm_lost(self, body: VmmLostV2, msg: Msg) -> dict[str, Any]:
        """Every VMM of the order, in one transaction (shared with the orders that came meanwhile):
        `{results: {vmm_id: result}}`, where a result that starts with `stale: ` says why that VMM was left
        alone. It waits for the inventories first (App.inventories_first), on its own clock: the orders
        then go together."""
        await self.app.inventories_first()
        results = await self.lost_orders(body)
        return {"results": {str(k): v for k, v in results.items()}}

    async def vmm_lost_one(self, body: VmmLost, msg: Msg) -> dict[str, Any]:
        """v1: one VMM, answered as before (`{result}`, or the error `stale`)."""
        await self.app.inventories_first()
        result = (await self.lost_orders(VmmLostV2.of(body)))[body.vmm_id]
        if result.startswith("stale: "):
            raise bus.CommandError("stale", result.removeprefix("stale: "))
        return {"result": result}

    async def _apply_lost(self, batch: list[VmmLostV2]) -> list[dict[uuid.UUID, str]]:
        async with self.app.pool.acquire() as conn, conn.transaction():
            results = await orders.lost(self.app, conn, batch)
        self.app.relay.kick()
        return results

    async def vmm_stuck(self, body: VmmStuck, msg: Msg) -> dict[str, Any]:
        await self.app.reports_first()  # judged on the sleds' latest word, not on a backlog of it
        async with self.app.pool.acquire() as conn, conn.transaction():
            result = await orders.stuck(self.app, conn, body)
        self.app.relay.kick()
        return {"result": result}

    async def vmm_zombie(self, body: VmmZombie, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn, conn.transaction():
            result = await orders.zombie(self.app, conn, body)
        self.app.relay.kick()
        return {"result": result}
