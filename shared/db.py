"""PostgreSQL, the way every service uses it: a pool confined to the service's own schema, migrations
kept as plain .sql files next to the code that uses them, named queries loaded from .sql files, and the
transactional outbox.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from functools import cache
from pathlib import Path
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from shared import telemetry
from shared.bus import MSG_ID, headers_for, msg_id_for
from shared.faults import FAULTS
from shared.messages import Model, encode, envelope

log = logging.getLogger(__name__)

SHARED_SQL = Path(__file__).parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


@cache
def queries(path: Path) -> dict[str, str]:
    """Named queries of a .sql file: each starts with a `-- name: NAME` line."""
    text = path.read_text()
    parts = _NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def _json(value: Any) -> str:
    return json.dumps(value, default=str)


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=_json, decoder=json.loads, schema="pg_catalog")


async def create_pool(dsn: str, schema: str, *, min_size: int = 0, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections see only `schema` (the service's own tables) by default."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            conn = await asyncpg.connect(dsn)
            break
        except (OSError, asyncpg.PostgresError) as e:
            if asyncio.get_running_loop().time() > deadline:
                raise ConnectionError(f"cannot reach postgres: {e}") from e
            await asyncio.sleep(0.25)
    try:
        # Made by deploy/sql/roles_service.sql where roles are in force (the service's role cannot create
        # schemas); made here only for a database given with rights to do so.
        if not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", schema):
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    except asyncpg.UniqueViolationError:
        pass  # two services creating their schemas at once
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        init=_init_connection,
        server_settings={"search_path": schema, "application_name": schema},
    )
    assert pool is not None
    return pool


async def migrate(pool: asyncpg.Pool, schema: str, *dirs: Path) -> list[str]:
    """Apply the NNN_*.sql files of `dirs` not yet applied to `schema`, each in its own transaction.

    The shared outbox migration comes first. An advisory lock per schema lets several replicas start at
    once. Where the schema's owner role exists (deploy/sql/roles_service.sql), they run as it (`SET ROLE`),
    so that the owner owns every table and the service's own role keeps only DML. Returns the names
    applied now.
    """
    files = sorted(SHARED_SQL.glob("[0-9][0-9][0-9]_*.sql"), key=lambda p: p.name)
    for d in dirs:
        files += sorted(d.glob("[0-9][0-9][0-9]_*.sql"), key=lambda p: p.name)
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock(hashtext($1))", f"migrate:{schema}")
        owner = owner_role(schema)
        if await conn.fetchval(_CAN_BECOME, owner):
            await conn.execute(f'SET ROLE "{owner}"')
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
            for f in files:
                name = f"{f.parent.parent.name}/{f.name}" if f.parent != SHARED_SQL else f"shared/{f.name}"
                if name in done:
                    continue
                async with conn.transaction():
                    await conn.execute(f.read_text())
                    await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", name)
                applied_now.append(name)
        finally:
            await conn.execute("RESET ROLE")
            await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", f"migrate:{schema}")
    return applied_now


_CAN_BECOME = (
    "SELECT CASE WHEN to_regrole($1::text) IS NULL THEN false "
    "ELSE pg_has_role(current_user, $1::name, 'MEMBER') END"
)


def owner_role(schema: str) -> str:
    """The NOLOGIN role that owns `schema` and runs its migrations (deploy/sql/roles_service.sql)."""
    return f"{schema}_owner"


# --- transactional outbox ------------------------------------------------------------------------------

OUTBOX = SHARED_SQL / "outbox.sql"


async def enqueue(
    conn: asyncpg.Connection, subject: str, body: Model, *, source: str, key: str | None = None
) -> None:
    """Write a message to publish once the caller's transaction commits. `key` makes its id stable."""
    env = envelope(body, source, msg_id_for(key) if key else None)
    await conn.execute(queries(OUTBOX)["enqueue"], env.id, subject, encode(env), headers_for(env))


async def enqueue_many(
    conn: asyncpg.Connection, messages: list[tuple[str, Model, str | None]], *, source: str
) -> None:
    """`enqueue` for many (subject, body, key) at once, in their order, in one statement. They share the
    caller's trace context, so their headers are made once (the relay adds each one's message id)."""
    if not messages:
        return
    envs = [
        (subject, envelope(body, source, msg_id_for(key) if key else None)) for subject, body, key in messages
    ]
    await conn.execute(
        queries(OUTBOX)["enqueue_many"],
        [e.id for _, e in envs],
        [subject for subject, _ in envs],
        [encode(e) for _, e in envs],
        telemetry.inject({}),
    )


class OutboxRelay:
    """Publishes committed outbox rows to JetStream in order, then deletes them.

    A row is deleted only after JetStream acknowledged it; a crash in between publishes it again with the
    same Nats-Msg-Id, which the broker drops as a duplicate inside its window (and consumers are
    idempotent beyond it).
    """

    def __init__(self, pool: asyncpg.Pool, js: JetStreamContext, *, batch: int = 1000) -> None:
        self.pool = pool
        self.js = js
        self.batch = batch
        self.wake = asyncio.Event()

    def kick(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        while True:
            try:
                sent = await self.drain_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("outbox relay: %s; retrying", e)
                telemetry.count("outbox.errors")
                sent = 0
                await asyncio.sleep(0.5)
            if sent < self.batch:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=0.05)
                except TimeoutError:
                    pass

    async def drain_once(self) -> int:
        q = queries(OUTBOX)
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(q["claim"], self.batch)
            if not rows:
                return 0
            acks = [await self._publish(r) for r in rows]
            await asyncio.wait_for(asyncio.gather(*acks), timeout=10)
            await conn.execute(q["delete"], [r["seq"] for r in rows])
        telemetry.count("outbox.published", len(rows))
        return len(rows)

    async def _publish(self, row: asyncpg.Record) -> asyncio.Future[Any]:
        """Publish one row, through the fault layer when it is on (it may delay, copy, reorder or refuse
        it: the row stays until its ack, so a refused or lost publish is sent again by a later drain)."""
        headers = {**row["headers"], MSG_ID: str(row["msg_id"])}
        if FAULTS.active:
            return await FAULTS.publish_async(self.js, row["subject"], row["payload"], headers)
        return await self.js.publish_async(row["subject"], row["payload"], headers=headers)


class PassLock:
    """One pass at a time across replicas: a session advisory lock on a connection of its own, so that it
    is released the moment its process dies. `async with lock as mine:` — `mine` says whether this
    replica got the pass."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn = dsn
        self.name = name
        self._conn: asyncpg.Connection | None = None
        self._held = False

    async def __aenter__(self) -> bool:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(self.dsn)
        try:
            self._held = bool(
                await self._conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", self.name)
            )
        except Exception:
            self._conn = None
            raise
        return self._held

    async def __aexit__(self, *exc: object) -> None:
        if self._held and self._conn is not None and not self._conn.is_closed():
            try:
                await self._conn.execute("SELECT pg_advisory_unlock(hashtext($1))", self.name)
            except Exception:
                self._conn = None  # the lock went with the connection
        self._held = False
