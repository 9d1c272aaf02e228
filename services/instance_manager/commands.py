"""Operator commands served by the instance-manager (request/reply on rp.cmd.<silo>.<resource>.<verb>)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.instance_manager import lifecycle, limits, orders, paging, replies, sleds
from services.instance_manager.app import SOURCE, App, Q, instance_reply
from services.instance_manager.create_saga import CREATE
from services.instance_manager.migrate_saga import MIGRATE
from services.instance_manager.pools import Pools
from services.instance_manager.start_saga import START, AlreadyRunning
from shared import bus, subjects, telemetry
from shared.config import settings
from shared.db import GroupCommit, enqueue
from shared.messages import (
    InstanceCreate,
    InstanceDelete,
    InstanceList,
    InstanceMigrate,
    InstanceRef,
    InstanceRestart,
    InstanceSettle,
    InstanceShow,
    InstanceStart,
    InstanceStop,
    ProjectCreate,
    ProjectCreated,
    ProjectDelete,
    ProjectDeleted,
    ProjectList,
    SiloCreate,
    SiloCreated,
    SiloDelete,
    SiloDeleted,
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

log = logging.getLogger(__name__)

SAGA_REPLY_WAIT = 10.0
"""How long a create, start or migration waits for its saga before answering "in progress"."""
SAGA_POLL = 0.2
"""How often a command awaiting a saga another process runs (a copy of the command that began it, sent
again) looks whether it is over, or whether its lease is free to take (that process died)."""
NAMES_SHOWN = 5
"""Most project names a refused `silo delete` lists (it says how many there are in all)."""
LOST_ORDERS_TOGETHER = 64
"""Most lost orders applied in one transaction (each names up to LOST_BATCH VMMs of one sled)."""
BEGINS_AT_ONCE = 6
"""Creates, starts and migrations holding one of the service's 10 connections at once: a burst of them
never takes the connections the inventories, reports and charge outcomes are applied with (a sled whose
inventory waited behind a burst looked silent, and a start placed on it failed)."""


class Commands:
    def __init__(self, app: App, pools: Pools) -> None:
        self.app = app
        self.pools = pools
        self.lost_orders = GroupCommit(self._apply_lost, most=LOST_ORDERS_TOGETHER)
        """Lost orders come one a sled: after a rack's power loss, thousands at once."""
        s = settings()
        self.limiter = limits.Limiter(s.identity_command_rate, s.silo_command_rate, s.command_burst)
        self._rates_task: asyncio.Task[None] | None = None
        self.starting = 0
        self._begins = asyncio.Semaphore(BEGINS_AT_ONCE)
        """Creates, starts and migrations not yet launched (waiting for a connection, or in `begin`):
        in hand as much as the sagas being driven, and counted with them by the backpressure."""

    async def serve(self) -> None:
        nc = self.app.nc
        q = SOURCE
        admit = self.admit
        await self._read_rates()
        self._rates_task = asyncio.create_task(self._refresh_rates())
        await bus.serve(
            nc,
            subjects.command_pattern("silo"),
            {
                SiloCreate: self.silo_create,
                SiloList: self.silo_list,
                SiloShow: self.silo_show,
                SiloLimitsSet: self.silo_limits_set,
                SiloDelete: self.silo_delete,
            },
            queue=q,
            admit=admit,
        )
        await bus.serve(
            nc,
            subjects.command_pattern("project"),
            {
                ProjectCreate: self.project_create,
                ProjectList: self.project_list,
                ProjectDelete: self.project_delete,
            },
            queue=q,
            admit=admit,
        )
        await bus.serve(
            nc,
            subjects.command_pattern("instance"),
            {
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
            queue=q,
            admit=admit,
        )
        await bus.serve(
            nc,
            subjects.command_pattern("sled"),
            {SledList: self.sled_list, SledExpunge: self.sled_expunge},
            queue=q,
            admit=admit,
        )
        await bus.serve(
            nc,
            subjects.command_pattern("vmm"),
            {
                VmmLost: self.vmm_lost_one,
                VmmLostV2: self.vmm_lost,
                VmmStuck: self.vmm_stuck,
                VmmZombie: self.vmm_zombie,
            },
            queue=q,
        )

    # --- tenant limits (docs/security.md "Tenant limits") ---

    def admit(self, msg: Msg) -> bus.CommandError | None:
        """The command rate limits (limits.Limiter), checked as a command arrives, before it is even
        decoded: one past them is answered at once with `limited: retry after N ms`."""
        if limits.exempt(msg.subject) or not (ms := self.limiter.admit(msg.subject, msg.reply)):
            return None
        telemetry.count("commands.limited")
        return bus.CommandError("limited", limits.limited(ms, msg.subject))

    async def _read_rates(self) -> None:
        rows = await self.app.pool.fetch(Q["silo_command_rates"])
        self.limiter.rates = {r["name"]: float(r["command_rate"]) for r in rows}

    async def _refresh_rates(self) -> None:
        """Another replica's `silo limits` reaches this one's limiter within RATES_REFRESH seconds."""
        while True:
            await asyncio.sleep(limits.RATES_REFRESH)
            try:
                await self._read_rates()
            except Exception as e:  # the database away: the rates held stay until it is back
                log.info("silo command rates not read: %s", e)

    async def silo_show(self, body: SiloShow, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            silo = await conn.fetchrow(Q["silo_limits"], body.silo)
            if silo is None:
                raise bus.NotFound(f"no silo {body.silo}")
            used = {
                "projects": await conn.fetchval(Q["silo_projects_count"], silo["id"]),
                "instances": await conn.fetchval(Q["silo_instances_count"], silo["id"]),
                "pool_members": await conn.fetchval(Q["silo_pool_members_count"], silo["id"], "", ""),
            }
        own = {k: silo[c] is not None for k, c in limits.COLUMNS.items()}
        return {
            "id": str(silo["id"]),
            "name": silo["name"],
            "quota": silo["quota"],
            "limits": limits.in_force(silo),
            "limits_own": own,
            "used": used,
        }

    async def silo_limits_set(self, body: SiloLimitsSet, msg: Msg) -> dict[str, Any]:
        """A copy sent again is not applied anew (replies.claim): it would undo limits another operator set
        in between. It answers with the silo as it is now."""
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                found = await conn.fetchval(
                    Q["silo_limits_set"],
                    body.name,
                    body.projects,
                    body.instances,
                    body.pool_members,
                    body.command_rate,
                )
                if found is None:
                    raise bus.NotFound(f"no silo {body.name}")
                await replies.answered(conn, request, {})
        except replies.Answered:
            return await self.silo_show(SiloShow(silo=body.name), msg)
        if body.command_rate is not None:
            self.limiter.rates[body.name] = float(body.command_rate)
        return await self.silo_show(SiloShow(silo=body.name), msg)

    # --- silos and projects ---

    async def silo_create(self, body: SiloCreate, msg: Msg) -> dict[str, Any]:
        try:
            return await self._silo_create(body, replies.current())
        except replies.Answered as e:
            return e.reply

    async def _silo_create(self, body: SiloCreate, request: replies.Request) -> dict[str, Any]:
        silo_id = uuid.uuid4()
        quota = body.quota.model_dump()
        reply = {"id": str(silo_id), "name": body.name, "quota": quota}
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            created = await conn.fetchval(Q["silo_insert"], silo_id, body.name, quota)
            if created is None:
                raise bus.Conflict(f"silo {body.name} already exists")
            await enqueue(
                conn,
                subjects.event(body.name, "silo", "created"),
                SiloCreated(silo_id=silo_id, name=body.name, quota=body.quota),
                source=SOURCE,
                key=f"silo:{silo_id}",
            )
            await replies.answered(conn, request, reply)
        self.app.relay.kick()
        return reply

    async def silo_list(self, body: SiloList, msg: Msg) -> dict[str, Any]:
        rows = await self.app.pool.fetch(Q["silo_page"], *paging.after(body.after, 1), body.limit)
        rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["name"],))
        items = [{"id": str(r["id"]), "name": r["name"], "quota": r["quota"]} for r in rows]
        return paging.reply(items, next_cursor)

    async def project_create(self, body: ProjectCreate, msg: Msg) -> dict[str, Any]:
        try:
            return await self._project_create(body, replies.current())
        except replies.Answered as e:
            return e.reply

    async def _project_create(self, body: ProjectCreate, request: replies.Request) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            silo = await conn.fetchrow(Q["silo_lock_limits"], body.silo)  # creates of a silo take turns
            if silo is None:
                raise bus.NotFound(f"no silo {body.silo}")
            project_id = uuid.uuid4()
            if await conn.fetchval(Q["project_insert"], project_id, silo["id"], body.name) is None:
                raise bus.Conflict(f"project {body.silo}/{body.name} already exists")
            most = limits.in_force(silo)["projects"]
            if await conn.fetchval(Q["silo_projects_count"], silo["id"]) > most:  # the new one counted
                raise limits.over(body.silo, most, "projects")
            await enqueue(
                conn,
                subjects.event(body.silo, "project", "created"),
                ProjectCreated(project_id=project_id, silo_id=silo["id"], silo=body.silo, name=body.name),
                source=SOURCE,
                key=f"project:{project_id}",
            )
            reply = {"id": str(project_id), "silo": body.silo, "name": body.name}
            await replies.answered(conn, request, reply)
        self.app.relay.kick()
        return reply

    async def silo_delete(self, body: SiloDelete, msg: Msg) -> dict[str, Any]:
        """Delete a silo that holds no project. Its row is locked FOR UPDATE, which a project create's
        lock of it waits for, so a create racing the delete either is counted here (the delete refused) or
        finds no silo after it. The row stays, marked deleted (its projects point at it); its name is free."""
        try:
            return await self._silo_delete(body, replies.current())
        except replies.Answered as e:
            return e.reply

    async def _silo_delete(self, body: SiloDelete, request: replies.Request) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            silo = await conn.fetchrow(Q["silo_lock_delete"], body.name)
            if silo is None:
                raise bus.NotFound(f"no silo {body.name}")
            inside = await conn.fetch(Q["silo_projects"], silo["id"], NAMES_SHOWN)
            if inside:
                raise bus.Conflict(
                    f"silo {body.name} still holds {_count(inside[0]['total'], 'project')}: "
                    f"{_listed([r['name'] for r in inside], inside[0]['total'])} (rackctl project delete)"
                )
            await conn.execute(Q["silo_mark_deleted"], silo["id"])
            await enqueue(
                conn,
                subjects.event(body.name, "silo", "deleted"),
                SiloDeleted(silo_id=silo["id"], name=body.name),
                source=SOURCE,
                key=f"silo-deleted:{silo['id']}",
            )
            reply = {"id": str(silo["id"]), "name": body.name}
            await replies.answered(conn, request, reply)
        self.app.relay.kick()
        return reply

    async def project_delete(self, body: ProjectDelete, msg: Msg) -> dict[str, Any]:
        """Delete a project that holds no instance (but destroyed ones) and no live pool. Its silo's row is
        locked first, as every create inside locks it, then its own FOR UPDATE, which the insert of an
        instance or a pool waits for (instance_insert, pool_insert): an insert racing the delete is either
        counted here (the delete refused) or finds the project deleted after it (not found)."""
        try:
            return await self._project_delete(body, replies.current())
        except replies.Answered as e:
            return e.reply

    async def _project_delete(self, body: ProjectDelete, request: replies.Request) -> dict[str, Any]:
        where = f"{body.silo}/{body.name}"
        async with self.app.pool.acquire() as conn, conn.transaction():
            await replies.claim(conn, request)
            silo = await conn.fetchrow(Q["silo_lock_limits"], body.silo)
            project = silo and await conn.fetchrow(Q["project_lock_delete"], silo["id"], body.name)
            if not project:
                raise bus.NotFound(f"no project {where}")
            held = await conn.fetchrow(Q["project_holds"], project["id"])
            if held["instances"] or held["pools"]:
                kinds = (("instances", "instance"), ("pools", "pool"))
                things = [_count(held[k], what) for k, what in kinds if held[k]]
                raise bus.Conflict(f"project {where} still holds {' and '.join(things)}")
            await conn.execute(Q["project_mark_deleted"], project["id"])
            await enqueue(
                conn,
                subjects.event(body.silo, "project", "deleted"),
                ProjectDeleted(project_id=project["id"], silo_id=silo["id"], silo=body.silo, name=body.name),
                source=SOURCE,
                key=f"project-deleted:{project['id']}",
            )
            reply = {"id": str(project["id"]), "silo": body.silo, "name": body.name}
            await replies.answered(conn, request, reply)
        self.app.relay.kick()
        return reply

    async def project_list(self, body: ProjectList, msg: Msg) -> dict[str, Any]:
        rows = await self.app.pool.fetch(
            Q["project_page"], body.silo, *paging.after(body.after, 1), body.limit
        )
        rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["name"],))
        items = [{"id": str(r["id"]), "silo": r["silo"], "name": r["name"]} for r in rows]
        return paging.reply(items, next_cursor)

    # --- instances ---

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
            ms, in_hand, rate = busy
            telemetry.count("commands.busy")
            raise bus.CommandError(
                "busy", f"busy: retry after {ms} ms ({in_hand} sagas in hand, {rate:.0f} finished a second)"
            )
        self.starting += 1
        try:
            async with self._begins, self.app.pool.acquire() as conn:
                yield conn
        finally:
            self.starting -= 1

    async def _await_saga(self, saga_id: uuid.UUID, instance_id: uuid.UUID, verb: str) -> dict[str, Any]:
        """Answer once the saga ends (or after SAGA_REPLY_WAIT, with the instance as it is by then)."""
        try:
            status = await asyncio.wait_for(self._saga_end(saga_id), SAGA_REPLY_WAIT)
        except TimeoutError:
            status = "running"
        if status == "failed":
            error = await self.app.sagas.error(saga_id)
            raise bus.CommandError("refused", f"{verb} failed: {error}")
        async with self.app.pool.acquire() as conn:
            return instance_reply(await self.app.view(conn, instance_id))

    async def _saga_end(self, saga_id: uuid.UUID) -> str:
        """The saga's final status, driving it here if nobody else does: a copy of the command that began
        it (sent again) may arrive while another replica runs it, or after that replica died (its lease
        then expires, and this one takes it: never a second saga). "missing": pruned, long over."""
        while True:
            status = await asyncio.shield(self.app.sagas.launch(saga_id, waited_for=True))
            if status in ("done", "failed"):
                return status
            # "busy" (another process holds its lease, or it is over) or "lost" (another took it)
            status = await self.app.pool.fetchval(replies.SQL["saga_status"], saga_id)
            if status in ("done", "failed", None):
                return status or "missing"
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
            update={"vcpus": vcpus, "ram_bytes": ram, "disk_bytes": disk, "from_pool": None}
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
            params = {
                **body.model_dump(mode="json", exclude={"from_pool", "require_pool"}),
                "instance_id": str(instance_id),
                "project_id": str(project["id"]),
            }
            saga_id = await self.app.sagas.begin(conn, CREATE, params)  # its first step inserts it
            most = limits.in_force(silo)["instances"]
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
                        saga_id = await self.app.sagas.begin(conn, START, {"instance_id": str(instance_id)})
                        await replies.answered(conn, request, saga_id=saga_id, instance_id=instance_id)
                except AlreadyRunning:  # nothing recorded: a copy finds it so too
                    return instance_reply(await self.app.view(conn, instance_id))
        except replies.Answered as e:
            return await self._saga_answer(e, "start")
        self.app.relay.kick()
        return await self._await_saga(saga_id, instance_id, "start")

    async def instance_stop(self, body: InstanceStop, msg: Msg) -> dict[str, Any]:
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                reply = instance_reply(
                    await lifecycle.stop(self.app, conn, await self._instance_id(conn, body))
                )
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return e.reply
        self.app.relay.kick()
        return reply

    async def instance_migrate(self, body: InstanceMigrate, msg: Msg) -> dict[str, Any]:
        request = replies.current()
        try:
            async with self._beginning() as conn, conn.transaction():
                await replies.claim(conn, request)
                instance_id = await self._instance_id(conn, body)
                params = {"instance_id": str(instance_id), "to_sled": body.to_sled}
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
        request = replies.current()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await replies.claim(conn, request)
                v = await lifecycle.delete(self.app, conn, await self._instance_id(conn, body))
                reply = instance_reply(v)
                await replies.answered(conn, request, reply)
        except replies.Answered as e:
            return e.reply
        self.app.relay.kick()
        return reply

    async def instance_show(self, body: InstanceShow, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            return instance_reply(await self.app.view(conn, await self._instance_id(conn, body)))

    async def instance_list(self, body: InstanceList, msg: Msg) -> dict[str, Any]:
        async with self.app.pool.acquire() as conn:
            rows = await conn.fetch(
                Q["instance_page"], body.silo, body.project, *paging.after(body.after, 3), body.limit
            )
            rows, next_cursor = paging.page(rows, body.limit, lambda r: (r["silo"], r["project"], r["name"]))
            views = await self.app.views(conn, [r["id"] for r in rows])
        return paging.reply([instance_reply(v) for v in views], next_cursor)

    # --- recovery's orders (orders.py: each applied only if what recovery saw still holds) ---

    async def instance_restart(self, body: InstanceRestart, msg: Msg) -> dict[str, Any]:
        params = {"instance_id": str(body.instance_id), "expected_generation": body.generation}
        async with self.app.pool.acquire() as conn:
            try:
                async with conn.transaction():
                    saga_id = await self.app.sagas.begin(conn, START, params)
            except AlreadyRunning:
                raise orders.Stale("restart", "instance is already running") from None
        self.app.relay.kick()
        self.app.sagas.launch(saga_id)
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

    # --- sleds ---

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


def _count(n: int, what: str) -> str:
    """`1 pool`, `2 instances`."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def _listed(names: list[str], total: int) -> str:
    """The names shown, and how many more there are."""
    more = total - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")
