"""Warm pools: a project keeps a number of VMs of one shape booted and idle, and hands each to exactly one
customer.

- Picking is one statement (pools.sql `pick`): it selects an idle VM with FOR UPDATE SKIP LOCKED, claims
  it, renames it and marks it as holding customer data (`has_customer_data_at`). Concurrent picks never
  wait on each other or lock the pool, and never get the same VM; a marked VM never qualifies again.
- Idle means durable fields only: a pool VM (`pool_id`) whose current VMM runs (`provisioned_at`), that
  holds no customer data and that the pool still means to run (`intended_state`).
- The keeper is a level-triggered loop: each pass brings every pool's own VMs to its target size through
  the ordinary create and start sagas (so placement, reservations, quotas and charges are the usual ones),
  retires the surplus first (a change of intent: a new generation and an event), stops any member meant
  to be stopped that runs, however it came to run, deletes those at rest, and starts any member at rest
  that is meant to run (pool_keeper.py). Refused creates and starts back off, per pool. A VM destroyed
  before it was handed out is marked during destroy; a failed pool VM is restarted by recovery like any
  instance.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
from nats.aio.msg import Msg

from services.instance_manager import limits, paging, replies
from services.instance_manager.app import App
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.views import instance_changed, instance_reply
from shared import bus, telemetry
from shared.config import Settings
from shared.db import enqueue, queries
from shared.messages import (
    InstanceCreate,
    InstanceView,
    PoolChanged,
    PoolCreate,
    PoolDelete,
    PoolList,
    PoolResize,
    PoolShow,
    PoolView,
)
from shared.topology import subjects

if TYPE_CHECKING:  # the keeper imports this module; a pool command only kicks it
    from services.instance_manager.pool_keeper import Keeper

log = logging.getLogger(__name__)
P = queries(Path(__file__).with_name("pools.sql"))


async def view(conn: asyncpg.Connection, pool_id: uuid.UUID) -> PoolView:
    return (await views(conn, [pool_id]))[0]


async def views(conn: asyncpg.Connection, ids: list[uuid.UUID]) -> list[PoolView]:
    """The pools `ids`, in that order, in one query."""
    return [PoolView.model_validate(dict(r)) for r in await conn.fetch(P["pool_view"], ids)]


async def announce(
    app: App,
    conn: asyncpg.Connection,
    pool_id: uuid.UUID,
    change: str,
    picked: InstanceView | None = None,
) -> PoolView:
    """Publish the pool as it now is (after commit), with what changed. A pick's message id names the
    picked VM at its new generation: resent, it is the same message; another pick could never be."""
    v = await view(conn, pool_id)
    key = f"pool:{pool_id}:{change}:" + (f"{picked.id}:{picked.generation}" if picked else f"{v.generation}")
    await enqueue(
        conn,
        subjects.event(v.silo, "pool", "changed"),
        PoolChanged(pool=v, change=change, instance_id=picked.id if picked else None),  # type: ignore[arg-type]
        source=SOURCE,
        key=key,
    )
    app.relay.kick()
    return v


async def pool_id(conn: asyncpg.Connection, silo: str, project: str, name: str) -> uuid.UUID:
    found = await conn.fetchval(P["pool_by_name"], silo, project, name)
    if found is None:
        raise bus.NotFound(f"no pool {silo}/{project}/{name}")
    return found


class Pools:
    """The pool commands, and the pick behind `instance create --from-pool`."""

    def __init__(self, app: App, keeper: Keeper) -> None:
        self.app = app
        self.keeper = keeper

    async def serve(self, admit: Callable[[Msg], bus.CommandError | None] | None = None) -> None:
        """Serve the pool commands, behind `admit` (the tenant command rates: Commands.admit)."""
        handlers: dict[Any, Any] = {
            PoolCreate: self.create,
            PoolShow: self.show,
            PoolList: self.list,
            PoolResize: self.resize,
            PoolDelete: self.delete,
        }
        await bus.serve(self.app.nc, subjects.command_pattern("pool"), handlers, queue=SOURCE, admit=admit)

    async def create(self, body: PoolCreate, msg: Msg) -> dict[str, Any]:
        try:
            return await self._create(body, replies.current())
        except replies.Answered as e:  # a copy of this create, sent again: the first's answer
            return e.reply

    async def _create(self, body: PoolCreate, request: replies.Request) -> dict[str, Any]:
        new_id = uuid.uuid4()
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            project = await conn.fetchrow(Q["project_by_name"], body.silo, body.project)
            if project is None:
                raise bus.NotFound(f"no project {body.silo}/{body.project}")
            await within_limit(conn, body, self.app.settings)
            try:
                async with conn.transaction():
                    shape = (body.vcpus, body.ram_bytes, body.disk_bytes)
                    inserted = await conn.execute(
                        P["pool_insert"], new_id, project["id"], body.name, *shape, body.size
                    )
            except asyncpg.UniqueViolationError:
                raise bus.Conflict(f"pool {body.silo}/{body.project}/{body.name} already exists") from None
            if inserted == "INSERT 0 0":  # the project was deleted meanwhile (pool_insert)
                raise bus.NotFound(f"no project {body.silo}/{body.project}")
            reply = (await announce(self.app, conn, new_id, "created")).model_dump(mode="json")
            await replies.answered(conn, request, reply)
        self.keeper.kick()
        return reply

    async def show(self, body: PoolShow, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            return (await view(conn, await pool_id(conn, body.silo, body.project, body.name))).model_dump(
                mode="json"
            )

    async def list(self, body: PoolList, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            rows = await conn.fetch(
                P["pool_page"], body.silo, body.project, *paging.after(body.after, 3), body.limit
            )
            rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["silo"], r["project"], r["name"]))
            found = await views(conn, [r["id"] for r in rows])
        return paging.reply([v.model_dump(mode="json") for v in found], next_cursor)

    async def resize(self, body: PoolResize, msg: Msg) -> dict[str, Any]:
        """A copy sent again gets the first's answer (replies.claim), never applied anew: it would undo a
        resize another caller made in between."""
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                found = await pool_id(conn, body.silo, body.project, body.name)
                await within_limit(conn, body, self.app.settings)
                await conn.execute(P["pool_resize"], found, body.size)
                reply = (await announce(self.app, conn, found, "resized")).model_dump(mode="json")
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return dict(e.reply)
        self.keeper.kick()
        return reply

    async def delete(self, body: PoolDelete, msg: Msg) -> dict[str, Any]:
        """The pool goes at once; its idle VMs are retired by the keeper (handed-out ones stay). A copy
        of the delete, sent again, gets the first's answer (replies.claim)."""
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                found = await pool_id(conn, body.silo, body.project, body.name)
                await conn.execute(P["pool_delete"], found)
                reply = (await announce(self.app, conn, found, "deleted")).model_dump(mode="json")
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return e.reply
        self.keeper.kick()
        return reply

    async def pick(self, body: InstanceCreate, request: replies.Request = None) -> dict[str, Any] | None:
        """Hand out an idle VM of the pool as the instance `body.name`, or None if the pool has none.
        `request`: the create's, claimed first (replies.claim: a copy of it raises `Answered`), and
        recorded with the pick; an empty pool's transaction rolls back, so its create claims it."""
        assert body.from_pool is not None
        try:
            return await self._pick(body, request)
        except _Empty:
            return None

    async def _pick(self, body: InstanceCreate, request: replies.Request) -> dict[str, Any]:
        assert body.from_pool is not None
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            found = await pool_id(conn, body.silo, body.project, body.from_pool)
            try:
                picked = await conn.fetchval(P["pick"], found, body.name, body.auto_restart.value)
            except asyncpg.UniqueViolationError:
                raise bus.Conflict(
                    f"instance {body.silo}/{body.project}/{body.name} already exists"
                ) from None
            if picked is None:
                telemetry.count("pool.empty")
                raise _Empty
            v = await instance_changed(self.app, conn, picked)
            await announce(self.app, conn, found, "picked", v)
            await replies.answered(conn, request, instance_reply(v))
        telemetry.count("pool.picked")
        self.keeper.kick()
        return instance_reply(v)

    async def shape(self, body: InstanceCreate) -> tuple[int, int, int]:
        assert body.from_pool is not None
        async with self.app.pool.acquire() as conn:
            v = await view(conn, await pool_id(conn, body.silo, body.project, body.from_pool))
        return v.vcpus, v.ram_bytes, v.disk_bytes


class _Empty(Exception):
    """The pool has no idle VM: the pick's transaction rolls back (and its claim of the request)."""


async def within_limit(conn: asyncpg.Connection, body: PoolCreate | PoolResize, rack: Settings) -> None:
    """A pool create or resize is refused if the silo's live pools together would be sized past its limit
    of pool members. The silo's row is locked first, in the command's own transaction, as instance and
    project creates lock it, so that the checks of one silo, on any replica, take turns. `rack`: the
    process's settings, the limits of a silo without its own."""
    silo = await conn.fetchrow(Q["silo_lock_limits"], body.silo)
    others = await conn.fetchval(Q["silo_pool_members_count"], silo["id"], body.project, body.name)
    most = limits.in_force(silo, rack)["pool_members"]
    if others + body.size > most:
        detail = f"its other pools keep {others}, asked {body.size}"
        raise limits.over(body.silo, most, "pool members", detail)
