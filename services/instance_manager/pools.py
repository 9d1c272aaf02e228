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
  that is meant to run. Refused creates and starts back off, per pool (Keeper). A VM destroyed before it
  was handed out is marked during destroy; a failed pool VM is restarted by recovery like any instance.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.instance_manager import lifecycle, limits, paging, replies
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
BACKOFF_FIRST = 1.0
"""Seconds a pool's keeper waits after a refused create or start before it tries again."""
BACKOFF_MAX = 60.0
"""The longest such wait: it doubles with each refusal in a row, up to this."""


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
            await within_limit(conn, body)
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
                await within_limit(conn, body)
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
            v = await self.app.instance_changed(conn, picked)
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


@dataclass
class Backoff:
    """A pool whose creates or starts were refused (quota, room): how long its keeper waits before the
    next try, and since when."""

    wait: float = 0.0
    until: float = 0.0
    """Monotonic time before which the pool gets no create or start."""
    refused_at: float = 0.0
    """When the last refusal was heard: a success of a try begun before it resets nothing."""


async def within_limit(conn: asyncpg.Connection, body: PoolCreate | PoolResize) -> None:
    """A pool create or resize is refused if the silo's live pools together would be sized past its limit
    of pool members. The silo's row is locked first, in the command's own transaction, as instance and
    project creates lock it, so that the checks of one silo, on any replica, take turns."""
    silo = await conn.fetchrow(Q["silo_lock_limits"], body.silo)
    others = await conn.fetchval(Q["silo_pool_members_count"], silo["id"], body.project, body.name)
    most = limits.in_force(silo)["pool_members"]
    if others + body.size > most:
        detail = f"its other pools keep {others}, asked {body.size}"
        raise limits.over(body.silo, most, "pool members", detail)


