"""PostgreSQL, the way every service uses it: a pool confined to the service's own schema, migrations
kept as plain .sql files next to the code that uses them, named queries loaded from .sql files, and the
transactional outbox.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_BATCH_MESSAGE_COUNT,
    MESSAGING_MESSAGE_ID,
    MessagingOperationTypeValues,
)
from opentelemetry.semconv.attributes.db_attributes import (
    DB_NAMESPACE,
    DB_OPERATION_NAME,
    DB_QUERY_SUMMARY,
    DB_QUERY_TEXT,
    DB_SYSTEM_NAME,
    DbSystemNameValues,
)
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared import metrics, telemetry
from shared.bus import MSG_ID, BulkPublisher, msg_id_for
from shared.errors import transient
from shared.faults import FAULTS
from shared.messages import Model, encode_envelope

log = logging.getLogger(__name__)

SHARED_SQL = Path(__file__).parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


_QUERY_NAMES: dict[str, str] = {}
"""A named query's text -> its name, for the name of its span."""


@cache
def queries(path: Path) -> dict[str, str]:
    """Named queries of a .sql file: each starts with a `-- name: NAME` line."""
    text = path.read_text()
    parts = _NAME.split(text)
    named = {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    _QUERY_NAMES.update({body: name for name, body in named.items()})
    return named


def _json(value: Any) -> str:
    return json.dumps(value, default=str)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a connection goes back to its pool with: as it is (asyncpg has rolled back a transaction left
    open). asyncpg's own reset sends `pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every
    release, a round trip each time a pool connection is used; nothing here leaves that state on a pooled
    connection (`migrate` resets its role, lock timeout and lock itself; saga and pass locks have their
    own connections)."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=_json, decoder=json.loads, schema="pg_catalog")
    if telemetry.tracing():
        conn.add_query_logger(_query_span)


_FIRST_WORD = re.compile(r"\s*(?:--[^\n]*\n\s*)*([A-Za-z]+)")


def _query_span(q: Any) -> None:
    """A CLIENT span for one query that just ran (asyncpg's query logger, an `asyncpg.LoggedQuery`), in
    the span that ran it; a query outside any span (a poll of the outbox, a migration) makes none, since
    a trace follows an operation.

    asyncpg calls its loggers soon after the query, in a copy of the query's context, so the span has
    the span that ran the query as its parent; it is made after the fact, with the query's own timing.
    There is no OpenTelemetry instrumentation of asyncpg for this SDK's version, so these spans are made
    here, with the database conventions' attributes.
    """
    if not trace.get_current_span().get_span_context().is_valid:
        return
    end = time.time_ns()
    operation = m[1].upper() if (m := _FIRST_WORD.match(q.query)) else "QUERY"
    database = getattr(q.conn_params, "database", None) or ""
    summary = _QUERY_NAMES.get(q.query)
    attributes: dict[str, Any] = {
        DB_SYSTEM_NAME: DbSystemNameValues.POSTGRESQL.value,
        DB_NAMESPACE: database,
        DB_OPERATION_NAME: operation,
        DB_QUERY_TEXT: q.query,
    }
    if summary:
        attributes[DB_QUERY_SUMMARY] = summary
    if isinstance(q.conn_addr, tuple):
        attributes[SERVER_ADDRESS], attributes[SERVER_PORT] = q.conn_addr[0], q.conn_addr[1]
    span = telemetry.tracer.start_span(
        summary or f"{operation} {database}".strip(),
        kind=SpanKind.CLIENT,
        attributes=attributes,
        start_time=end - int(q.elapsed * 1e9),
    )
    if q.exception is not None:
        span.set_attribute(ERROR_TYPE, type(q.exception).__qualname__)
        span.set_status(Status(StatusCode.ERROR, str(q.exception)))
    span.end(end_time=end)


async def create_pool(dsn: str, schema: str, *, min_size: int = 0, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections see only `schema` (the service's own tables) by default. The first
    connection is retried for 30 s while the database is away: not up yet, or, on a multi-host DSN with
    target_session_attrs=read-write (PostgreSQL under Patroni), no node takes writes for the moment of a
    failover (asyncpg's TargetServerAttributeNotMatched)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            conn = await asyncpg.connect(dsn)
            break
        except Exception as e:
            if not (transient(e) or isinstance(e, asyncpg.PostgresError)):
                raise
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
        reset=_keep_session,
        server_settings={"search_path": schema, "application_name": schema},
    )
    assert pool is not None
    return pool


# --- migrations ------------------------------------------------------------------------------------------


class MigrationError(Exception):
    """A schema that cannot be brought up to date as asked; one line that names the schema and the file."""


@dataclass(frozen=True)
class Migration:
    """One NNN_*.sql file of a schema, and what `schema_migrations` says of it."""

    name: str
    """`shared/001_outbox.sql` or `<service>/NNN_name.sql`, as recorded."""
    path: Path | None
    """None: recorded as applied, but no such file here (a newer version of the code applied it)."""
    checksum: str | None
    """sha256 of the file, hex."""
    applied_at: datetime | None = None
    recorded: str | None = None
    """The checksum recorded when it was applied (None for one applied before checksums were kept)."""

    @property
    def state(self) -> str:
        if self.applied_at is None:
            return "pending"
        if self.path is None:
            return "unknown"
        if self.recorded is not None and self.recorded != self.checksum:
            return "changed"
        return "applied"


def migration_files(*dirs: Path) -> list[tuple[str, Path]]:
    """(name, path) of every migration of a schema in the order they apply: the shared ones first."""
    files = sorted(SHARED_SQL.glob("[0-9][0-9][0-9]_*.sql"), key=lambda p: p.name)
    for d in dirs:
        files += sorted(d.glob("[0-9][0-9][0-9]_*.sql"), key=lambda p: p.name)
    return [
        (f"{f.parent.parent.name}/{f.name}" if f.parent != SHARED_SQL else f"shared/{f.name}", f)
        for f in files
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def migration_states(conn: asyncpg.Connection, *dirs: Path) -> list[Migration]:
    """Every migration of the schema on `conn`'s search_path, in order, then any applied that has no file
    here. Reads only (the checker's read-only login can call it)."""
    recorded: dict[str, asyncpg.Record] = {}
    if await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL"):
        rows = await conn.fetch(
            "SELECT name, applied_at, to_jsonb(m) ->> 'checksum' AS checksum FROM schema_migrations m"
        )
        recorded = {r["name"]: r for r in rows}
    out = []
    for name, path in migration_files(*dirs):
        r = recorded.pop(name, None)
        applied_at, checksum = (r["applied_at"], r["checksum"]) if r else (None, None)
        out.append(Migration(name, path, _sha256(path), applied_at, checksum))
    out += [Migration(n, None, None, r["applied_at"], r["checksum"]) for n, r in sorted(recorded.items())]
    return out


def refuse_changed(schema: str, states: list[Migration]) -> None:
    """A migration changed after it was applied: the schema is not what the files say, so nothing runs."""
    for m in states:
        if m.state == "changed":
            assert m.recorded and m.checksum
            raise MigrationError(
                f"schema {schema}: {m.name} changed after it was applied (sha256 {m.recorded[:12]} applied, "
                f"{m.checksum[:12]} now): restore it, and make the change a new migration"
            )


def require_current(schema: str, states: list[Migration]) -> None:
    """For a process that must not migrate (RACKPLANE_MIGRATE=skip): refuse a schema that is not current."""
    refuse_changed(schema, states)
    pending = [m.name for m in states if m.state == "pending"]
    if pending:
        many = len(pending) > 1
        raise MigrationError(
            f"schema {schema}: {len(pending)} migration{'s' if many else ''} pending ({', '.join(pending)}): "
            f"apply {'them' if many else 'it'} first (python -m shared.migrate {schema}, or "
            "RACKPLANE_MIGRATE=only), or start with RACKPLANE_MIGRATE=auto"
        )


async def migrate(pool: asyncpg.Pool, schema: str, *dirs: Path, lock_timeout: float = 10.0) -> list[str]:
    """Apply the NNN_*.sql files of `dirs` not yet applied to `schema`, each in its own transaction, and
    record each one's sha256; refuse (MigrationError) if an applied file has changed since.

    The shared outbox migration comes first. An advisory lock per schema lets several replicas start at
    once: the first applies, the others wait and then find nothing to do. Each migration waits at most
    `lock_timeout` seconds for a table lock (a migration queued behind a long transaction would block
    every query behind it); when it cannot get one it is rolled back, whole. Where the schema's owner role
    exists (deploy/sql/roles_service.sql), they run as it (`SET ROLE`), so that the owner owns every
    table and the service's own role keeps only DML. Returns the names applied now.
    """
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock(hashtext($1))", f"migrate:{schema}")
        owner = owner_role(schema)
        if await conn.fetchval(_CAN_BECOME, owner):
            await conn.execute(f'SET ROLE "{owner}"')
        await conn.execute("SELECT set_config('lock_timeout', $1, false)", f"{round(lock_timeout * 1000)}ms")
        try:
            if not await conn.fetchval(_MAY_CREATE, schema):
                raise MigrationError(
                    f"schema {schema}: {await conn.fetchval('SELECT current_user')} may not create in it: "
                    "migrate it with its own service's login (a member of its owner role) or an "
                    "administrator's"
                )
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now(), checksum text)"
            )
            if not await conn.fetchval(_HAS_CHECKSUM):  # made before checksums were kept
                await conn.execute("ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS checksum text")
            states = await migration_states(conn, *dirs)
            refuse_changed(schema, states)
            for m in states:
                if m.state == "applied" and m.recorded is None:  # applied before checksums: trusted as it is
                    await conn.execute(_RECORD_CHECKSUM, m.name, m.checksum)
            for m in (m for m in states if m.state == "pending"):
                assert m.path is not None
                try:
                    async with conn.transaction():
                        await conn.execute(m.path.read_text())
                        await conn.execute(
                            "INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)",
                            m.name,
                            m.checksum,
                        )
                except asyncpg.LockNotAvailableError:
                    raise MigrationError(
                        f"schema {schema}: {m.name} waited over {lock_timeout:g}s for a lock "
                        "(RACKPLANE_MIGRATE_LOCK_TIMEOUT) and was rolled back: retry once the transaction "
                        "holding it ends"
                    ) from None
                except asyncpg.PostgresError as e:
                    raise MigrationError(
                        f"schema {schema}: {m.name} failed and was rolled back: {e}"
                    ) from None
                applied_now.append(m.name)
        finally:
            await conn.execute("RESET lock_timeout")
            await conn.execute("RESET ROLE")
            await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", f"migrate:{schema}")
    return applied_now


_MAY_CREATE = (
    "SELECT CASE WHEN to_regnamespace($1::text) IS NULL THEN false "
    "ELSE has_schema_privilege($1::text, 'CREATE') END"
)
_HAS_CHECKSUM = (
    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'schema_migrations'::regclass "
    "AND attname = 'checksum' AND NOT attisdropped)"
)
_RECORD_CHECKSUM = "UPDATE schema_migrations SET checksum = $2 WHERE name = $1 AND checksum IS NULL"
_CAN_BECOME = (
    "SELECT CASE WHEN to_regrole($1::text) IS NULL THEN false "
    "ELSE pg_has_role(current_user, $1::name, 'MEMBER') END"
)


def owner_role(schema: str) -> str:
    """The NOLOGIN role that owns `schema` and runs its migrations (deploy/sql/roles_service.sql)."""
    return f"{schema}_owner"


# --- transactional outbox ------------------------------------------------------------------------------

OUTBOX = SHARED_SQL / "outbox.sql"
ACK_TIMEOUT = 10.0
"""How long the relay waits for JetStream to ack what it published, before it tries again."""


async def enqueue(
    conn: asyncpg.Connection, subject: str, body: Model, *, source: str, key: str | None = None
) -> None:
    """Write a message to publish once the caller's transaction commits. `key` makes its id stable.

    Its `create` span (PRODUCER) is the context the message carries: the consumer's span is its child."""
    msg_id = msg_id_for(key) if key else uuid.uuid4()
    with telemetry.messaging_span(
        subject,
        MessagingOperationTypeValues.CREATE,
        SpanKind.PRODUCER,
        **{MESSAGING_MESSAGE_ID: str(msg_id)},
    ):
        await conn.execute(
            queries(OUTBOX)["enqueue"],
            msg_id,
            subject,
            encode_envelope(body, source, msg_id),
            telemetry.inject({MSG_ID: str(msg_id)}),
        )


async def enqueue_many(
    conn: asyncpg.Connection, messages: list[tuple[str, Model, str | None]], *, source: str
) -> None:
    """`enqueue` for many (subject, body, key) at once, in their order, in one statement. They share the
    caller's trace context, so their headers are made once (the relay adds each one's message id)."""
    if not messages:
        return
    ids = [msg_id_for(key) if key else uuid.uuid4() for _, _, key in messages]
    with telemetry.messaging_span(
        messages[0][0],
        MessagingOperationTypeValues.CREATE,
        SpanKind.PRODUCER,
        **{MESSAGING_BATCH_MESSAGE_COUNT: len(messages)},
    ):
        await conn.execute(
            queries(OUTBOX)["enqueue_many"],
            ids,
            [subject for subject, _, _ in messages],
            [encode_envelope(body, source, i) for (_, body, _), i in zip(messages, ids, strict=True)],
            telemetry.inject({}),
        )


class OutboxRelay:
    """Publishes committed outbox rows to JetStream in order, then deletes them.

    A row is deleted only after JetStream acknowledged it; a crash in between publishes it again with the
    same Nats-Msg-Id, which the broker drops as a duplicate inside its window (and consumers are
    idempotent beyond it). "In order" holds per relay: two replicas' relays share an outbox (SKIP LOCKED)
    and may interleave their rows, so consumers never rely on order across a service's replicas.
    """

    def __init__(self, pool: asyncpg.Pool, nc: NATS, js: JetStreamContext, *, batch: int = 1000) -> None:
        self.pool = pool
        self.js = js
        self.publisher = BulkPublisher(nc)
        self.batch = batch
        self.wake = asyncio.Event()
        metrics.sampler(self.sample_depth)

    async def sample_depth(self) -> None:
        """The outbox's depth (rows committed, not yet published), for /metrics and stats."""
        metrics.gauge("outbox.depth", await self.pool.fetchval(queries(OUTBOX)["pending"]))

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
            await self._publish(
                [(r["subject"], r["payload"], {**r["headers"], MSG_ID: str(r["msg_id"])}) for r in rows]
            )
            await conn.execute(q["delete"], [r["seq"] for r in rows])
        telemetry.count("outbox.published", len(rows))
        return len(rows)

    async def _publish(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """Publish the rows and wait for every ack; through the fault layer when it is on (it may delay,
        copy, reorder or refuse them: the rows stay until their acks, so a refused or lost publish is sent
        again by a later drain)."""
        if FAULTS.faults_any_outgoing(subject for subject, _, _ in messages):
            acks = [await FAULTS.publish_async(self.js, *m) for m in messages]
            await asyncio.wait_for(asyncio.gather(*acks), timeout=ACK_TIMEOUT)
        else:
            await self.publisher.publish(messages, timeout=ACK_TIMEOUT)


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


T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """Requests that arrive while a batch of them is being applied wait, and go together in the next one:
    one transaction for many, as a database's group commit does. Each statement costs a round trip
    whatever it carries (docs/benchmarks.md), so a burst of small orders costs about as much as one.

    `apply` takes the requests, in arrival order, and returns one result each. A batch that fails is
    tried again one request at a time, so that a request that cannot be applied fails alone."""

    def __init__(self, apply: Callable[[list[T]], Awaitable[list[R]]], *, most: int) -> None:
        self.apply = apply
        self.most = most
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def __call__(self, request: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[: self.most], self._waiting[self.most :]
            await self._settle(batch)

    async def _settle(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self.apply([request for request, _ in batch])
        except Exception as e:
            if len(batch) > 1:
                for one in batch:
                    await self._settle([one])
                return
            if not batch[0][1].done():
                batch[0][1].set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its caller may have given up
                future.set_result(result)
