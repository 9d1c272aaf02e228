"""Silos and projects: create, show, list and delete them, and each silo's limits, with the command rate
limits checked as a command arrives (docs/security.md "Tenant limits")."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from nats.aio.msg import Msg

from services.instance_manager import limits, paging, replies
from services.instance_manager.app import App
from services.instance_manager.base import SOURCE, Q
from shared import bus, telemetry
from shared.db import enqueue
from shared.messages import (
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
)
from shared.topology import subjects

log = logging.getLogger(__name__)

NAMES_SHOWN = 5
"""Most project names a refused `silo delete` lists (it says how many there are in all)."""


class TenantCommands:
    """The handlers of `rp.cmd.<silo>.silo.*` and `rp.cmd.<silo>.project.*`, and the rate limiter every
    command passes (`admit`)."""

    app: App
    limiter: limits.Limiter

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
                "instances": await conn.fetchval(Q["silo_instances_live"], silo["id"]),
                "pool_members": await conn.fetchval(Q["silo_pool_members_count"], silo["id"], "", ""),
            }
        own = {k: silo[c] is not None for k, c in limits.COLUMNS.items()}
        return {
            "id": str(silo["id"]),
            "name": silo["name"],
            "quota": silo["quota"],
            "limits": limits.in_force(silo, self.app.settings),
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
            most = limits.in_force(silo, self.app.settings)["projects"]
            if await conn.fetchval(Q["silo_projects_count"], silo["id"]) > most:  # the new one counted
                raise limits.over(body.silo, most, "projects")
            await enqueue(
                conn,
                subjects.event(body.silo, "project", "created"),
                ProjectCreated(
                    project_id=project_id,
                    silo_id=silo["id"],
                    silo=body.silo,
                    name=body.name,
                ),
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
                ProjectDeleted(
                    project_id=project["id"],
                    silo_id=silo["id"],
                    silo=body.silo,
                    name=body.name,
                ),
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


def _count(n: int, what: str) -> str:
    """`1 pool`, `2 instances`."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def _listed(names: list[str], total: int) -> str:
    """The names shown, and how many more there are."""
    more = total - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")