class Keeper:
    """Keeps every pool at its target size; one pass at a time across replicas.

    Refusals back off, per pool and in this process's memory (a replica that takes the pass over starts
    afresh, with at most one wave of tries): after a refused create or start, the pool gets no other until
    BACKOFF_FIRST seconds have passed, then one try at a time, the wait doubling with each refusal up to
    BACKOFF_MAX; a try that succeeds resets it. A pool that does not fit its quota so costs a handful of
    destroyed instances, outcomes and ledger rows a minute, not dozens a second."""

    def __init__(self, app: App, dsn: str, interval: float = 1.0) -> None:
        self.app = app
        self.interval = interval
        self.lock = PassLock(dsn, "pool-keeper")
        self.wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.backoff: dict[uuid.UUID, Backoff] = {}

    def kick(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        while True:
            try:
                async with self.lock as mine:
                    if mine:
                        kept = [r["id"] for r in await self.app.pool.fetch(P["pools_to_keep"])]
                        for gone in self.backoff.keys() - set(kept):
                            del self.backoff[gone]
                        for pool in kept:
                            await self.keep(pool)
            except Exception as e:
                log.warning("pool keeper pass failed: %s", e)
                telemetry.count("pool.keeper_errors")
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval)
            except TimeoutError:
                pass

    async def keep(self, pool: uuid.UUID) -> None:
        """One pass over one pool, level-triggered: what its members are meant to be (intended_state)
        against what they are. The surplus is retired first, so that no member is started and retired
        in the same pass; a member meant to be stopped is stopped if it runs (however it came to run) and
        deleted once at rest; members meant to run are started, and new ones made, as backoff allows."""
        async with self.app.pool.acquire() as conn:
            v = await view(conn, pool)
            members = await conn.fetch(P["members"], pool)
        target = v.target_size if v.state == "active" else 0
        active = [m for m in members if m["intended_state"] == "running"]
        retiring = [m for m in members if m["intended_state"] == "stopped"]
        surplus = [m for m in active if m["state"] in ("running", "stopped")][: max(len(active) - target, 0)]
        for m in surplus:  # stopped ones first (members' order): they cost nothing to retire
            await self._in_tx(lambda conn, m=m: lifecycle.retire(self.app, conn, m["id"]))
        for m in retiring:
            if m["state"] in ("stopped", "failed"):
                await self._in_tx(lambda conn, m=m: lifecycle.delete(self.app, conn, m["id"]))
            elif m["state"] == "running":
                await self._in_tx(lambda conn, m=m: lifecycle.retire(self.app, conn, m["id"]))
        retired = {m["id"] for m in surplus}
        to_start = [m["id"] for m in active if m["state"] == "stopped" and m["id"] not in retired]
        to_make = max(target - len(active), 0)
        if not (to_start or to_make):
            return
        tries = self._tries(pool)
        for instance_id in to_start[:tries]:
            await self._start(pool, instance_id)
        for _ in range(min(to_make, tries - len(to_start[:tries]))):
            await self._provision(pool, v)

    def _tries(self, pool: uuid.UUID) -> int:
        """How many creates and starts the pool may begin in this pass: none while it waits, one while
        it backs off (the wait begins again now, as if that one were refused too), else up to
        MAX_STARTS_PER_PASS."""
        b = self.backoff.get(pool)
        if b is None:
            return MAX_STARTS_PER_PASS
        now = time.monotonic()
        if now < b.until:
            telemetry.count("pool.backing_off")
            return 0
        b.until = now + b.wait
        return 1

    def _heard(self, pool: uuid.UUID, began: float, status: str) -> None:
        """A create or start the keeper began has ended. A refusal doubles the pool's wait (from
        BACKOFF_FIRST, up to BACKOFF_MAX), once per wave: a try begun before the last refusal was heard
        adds nothing to it. A success of a try begun after the last refusal resets it."""
        now = time.monotonic()
        b = self.backoff.get(pool)
        if status == "failed":
            if b is not None and began < b.refused_at:
                return
            b = self.backoff.setdefault(pool, Backoff())
            b.wait = min(max(b.wait * 2, BACKOFF_FIRST), BACKOFF_MAX)
            b.until, b.refused_at = now + b.wait, now
            telemetry.count("pool.refused")
            log.info("pool %s: a create or start was refused: next try in %gs", pool, b.wait)
        elif status == "done" and b is not None and began >= b.refused_at:
            del self.backoff[pool]

    async def _in_tx(self, change: Any) -> None:
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await change(conn)
            self.app.relay.kick()
        except bus.CommandError as e:
            log.info("pool keeper: %s", e.message)

    async def _provision(self, pool: uuid.UUID, v: PoolView) -> None:
        """A new VM for the pool: the ordinary create saga, then the ordinary start saga."""
        name = f"{v.name}-{secrets.token_hex(3)}"
        instance_id = uuid.uuid4()
        params = {
            "silo": v.silo, "project": v.project, "name": name, "vcpus": v.vcpus, "ram_bytes": v.ram_bytes,
            "disk_bytes": v.disk_bytes, "auto_restart": "best_effort", "instance_id": str(instance_id),
            "project_id": str(v.project_id), "pool_id": str(v.id),
        }  # fmt: skip
        began = time.monotonic()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                saga_id = await self.app.sagas.begin(conn, CREATE, params)
        except bus.CommandError as e:
            log.info("pool %s: cannot provision: %s", v.name, e.message)
            self._heard(pool, began, "failed")
            return
        telemetry.count("pool.provisioned")
        self._spawn(self._create_then_start(pool, saga_id, instance_id))

    async def _create_then_start(self, pool: uuid.UUID, saga_id: uuid.UUID, instance_id: uuid.UUID) -> None:
        began = time.monotonic()
        created = await self.app.sagas.launch(saga_id)
        if created == "done":
            await self._start(pool, instance_id)
        else:
            self._heard(pool, began, created)

    async def _start(self, pool: uuid.UUID, instance_id: uuid.UUID) -> None:
        """Start a member: the ordinary start saga, as the pool's keeper (its interlock refuses a VM
        retired meanwhile); how it ends is heard in the background."""
        began = time.monotonic()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                params = {"instance_id": str(instance_id), "by": "pool"}
                saga_id = await self.app.sagas.begin(conn, START, params)
        except (AlreadyRunning, bus.CommandError):
            return
        self.app.relay.kick()
        self._spawn(self._hear(pool, began, self.app.sagas.launch(saga_id)))

    async def _hear(self, pool: uuid.UUID, began: float, saga: asyncio.Task[str]) -> None:
        self._heard(pool, began, await saga)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
