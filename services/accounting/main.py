"""The accounting process: provisioning deltas, silo and project events, usage and its history."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.accounting.history import history
from services.accounting.ledger import SOURCE, Forged, Q, UnknownProject, UnknownSilo, apply_delta
from shared import bus, db, subjects, telemetry
from shared.config import Settings
from shared.messages import Envelope, ProjectCreated, ProvisionDelta, SiloCreated, UsageGet, UsageHistoryGet
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "accounting"
UNKNOWN_PROJECT_DELIVERIES = 240
"""A delta for a project whose creation has not arrived waits (0.5 s a try, some two minutes) for it,
then is dead-lettered: the project's creation event always comes first from instance-manager's outbox."""


def _usage(r: asyncpg.Record) -> dict[str, int]:
    return {"vcpus": r["vcpus"], "ram_bytes": r["ram_bytes"], "disk_bytes": r["disk_bytes"]}


def _quota(r: asyncpg.Record) -> dict[str, int | None]:
    return {"vcpus": r["quota_vcpus"], "ram_bytes": r["quota_ram_bytes"], "disk_bytes": r["quota_disk_bytes"]}


async def usage(pool: asyncpg.Pool, body: UsageGet) -> dict[str, Any]:
    """Usage of the fleet, a silo or a project, with the level below it broken down."""
    async with pool.acquire() as conn:
        if body.silo is None:
            silos = await conn.fetch(Q["silo_list"])
            return {
                "scope": "fleet",
                "name": subjects.FLEET,
                "usage": _usage(await conn.fetchrow(Q["fleet_get"])),
                "quota": None,
                "children": [{"name": s["name"], "usage": _usage(s), "quota": _quota(s)} for s in silos],
            }
        silo = await conn.fetchrow(Q["silo_by_name"], body.silo)
        if silo is None:
            raise bus.NotFound(f"no silo {body.silo}")
        if body.project is None:
            projects = await conn.fetch(Q["projects_of_silo"], silo["id"])
            return {
                "scope": "silo",
                "name": body.silo,
                "usage": _usage(silo),
                "quota": _quota(silo),
                "children": [{"name": p["name"], "usage": _usage(p)} for p in projects],
            }
        p = await conn.fetchrow(Q["project_by_name"], body.silo, body.project)
        if p is None:
            raise bus.NotFound(f"no project {body.silo}/{body.project}")
        return {
            "scope": "project",
            "name": f"{body.silo}/{body.project}",
            "usage": _usage(p),
            "quota": None,
            "children": [],
        }


async def main(settings: Settings) -> None:
    pool = await open_database(settings, SCHEMA, Path(__file__).parent / "migrations")
    nc, js = await connect_bus(settings, SOURCE)
    relay = db.OutboxRelay(pool, js)

    async def on_delta(env: Envelope, d: ProvisionDelta, msg: Msg) -> None:
        _, _, _, silo, project = msg.subject.split(".")
        try:
            async with pool.acquire() as conn, conn.transaction():
                await apply_delta(conn, silo, project, d)
        except UnknownSilo:
            raise bus.Retry(f"silo {silo} not known yet", delay=0.2) from None
        except UnknownProject:
            if msg.metadata.num_delivered >= UNKNOWN_PROJECT_DELIVERIES:
                raise bus.Reject(f"forged: project {d.project_id} of silo {silo} is not known") from None
            raise bus.Retry(f"project {silo}/{project} not known yet", delay=0.5) from None
        except Forged as e:
            telemetry.count("deltas.forged")
            raise bus.Reject(f"forged: {e.reason}") from None
        relay.kick()

    async def on_silo(env: Envelope, e: SiloCreated, msg: Msg) -> None:
        await pool.execute(
            Q["silo_upsert"], e.silo_id, e.name, e.quota.vcpus, e.quota.ram_bytes, e.quota.disk_bytes
        )

    async def on_project(env: Envelope, e: ProjectCreated, msg: Msg) -> None:
        try:
            await pool.execute(Q["project_upsert"], e.project_id, e.silo_id, e.name)
        except asyncpg.ForeignKeyViolationError:
            raise bus.Retry(f"silo {e.silo} not known yet") from None

    async def on_usage(body: UsageGet, msg: Msg) -> dict[str, Any]:
        return await usage(pool, body)

    async def on_history(body: UsageHistoryGet, msg: Msg) -> dict[str, Any]:
        return await history(pool, body)

    await bus.serve(
        nc, subjects.command_pattern("usage"), {UsageGet: on_usage, UsageHistoryGet: on_history}, queue=SOURCE
    )
    await serve_faults(nc, SOURCE)
    await serve_stats(nc, SOURCE)
    common: dict[str, Any] = {"service": SOURCE}
    log.info("accounting ready")
    await run_forever(
        relay.run(),
        bus.Consumer(
            js,
            **common,
            stream=subjects.PROVISION_STREAM,
            durable="accounting-deltas",
            filter_subject="rp.acct.delta.>",
            handler=on_delta,
            expect=ProvisionDelta,
        ).run(),
        bus.Consumer(
            js,
            **common,
            stream=subjects.EVENTS_STREAM,
            durable="accounting-silos",
            filter_subject=subjects.event("*", "silo", "created"),
            handler=on_silo,
            expect=SiloCreated,
        ).run(),
        bus.Consumer(
            js,
            **common,
            stream=subjects.EVENTS_STREAM,
            durable="accounting-projects",
            filter_subject=subjects.event("*", "project", "created"),
            handler=on_project,
            expect=ProjectCreated,
        ).run(),
    )
