"""Instances: create (from a warm pool, or new), start, stop, live-migrate, delete, show and list; a
create, start or migration begins its saga and answers once it ends, or after SAGA_REPLY_WAIT."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.instance_manager import lifecycle, limits, paging, replies
from services.instance_manager.app import App
from services.instance_manager.base import Q
from services.instance_manager.pools import Pools
from services.instance_manager.sagas import pace as pacing
from services.instance_manager.sagas.create import CREATE, CreateParams
from services.instance_manager.sagas.definition import Status
from services.instance_manager.sagas.migrate import MIGRATE, MigrateParams
from services.instance_manager.sagas.start import START, AlreadyRunning, StartParams
from services.instance_manager.views import instance_reply, view
from services.instance_manager.views import views as instance_views
from shared import bus
from shared.messages import (
    InstanceCreate,
    InstanceDelete,
    InstanceList,
    InstanceMigrate,
    InstanceRef,
    InstanceShow,
    InstanceStart,
    InstanceStop,
)

SAGA_REPLY_WAIT = 10.0
"""How long a create, start or migration waits for its saga before answering "in progress"."""
SAGA_POLL = 0.2
"""How often a command awaiting a saga another process runs (a copy of the command that began it, sent
again) looks whether it is over, or whether its lease is free to take (that process died)."""
BEGINS_AT_ONCE = 6
"""Creates, starts and migrations holding one of the service's 10 connections at once: a burst of them
never takes the connections the inventories, reports and charge outcomes are applied with (a sled whose
inventory waited behind a burst looked silent, and a start placed on it failed)."""


class InstanceCommands:
    """The handlers of `rp.cmd.<silo>.instance.*` that operators send (recovery's are in orders.py)."""

    app: App
    pools: Pools
    starting: int
    _begins: asyncio.Semaphore

    async def _instance_id(self, conn: asyncpg.Connection, ref: InstanceRef) -> uuid.UUID:
        r = await conn.fetchrow(Q["instance_by_name"], ref.silo, ref.project, ref.name)
        if r is None:
            raise bus.NotFound(f"no instance {ref.silo}/{ref.project}/{ref.name}")
        return r["id"]

    @contextlib.asynccontextmanager
    async def _beginning(self, refuse_busy: bool = True) -> AsyncIterator[asyncpg.Connection]:
        """A connection for a create, start or migrate, the command counted in hand (`starting`) until it
        gives the connection back: waiting for a connection is where a flood of starts piles up.

        Backpressure: when this replica has more sagas in hand than it finishes within
        RACKPLANE_SAGA_BACKLOG (saga.Executor.busy), the command is refused at once, having done nothing,
        with `busy: retry after N ms` instead of being left to time out. Checked here, as each handler
        starts in arrival order, and not in `admit`: a burst is admitted whole before any handler runs,
        so only here is the count of those ahead exact."""
        if refuse_busy and (busy := self.app.sagas.busy(self.starting)):
            raise pacing.refusal(*busy)
        self.starting += 1
        try:
            async with self._begins, self.app.pool.acquire() as conn:
                yield conn
        finally:
            self.starting -= 1

    async def _await_saga(self, saga_id: uuid.UUID, instance_id: uuid.UUID, verb: str) -> dict[str, Any]:
        """Answer once the saga ends (or after SAGA_REPLY_WAIT, with the instance as it is by then)."""
        try:
            async with asyncio.timeout(SAGA_REPLY_WAIT):
                status = await self._saga_end(saga_id)
        except TimeoutError:
            status = Status.running
        if status is Status.failed:
            error = await self.app.sagas.error(saga_id)
            raise bus.CommandError("refused", f"{verb} failed: {error}")
        async with self.app.pool.acquire() as conn:
            return instance_reply(await view(conn, instance_id, self.app.settings))

    async def _saga_end(self, saga_id: uuid.UUID) -> Status:
        """The saga's final status, driving it here if nobody else does: a copy of the command that began
        it (sent again) may arrive while another replica runs it, or after that replica died (its lease
        then expires, and this one takes it: never a second saga). `missing`: pruned, long over."""
        while True:
            status = await asyncio.shield(self.app.sagas.launch(saga_id, waited_for=True))
            if status.over:
                return status
            # busy (another process holds its lease, or it is over) or lost (another took it)
            stored = await self.app.pool.fetchval(replies.SQL["saga_status"], saga_id)
            if stored is None:
                return Status.missing
            if Status(stored).over:
                return Status(stored)
            await asyncio.sleep(SAGA_POLL)

    async def _saga_answer(self, e: replies.Answered, verb: str) -> dict[str, Any]:
        """What a copy of a create, start or migration gets: the first's saga, awaited."""
        assert e.saga_id is not None and e.instance_id is not None, "a saga's command records its saga"
        return await self._await_saga(e.saga_id, e.instance_id, verb)

    async def instance_create(self, body: InstanceCreate, msg: Msg) -> dict[str, Any]:
        request = replies.current()
        if body.from_pool is None:
            return await self._create(body, request)
        try:
            picked = await self.pools.pick(body, request)
        except replies.Answered as e:
            if e.saga_id is None:  # a copy of a pick: its answer
                return {**e.reply, "source": "pool"}
            picked = None  # a copy of a create from an empty pool: its create and start go on below
        if picked is not None:
            return {**picked, "source": "pool"}
        if body.require_pool:
            raise bus.Conflict(f"pool {body.silo}/{body.project}/{body.from_pool} has no idle VM")
        # The pool is empty: a new instance of the pool's shape, started, so that the caller gets what a
        # pick would have given, and is told so.
        vcpus, ram, disk = await self.pools.shape(body)
        shaped = body.model_copy(
            update={
                "vcpus": vcpus,
                "ram_bytes": ram,
                "disk_bytes": disk,
                "from_pool": None,
            }
        )
        created = await self._create(shaped, request)
        if created.get("source") == "pool":  # a copy, after another copy picked from the pool refilled
            return created
        started = await self._start(  # not refused busy: the create it follows is done; recorded under
            # an id of its own, derived, so that a copy awaits this start's saga rather than begin another
            InstanceStart(silo=body.silo, project=body.project, name=body.name),
            replies.derived(request, "start"),
            refuse_busy=False,
        )
        note = f"pool {body.from_pool} had no idle VM: created and started a new instance"
        return {**started, "source": "new", "note": note}

    async def _create(self, body: InstanceCreate, request: replies.Request) -> dict[str, Any]:
        try:
            saga_id, instance_id = await self._begin_create(body, request)
        except replies.Answered as e:
            if e.saga_id is None:  # a copy of a create from a pool that picked (the pool was refilled)
                return {**e.reply, "source": "pool"}
            return await self._saga_answer(e, "create")
        self.app.relay.kick()
        return await self._await_saga(saga_id, instance_id, "create")

    async def _begin_create(
        self, body: InstanceCreate, request: replies.Request
    ) -> tuple[uuid.UUID, uuid.UUID]:
        instance_id = uuid.uuid4()
        async with self._beginning() as conn, conn.transaction():
            await replies.claim(conn, request)
            silo = await conn.fetchrow(Q["silo_lock_limits"], body.silo)  # creates of a silo take turns
            project = await conn.fetchrow(Q["project_by_name"], body.silo, body.project)
            if silo is None or project is None:
                raise bus.NotFound(f"no project {body.silo}/{body.project}")
            params = CreateParams(
                **body.model_dump(exclude={"from_pool", "require_pool"}),
                instance_id=instance_id,
                project_id=project["id"],
            )
            saga_id = await self.app.sagas.begin(conn, CREATE, params)  # its first step inserts it
            most = limits.in_force(silo, self.app.settings)["instances"]
            if await conn.fetchval(Q["silo_instances_count"], silo["id"]) > most:  # the new one counted
                raise limits.over(body.silo, most, "instances")
            await replies.answered(conn, request, saga_id=saga_id, instance_id=instance_id)
        return saga_id, instance_id

    async def instance_start(self, body: InstanceStart, msg: Msg) -> dict[str, Any]:
        return await self._start(body, replies.current())

    async def _start(
        self, body: InstanceStart, request: replies.Request, *, refuse_busy: bool = True
    ) -> dict[str, Any]:
        try:
            async with self._beginning(refuse_busy) as conn:
                try:
                    async with conn.transaction():
                        await replies.claim(conn, request)
                        instance_id = await self._instance_id(conn, body)
                        saga_id = await self.app.sagas.begin(
                            conn, START, StartParams(instance_id=instance_id)
                        )
                        await replies.answered(conn, request, saga_id=saga_id, instance_id=instance_id)
                except AlreadyRunning:  # nothing recorded: a copy finds it so too
                    return instance_reply(await view(conn, instance_id, self.app.settings))
        except replies.Answered as e:
            return await self._saga_answer(e, "start")
        self.app.relay.kick()
        return await self._await_saga(saga_id, instance_id, "start")

    async def instance_stop(self, body: InstanceStop, msg: Msg) -> dict[str, Any]:
        return await self._once(body, lifecycle.stop)

    async def instance_migrate(self, body: InstanceMigrate, msg: Msg) -> dict[str, Any]:
        request = replies.current()
        try:
            async with self._beginning() as conn, conn.transaction():
                await replies.claim(conn, request)
                instance_id = await self._instance_id(conn, body)
                params = MigrateParams(instance_id=instance_id, to_sled=body.to_sled)
                saga_id = await self.app.sagas.begin(conn, MIGRATE, params)
                await replies.answered(conn, request, saga_id=saga_id, instance_id=instance_id)
        except replies.Answered as e:
            assert e.saga_id is not None and e.instance_id is not None
            saga_id, instance_id = e.saga_id, e.instance_id
        self.app.relay.kick()
        view = await self._await_saga(saga_id, instance_id, "migration")
        d = await self.app.sagas.data(saga_id)
        migration = {
            "source_vmm_id": d.get("source_vmm_id"),
            "source_sled_id": d.get("source_sled_id"),
            "target_vmm_id": d.get("vmm_id"),
            "target_sled_id": d.get("sled_id"),
        }
        return {**view, "migration": migration}

    async def instance_delete(self, body: InstanceDelete, msg: Msg) -> dict[str, Any]:
        return await self._once(body, lifecycle.delete)

    async def _once(
        self, ref: InstanceRef, change: Callable[[App, asyncpg.Connection, uuid.UUID], Awaitable[Any]]
    ) -> dict[str, Any]:
        """Apply `change` to the instance `ref` names, and answer with the instance as it left it; a copy
        of the command (sent again) gets the first's answer, applied once (replies.claim)."""
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                reply = instance_reply(await change(self.app, conn, await self._instance_id(conn, ref)))
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return e.reply
        self.app.relay.kick()
        return reply

    async def instance_show(self, body: InstanceShow, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            return instance_reply(await view(conn, await self._instance_id(conn, body), self.app.settings))

    async def instance_list(self, body: InstanceList, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            rows = await conn.fetch(
                Q["instance_page"],
                body.silo,
                body.project,
                *paging.after(body.after, 3),
                body.limit,
            )
            rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["silo"], r["project"], r["name"]))
            views = await instance_views(conn, [r["id"] for r in rows], self.app.settings)
        return paging.reply([instance_reply(v) for v in views], next_cursor)
