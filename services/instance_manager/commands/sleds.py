"""Sleds: list them, and expunge one (its VMMs failed, the sled announced as gone for good)."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from services.instance_manager import lifecycle, paging, replies, sleds
from services.instance_manager.app import App
from services.instance_manager.base import Q
from shared.messages import SledExpunge, SledList


class SledCommands:
    """The handlers of `rp.cmd._fleet.sled.*`."""

    app: App

    async def sled_expunge(self, body: SledExpunge, msg: Msg) -> dict[str, Any]:
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                failed = await lifecycle.expunge(self.app, conn, body.sled_id)
                (sled,) = await sleds.announce(self.app, conn, {body.sled_id: "expunged"})
                reply = {**sled.model_dump(mode="json"), "vmms_failed": failed}
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return e.reply
        return reply

    async def sled_list(self, body: SledList, msg: Msg) -> dict[str, Any]:
        rows = await self.app.pool.fetch(Q["sled_page"], *paging.after(body.after, 1), body.limit)
        rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["id"],))
        items = [{**dict(r), "boot_id": str(r["boot_id"]) if r["boot_id"] else None} for r in rows]
        return paging.reply(items, next_cursor)
