"""A service's connection pool: confined to its own schema, jsonb as Python values, and a span for each
query run inside a traced operation."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import asyncpg
from opentelemetry import trace
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

from shared import telemetry
from shared.db.queries import QUERY_NAMES, queries
from shared.errors import transient

SQL = Path(__file__).parent / "pool.sql"


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
    summary = QUERY_NAMES.get(q.query)
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
        if not await conn.fetchval(queries(SQL)["schema_exists"], schema):
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
