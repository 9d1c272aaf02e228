"""Warm pools: a project keeps a number of VMs of one shape booted and idle, and hands each to exactly one
customer.

- Picking is one statement (pools.sql `pick`): it selects an idle VM with FOR UPDATE SKIP LOCKED, claims
  it, renames it and marks it as holding customer data (`has_customer_data_at`). Concurrent picks never
  wait on each other or lock the pool, and never get the same VM; a marked VM never qualifies again.
- Idle means durable fields only: a pool VM (`pool_id`) whose current VMM runs (`provisioned_at`), that
  holds no customer data and that the pool still means to run (`intended_state`).
- The keeper is a level-triggered loop: each pass brings every pool's own VMs to its target size through
  the ordinary create and start sagas (so placement, reservations, quotas and charges are the usual ones),
  retires the surplus (stop, then delete), and starts any member at rest. A VM destroyed before it was
  handed out is marked during destroy; a failed pool VM is restarted by recovery like any instance.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.instance_manager import lifecycle, paging
from services.instance_manager.app import SOURCE, App, Q, instance_reply
from services.instance_manager.create_saga import CREATE
from services.instance_manager.start_saga import START, AlreadyRunning
from shared import bus, subjects, telemetry
from shared.db import PassLock, enqueue, queries
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

log = logging.getLogger(__name__)
P = queries(Path(__file__).with_name("pools.sql"))
MAX_STARTS_PER_PASS = 32


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

    async def serve(self) -> None:
        handlers: dict[Any, Any] = {
            PoolCreate: self.create,
            PoolShow: self.show,
            PoolList: self.list,
            PoolResize: self.resize,
            PoolDelete: self.delete,
        }
        await bus.serve(self.app.nc, subjects.command_pattern("pool"), handlers, queue=SOURCE)

    async def create(self, body: PoolCreate, msg: Msg) -> dict[str, Any]:
        new_id = uuid.uuid4()
        async with self.app.pool.acquire() as conn, conn.transaction():
            project = await conn.fetchrow(Q["project_by_name"], body.silo, body.project)
            if project is None:
                raise bus.NotFound(f"no project {body.silo}/{body.project}")
            try:
                async with conn.transaction():
                    shape = (body.vcpus, body.ram_bytes, body.disk_bytes)
                    await conn.execute(P["pool_insert"], new_id, project["id"], body.name, *shape, body.size)
            except asyncpg.UniqueViolationError:
                raise bus.Conflict(f"pool {body.silo}/{body.project}/{body.name} already exists") from None
            v = await announce(self.app, conn, new_id, "created")
        self.keeper.kick()
        return v.model_dump(mode="json")

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
        async with self.app.pool.acquire() as conn, conn.transaction():
            found = await pool_id(conn, body.silo, body.project, body.name)
            await conn.execute(P["pool_resize"], found, body.size)
            v = await announce(self.app, conn, found, "resized")
        self.keeper.kick()
        return v.model_dump(mode="json")

    async def delete(self, body: PoolDelete, msg: Msg) -> dict[str, Any]:
        """The pool goes at once; its idle VMs are retired by the keeper (handed-out ones stay)."""
        async with self.app.pool.acquire() as conn, conn.transaction():
            found = await pool_id(conn, body.silo, body.project, body.name)
            await conn.execute(P["pool_delete"], found)
            v = await announce(self.app, conn, found, "deleted")
        self.keeper.kick()
        return v.model_dump(mode="json")

    async def pick(self, body: InstanceCreate) -> dict[str, Any] | None:
        """Hand out an idle VM of the pool as the instance `body.name`, or None if the pool has none."""
        assert body.from_pool is not None
        async with self.app.pool.acquire() as conn, conn.transaction():
            found = await pool_id(conn, body.silo, body.project, body.from_pool)
            try:
                picked = await conn.fetchval(P["pick"], found, body.name, body.auto_restart.value)
            except asyncpg.UniqueViolationError:
                raise bus.Conflict(
                    f"instance {body.silo}/{body.project}/{body.name} already exists"
                ) from None
            if picked is None:
                telemetry.count("pool.empty")
                return None
            v = await self.app.instance_changed(conn, picked)
            await announce(self.app, conn, found, "picked", v)
        telemetry.count("pool.picked")
        self.keeper.kick()
        return instance_reply(v)

    async def shape(self, body: InstanceCreate) -> tuple[int, int, int]:
        assert body.from_pool is not None
        async with self.app.pool.acquire() as conn:
            v = await view(conn, await pool_id(conn, body.silo, body.project, body.from_pool))
        return v.vcpus, v.ram_bytes, v.disk_bytes


class Keeper:
    """Keeps every pool at its target size; one pass at a time across replicas."""

    def __init__(self, app: App, dsn: str, interval: float = 1.0) -> None:
        self.app = app
        self.interval = interval
        self.lock = PassLock(dsn, "pool-keeper")
        self.wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def kick(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        while True:
            try:
                async with self.lock as mine:
                    if mine:
                        for r in await self.app.pool.fetch(P["pools_to_keep"]):
                            await self.keep(r["id"])
            except Exception as e:
                log.warning("pool keeper pass failed: %s", e)
                telemetry.count("pool.keeper_errors")
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval)
            except TimeoutError:
                pass

    async def keep(self, pool: uuid.UUID) -> None:
        async with self.app.pool.acquire() as conn:
            v = await view(conn, pool)
            members = await conn.fetch(P["members"], pool)
        target = v.target_size if v.state == "active" else 0
        active = [m for m in members if m["intended_state"] == "running"]
        retiring = [m for m in members if m["intended_state"] == "stopped"]
        for m in retiring:
            if m["state"] in ("stopped", "failed"):
                await self._in_tx(lambda conn, m=m: lifecycle.delete(self.app, conn, m["id"]))
        for m in active:
            if m["state"] == "stopped":
                await self._start(m["id"])
        starts = min(target - len(active), MAX_STARTS_PER_PASS)
        for _ in range(starts):
            await self._provision(v)
        surplus = len(active) - target
        for m in [m for m in active if m["state"] in ("running", "stopped")][: max(surplus, 0)]:
            await self._in_tx(lambda conn, m=m: lifecycle.retire(self.app, conn, m["id"]))

    async def _in_tx(self, change: Any) -> None:
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await change(conn)
            self.app.relay.kick()
        except bus.CommandError as e:
            log.info("pool keeper: %s", e.message)

    async def _provision(self, v: PoolView) -> None:
        """A new VM for the pool: the ordinary create saga, then the ordinary start saga."""
        name = f"{v.name}-{secrets.token_hex(3)}"
        instance_id = uuid.uuid4()
        params = {
            "silo": v.silo, "project": v.project, "name": name, "vcpus": v.vcpus, "ram_bytes": v.ram_bytes,
            "disk_bytes": v.disk_bytes, "auto_restart": "best_effort", "instance_id": str(instance_id),
            "project_id": str(v.project_id), "pool_id": str(v.id),
        }  # fmt: skip
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                saga_id = await self.app.sagas.begin(conn, CREATE, params)
        except bus.CommandError as e:
            log.info("pool %s: cannot provision: %s", v.name, e.message)
            return
        telemetry.count("pool.provisioned")
        self._spawn(self._create_then_start(saga_id, instance_id))

    async def _create_then_start(self, saga_id: uuid.UUID, instance_id: uuid.UUID) -> None:
        if await self.app.sagas.launch(saga_id) == "done":
            await self._start(instance_id)

    async def _start(self, instance_id: uuid.UUID) -> None:
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                params = {"instance_id": str(instance_id), "by": "pool"}
                saga_id = await self.app.sagas.begin(conn, START, params)
        except (AlreadyRunning, bus.CommandError):
            return
        self.app.relay.kick()
        self.app.sagas.launch(saga_id)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
