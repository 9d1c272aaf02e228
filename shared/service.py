"""What every service process does around its own work: settings, logging, tracing, metrics, the HTTP
endpoint (metrics and health), connections, the task group, and a clean stop on SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from shared import crash, endpoint, logs, metrics, telemetry
from shared.config import ConfigError, Settings, settings
from shared.db import MigrationError

log = logging.getLogger(__name__)


def run(service: str, main: Callable[[Settings], Awaitable[None]]) -> None:
    """Run `main` until it returns or the process is asked to stop. A bad setting stops it with one line
    that names the variable."""
    try:
        given = settings()
    except ConfigError as e:
        raise SystemExit(f"{service}: {e}") from None
    logs.setup(service, given.log_level, given.log_format)
    crash.arm(given.crash_at)
    telemetry.setup_tracing(service, given.traces)
    metrics.setup(service)
    collect_garbage_in_bulk()

    async def supervise() -> None:
        host, port = given.http_host, given.http_port
        try:
            server = await endpoint.serve(host, port)
        except OSError as e:
            raise SystemExit(
                f"{service}: RACKPLANE_HTTP_PORT={port}: cannot listen on {host}:{port}: "
                f"{os.strerror(e.errno) if e.errno else e}"
            ) from None
        HTTP["port"] = endpoint.bound_port(server)
        log.info("%s: metrics and health on http://%s:%d", service, host, HTTP["port"])
        task = asyncio.create_task(main(given))
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []

        def stop() -> None:
            """The first signal stops gracefully (`stop_gracefully`); a second, at once."""
            if stopping:
                task.cancel()
            else:
                stopping.append(asyncio.create_task(stop_gracefully(task)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
        with suppress(asyncio.CancelledError):
            await task
        server.close()
        if FATAL:
            raise SystemExit(f"{service}: {FATAL[0]}")
        log.info("%s stopped", service)

    try:
        asyncio.run(supervise())
    except Migrated as done:
        log.info("%s: %s", service, done)
    except MigrationError as e:
        raise SystemExit(f"{service}: {e}") from None
    finally:
        telemetry.shutdown_tracing()


GC_THRESHOLDS = (100_000, 20, 20)
"""Python's collector runs its youngest generation every 700 new objects by default: a batch of a thousand
messages (each a message, an envelope, a body, a dict or two) ran it hundreds of times, and the older
generations often, over every object the process holds. Freezing what was made at start and collecting
less often took the accounting benchmark's median ratio to a bare consumer from 0.58 to 0.69
(docs/benchmarks.md).
Garbage in a reference cycle waits longer to go: 100,000 allocations in the youngest generation, 2 million
in the middle one, 40 million in the oldest (about a minute of a busy service); what has no cycle goes at
once, as always."""


def collect_garbage_in_bulk() -> None:
    """What was made at start (modules, settings, compiled queries) lives as long as the process: frozen,
    the collector no longer walks it; and it runs at GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Migrated(Exception):
    """RACKPLANE_MIGRATE=only: the schema is current and the process has nothing more to do (exit 0)."""


HTTP: dict[str, int] = {}
"""The port the process's HTTP endpoint listens on, once it does."""

FATAL: list[str] = []
"""Why the process must stop and be restarted by its supervisor (it then exits non-zero)."""


def stop_for(reason: str) -> None:
    """Stop the process as SIGTERM would, and exit non-zero with `reason`: for a state it cannot leave by
    itself, such as a broker connection closed for good."""
    log.error("stopping: %s", reason)
    FATAL.append(reason)
    os.kill(os.getpid(), signal.SIGTERM)


STOP_GRACE = 12.0
"""Seconds a process asked to stop spends answering the commands it has in hand: longer than any command
waits before it answers (instance-manager's SAGA_REPLY_WAIT, 10 s: a start answers `starting` then),
shorter than a supervisor's patience (`make run` and the tests kill after 30 s; the compose files give
the services 15 s, Docker's default being 10)."""


async def stop_gracefully(task: asyncio.Task[None]) -> None:
    """Leave every command queue group and answer the commands in hand (bus.stop_serving), then stop:
    a replica restarted in turn is not seen by its callers, whose commands its peer takes meanwhile.
    Sagas this process runs stop at a step boundary and release their leases (another process resumes
    them at once); unacked messages are redelivered to its peers."""
    from shared import bus

    with suppress(Exception):
        async with asyncio.timeout(STOP_GRACE + 1):
            await bus.stop_serving(STOP_GRACE)
    task.cancel()


