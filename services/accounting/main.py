"""The accounting process: provisioning deltas, silo and project events, usage and its history."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.accounting import MIGRATIONS
from services.accounting.history import history
from services.accounting.ledger import (
    SOURCE,
    Charge,
    Decided,
    Forged,
    Q,
    UnknownProject,
    UnknownSilo,
    apply_batch,
)
from shared import bus, db, telemetry, topology
from shared.config import Settings
from shared.messages import Envelope, ProjectCreated, ProvisionDelta, SiloCreated, UsageGet, UsageHistoryGet
from shared.service import connect_bus, open_database, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)
SCHEMA = "accounting"
UNKNOWN_PROJECT_DELIVERIES = 240
"""A delta for a project whose creation has not arrived waits (0.5 s a try, some two minutes) for it,
then is dead-lettered: the project's creation event always comes first from instance-manager's outbox."""


def retry_or_reject(c: Charge, r: Exception, msg: Msg) -> bus.Retry | bus.Reject:
    """What becomes of a delta the ledger did not apply: wait for its silo's or project's creation, or
    dead-letter it with the reason."""
    if isinstance(r, UnknownSilo):
        return bus.Retry(f"silo {c.silo} not known yet", delay=0.2)
    if isinstance(r, UnknownProject):
        if msg.metadata.num_delivered >= UNKNOWN_PROJECT_DELIVERIES:
            return bus.Reject(f"forged: project {c.delta.project_id} of silo {c.silo} is not known")
        return bus.Retry(f"project {c.silo}/{c.project} not known yet", delay=0.5)
    assert isinstance(r, Forged)
    telemetry.count("deltas.forged")
    return bus.Reject(f"forged: {r.reason}")


def instance_named(subject: str, d: ProvisionDelta) -> str | None:
    """The subject's instance token is the delta's instance (it decides the partition); a subject that is
    not a delta's at all is refused with the reason, never a crash of the consumer."""
    try:
        token = topology.parse_delta(subject)[2]
    except ValueError as e:
        return f"forged: {e}"
    return (
        None
        if token == str(d.instance_id)
        else f"forged: subject names instance {token}, not {d.instance_id}"
    )


def _usage(r: asyncpg.Record) -> dict[str, int]:
    return {"vcpus": int(r["vcpus"]), "ram_bytes": int(r["ram_bytes"]), "disk_bytes": int(r["disk_bytes"])}


def _quota(r: asyncpg.Record) -> dict[str, int | None]:
    return {"vcpus": r["quota_vcpus"], "ram_bytes": r["quota_ram_bytes"], "disk_bytes": r["quota_disk_bytes"]}


async def usage(pool: asyncpg.Pool, body: UsageGet) -> dict[str, Any]:
    """Usage of the fleet, a silo or a project, with the level below it broken down."""
    async with pool.acquire() as conn:
        if body.silo is None:
            silos = await conn.fetch(Q["silo_list"])
            return {
                "scope": "fleet",
                "name": topology.FLEET,
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
    pool = await open_database(settings, SCHEMA, MIGRATIONS)
    nc, js = await connect_bus(settings, SOURCE)
    relay = db.OutboxRelay(pool, nc, js, linger=settings.batch_linger)

    async def on_deltas(batch: list[bus.Delivery]) -> None:
        charges = []
        for d in batch:
            silo, project, _ = topology.parse_delta(d.msg.subject)
            charges.append(Charge(silo, project, d.body))
        async with pool.acquire() as conn, conn.transaction():
            results = await apply_batch(conn, charges, settings.duplicate_window)
        for d, c, r in zip(batch, charges, results, strict=True):
            if not isinstance(r, Decided):
                d.refused = retry_or_reject(c, r, d.msg)
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
        nc, topology.command_pattern("usage"), {UsageGet: on_usage, UsageHistoryGet: on_history}, queue=SOURCE
    )
    await serve_faults(nc, SOURCE)
    await serve_stats(nc, SOURCE)
    common: dict[str, Any] = {
        "service": SOURCE,
        "ack_wait": settings.ack_wait,
        "linger": settings.batch_linger,
    }
    log.info("accounting ready")
    await run_forever(
        relay.run(),
        *(
            bus.Consumer(
                js,
                **common,
                **d.binding,
                batch_handler=on_deltas,
                expect=ProvisionDelta,
                verify=instance_named,
            ).run()
            for d in topology.ACCOUNTING_DELTAS
        ),
        bus.Consumer(
            js,
            **common,
            **topology.ACCOUNTING_SILOS.binding,
            handler=on_silo,
            expect=SiloCreated,
        ).run(),
        bus.Consumer(
            js,
            **common,
            **topology.ACCOUNTING_PROJECTS.binding,
            handler=on_project,
            expect=ProjectCreated,
        ).run(),
    )
