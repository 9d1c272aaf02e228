"""Sleds as instance-manager knows them: registered and updated from their inventories."""

from __future__ import annotations

import asyncpg

from services.instance_manager.app import SOURCE, App, Q
from shared import subjects
from shared.db import enqueue
from shared.messages import SledChanged, SledInventory, SledView


async def apply_inventory(app: App, inv: SledInventory) -> None:
    """Record the sled's capacity and boot id; announce a new sled or a new boot id as an event."""
    async with app.pool.acquire() as conn, conn.transaction():
        before = await conn.fetchrow(Q["sled_lock"], inv.sled_id)
        await conn.execute(Q["sled_upsert"], inv.sled_id, inv.boot_id, inv.vcpus, inv.ram_bytes)
        if before is None or before["boot_id"] != inv.boot_id:
            await announce(app, conn, inv.sled_id, f"boot:{inv.boot_id}")


async def announce(app: App, conn: asyncpg.Connection, sled_id: str, change: str) -> SledView:
    """Publish the sled as it now is (after commit); `change` names the change, for the message id."""
    sled = SledView.model_validate(dict(await conn.fetchrow(Q["sled_list"], sled_id)))
    await enqueue(
        conn,
        subjects.event(None, "sled", "changed"),
        SledChanged(sled=sled),
        source=SOURCE,
        key=f"sled:{sled_id}:{change}",
    )
    app.relay.kick()
    return sled