def dump_tasks() -> None:
    """On SIGUSR1: log where every task is waiting, to diagnose a stuck process without stopping it."""
    for t in asyncio.all_tasks():
        where, coro = [], t.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        log.warning("task %s:%s", t.get_name(), "".join(f"\n    {w}" for w in where))


async def run_forever(*coros: Awaitable[None]) -> None:
    """Run long-lived loops together; if one fails, the process fails (and its supervisor restarts it)."""
    async with asyncio.TaskGroup() as tg:
        for c in coros:
            tg.create_task(c)  # type: ignore[arg-type]


async def serve_stats(
    nc: Any, service: str, extra: Callable[[], Awaitable[dict[str, Any]]] | None = None
) -> None:
    """Answer `rp.svc.<service>.stats` with the process's counters and gauges (and `extra`, if given): the
    numbers `/metrics` exports (shared/metrics.py). Called once the service is set up, it also makes the
    service ready (`/readyz`)."""
    from shared import bus
    from shared.messages import StatsGet
    from shared.topology import subjects

    async def answer(body: StatsGet, msg: Any) -> dict[str, Any]:
        await metrics.sample()
        out: dict[str, Any] = {
            "service": service,
            "counters": dict(metrics.COUNTERS),
            "gauges": dict(metrics.GAUGES),
            "http_port": HTTP.get("port"),
        }
        if extra is not None:
            out.update(await extra())
        return out

    await bus.serve(nc, subjects.stats(service), {StatsGet: answer}, queue=service, check_silo=False)
    endpoint.serving = True


async def serve_faults(nc: Any, service: str) -> None:
    """Answer `rp.svc.<service>.faults`: set or read this process's fault injection (shared/faults.py).

    Only when the process was started with fault injection enabled (RACKPLANE_FAULTS=1): otherwise it
    does not even subscribe, and a request finds no responder. The broker lets only the test identity
    send these requests (deploy/identities.py).
    Every replica of the service subscribes (no queue group), so that each applies what it is asked; the
    requester sees the first reply.
    """
    from shared import bus
    from shared.faults import FAULTS, install
    from shared.messages import ServiceFaults
    from shared.topology import subjects

    if not settings().faults:
        return
    install()

    async def answer(body: ServiceFaults, msg: Any) -> dict[str, Any]:
        FAULTS.configure(body)
        if body.clear or any(value is not None for name, value in body if name != "clear"):
            log.warning("%s: fault injection %s", service, FAULTS.describe()["faults"])
        return {"service": service, **FAULTS.describe()}

    log.warning("%s: fault injection enabled (RACKPLANE_FAULTS)", service)
    await bus.serve(nc, subjects.faults(service), {ServiceFaults: answer}, queue="", check_silo=False)


async def connect_bus(settings: Settings, service: str, identity: str | None = None) -> tuple[Any, Any]:
    """The service's NATS connection (with its own credential and inbox) and JetStream context.

    The streams are not created here: deploy does that with its stream-administrator identity
    (deploy/streams.py), and no service holds stream-management rights.
    """
    from shared import bus
    from shared.topology import subjects

    nc = await bus.connect(
        settings.nats_url,
        service,
        seed_file=settings.nats_nkey_file,
        inbox_prefix=subjects.inbox_prefix(identity or service),
        ca_file=settings.nats_ca_file,
        on_closed=stop_for,
    )

    async def connected() -> None:
        if not nc.is_connected:
            raise ConnectionError("not connected" if not nc.is_closed else "connection closed")

    endpoint.check("nats", connected)
    return nc, nc.jetstream()


async def open_database(settings: Settings, schema: str, migrations: Path) -> Any:
    """A pool on the service's own schema, the migrations of the folder `migrations` applied, or
    (RACKPLANE_MIGRATE=skip) found applied already; with RACKPLANE_MIGRATE=only, the process stops once
    they are (`Migrated`). The service names its own folder: shared/ knows no service."""
    from shared import db

    pool = await db.create_pool(settings.database_url, schema)
    try:
        if settings.migrations == "skip":
            async with pool.acquire() as conn:
                db.require_current(schema, await db.migration_states(conn, migrations))
            return pool
        applied = await db.migrate(pool, schema, migrations, lock_timeout=settings.migration_lock_timeout)
        if applied:
            log.info("%s: applied %s", schema, ", ".join(applied))
        if settings.migrations == "only":
            raise Migrated(
                f"schema {schema} is current ({len(applied)} applied now); exiting (RACKPLANE_MIGRATE=only)"
            )
    except BaseException:
        await pool.close()
        raise

    async def answers() -> None:
        await pool.fetchval("SELECT 1", timeout=endpoint.TIMEOUT)

    endpoint.check("database", answers)
    return pool
