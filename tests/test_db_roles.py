"""Database roles (deploy/sql/roles_*.sql), against the real PostgreSQL of the session's stack: each
service's login reaches only its own schema, `rackctl check`'s login only reads, nobody connects as a
superuser, and only an owner creates anything.
"""

from __future__ import annotations

import itertools
import os
import pwd
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from deploy.dbroles import SCHEMAS
from deploy.stack import Postgres, Stack
from shared.db import owner_role
from tests.test_cli import assert_ok, rackctl

DENIED = (asyncpg.InsufficientPrivilegeError, asyncpg.ReadOnlySQLTransactionError)
# A table each service has: a migration bookkeeping table, made by shared/db/migrations.py in every schema.
TABLE = "schema_migrations"


async def connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(url)


def over_tcp(stack: Stack, url: str) -> str:
    """`url`, the same login, through the cluster's TCP port instead of its Unix socket."""
    assert stack.postgres is not None
    parts = urlsplit(url)
    login = parts.netloc.rpartition("@")[0]
    return urlunsplit((parts.scheme, f"{login}@127.0.0.1:{stack.postgres.port}", parts.path, "", ""))


@pytest.mark.parametrize(("mine", "other"), list(itertools.permutations(SCHEMAS, 2)))
async def test_a_service_cannot_read_or_write_another_services_schema(
    stack: Stack, mine: str, other: str
) -> None:
    conn = await connect(stack.service_database_urls[mine])
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetch(f"SELECT * FROM {other}.{TABLE} LIMIT 1")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f"INSERT INTO {other}.{TABLE} (name) VALUES ('forged')")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f"CREATE TABLE {other}.forged (x int)")
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_service_has_dml_on_its_own_schema_and_ddl_as_its_owner(stack: Stack, schema: str) -> None:
    conn = await connect(stack.service_database_urls[schema])
    try:
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {schema}.{TABLE} (name) VALUES ('probe')")
            assert await conn.fetchval(f"DELETE FROM {schema}.{TABLE} WHERE name = 'probe' RETURNING 1") == 1
        for ddl in (f"CREATE TABLE {schema}.scratch (x int)", f"DROP TABLE {schema}.{TABLE}"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(ddl)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE TABLE public.scratch (x int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE SCHEMA scratch")
        # Migrations: as the owner (in a transaction rolled back here), DDL on its own schema only.
        tr = conn.transaction()
        await tr.start()
        try:
            await conn.execute(f'SET LOCAL ROLE "{owner_role(schema)}"')
            await conn.execute(f"CREATE TABLE {schema}.scratch (x int)")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("CREATE TABLE public.scratch (x int)")
        finally:
            await tr.rollback()
        others = [s for s in SCHEMAS if s != schema]
        for other in others:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(f'SET ROLE "{owner_role(other)}"')
    finally:
        await conn.close()


async def test_the_checker_reads_every_schema_and_cannot_write(stack: Stack) -> None:
    assert stack.database_url is not None
    conn = await connect(stack.database_url)
    try:
        for schema in SCHEMAS:
            assert await conn.fetchval(f"SELECT count(*) FROM {schema}.{TABLE}") > 0
            with pytest.raises(DENIED):
                await conn.execute(f"INSERT INTO {schema}.{TABLE} (name) VALUES ('forged')")
            with pytest.raises(DENIED):
                await conn.execute(f"SET default_transaction_read_only = off; DELETE FROM {schema}.{TABLE}")
            with pytest.raises(DENIED):
                await conn.execute(f"CREATE TABLE {schema}.forged (x int)")
            await conn.execute("RESET default_transaction_read_only")
        with pytest.raises(DENIED):
            await conn.execute("CREATE TABLE public.forged (x int)")
    finally:
        await conn.close()


async def test_the_checker_cannot_write_even_in_a_session_it_made_read_write(stack: Stack) -> None:
    """Issue 29: a session may turn `transaction_read_only` off, so the read-only setting is not what keeps
    the checker from writing: it holds no privilege that writes, not even TEMP or a large object."""
    assert stack.database_url is not None
    conn = await connect(stack.database_url)
    try:
        await conn.execute("SET default_transaction_read_only = off")
        await conn.execute("SET transaction_read_only = off")
        assert await conn.fetchval("SHOW transaction_read_only") == "off"
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE TEMP TABLE scratch (x int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetchval("SELECT lo_create(0)")
        for schema in SCHEMAS:
            for write in (
                f"INSERT INTO {schema}.{TABLE} (name) VALUES ('forged')",
                f"UPDATE {schema}.{TABLE} SET name = name",
                f"DELETE FROM {schema}.{TABLE}",
                f"TRUNCATE {schema}.{TABLE}",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(write)
        assert not await conn.fetchval(
            "SELECT has_database_privilege(current_user, current_database(), 'TEMP')"
        )
        writes = await conn.fetch(
            "SELECT table_schema, table_name, privilege_type FROM information_schema.table_privileges "
            "WHERE grantee IN (current_user, 'PUBLIC') AND privilege_type <> 'SELECT' "
            "AND table_schema = ANY($1::text[])",
            list(SCHEMAS),
        )
        assert writes == []
    finally:
        await conn.close()


async def test_rackctl_check_runs_as_the_read_only_role(stack: Stack) -> None:
    assert stack.database_url is not None
    assert_ok(await rackctl(stack, "check", "--no-at-rest", DATABASE_URL=stack.database_url))


async def test_no_service_connects_as_a_superuser(stack: Stack) -> None:
    assert stack.admin_database_url is not None
    conn = await connect(stack.admin_database_url)
    try:
        rows = await conn.fetch(
            "SELECT a.usename, r.rolsuper FROM pg_stat_activity a JOIN pg_roles r ON r.oid = a.usesysid "
            "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    users = {r["usename"] for r in rows}
    assert set(SCHEMAS) <= users, f"every service has a connection of its own role: {users}"
    assert not [r["usename"] for r in rows if r["rolsuper"]], rows


async def test_the_services_beside_the_database_reach_it_through_its_unix_socket(stack: Stack) -> None:
    """The one-machine stack's logins name the cluster's socket (a tenth to a fifth less CPU a round trip
    than loopback TCP), still with their passwords (`test_a_wrong_password_is_refused` goes through it)."""
    assert stack.admin_database_url is not None and isinstance(stack.postgres, Postgres)
    if (sockets := stack.postgres.socket_dir) is None:
        pytest.skip(f"{stack.postgres.dir}: too long, or not plain enough, for a socket's folder")
    assert f"?host={sockets}&" in stack.service_database_urls["instance_manager"]
    conn = await connect(stack.admin_database_url)
    try:
        rows = await conn.fetch(
            "SELECT usename, client_addr FROM pg_stat_activity "
            "WHERE datname = current_database() AND usename = ANY($1::text[])",
            list(SCHEMAS),
        )
    finally:
        await conn.close()
    assert {r["usename"] for r in rows} == set(SCHEMAS)
    assert [r["client_addr"] for r in rows] == [None] * len(rows), "none over TCP"


async def test_no_login_but_the_administrator_is_privileged(stack: Stack) -> None:
    """Roles: the service logins and the checker are plain; the owners cannot log in; no one is trusted."""
    assert stack.admin_database_url is not None
    conn = await connect(stack.admin_database_url)
    try:
        roles = {
            r["rolname"]: r
            for r in await conn.fetch("SELECT * FROM pg_roles WHERE rolname NOT LIKE 'pg\\_%'")
        }
        method = await conn.fetch("SELECT DISTINCT auth_method FROM pg_hba_file_rules")
    finally:
        await conn.close()
    for schema in SCHEMAS:
        app, owner = roles[schema], roles[owner_role(schema)]
        assert app["rolcanlogin"] and not app["rolinherit"]
        assert not owner["rolcanlogin"]
        for r in (app, owner):
            assert not (r["rolsuper"] or r["rolcreaterole"] or r["rolcreatedb"] or r["rolbypassrls"])
    assert {r["auth_method"] for r in method} == {"scram-sha-256"}


async def test_a_wrong_password_is_refused(stack: Stack) -> None:
    from deploy.dbroles import with_login

    assert stack.database_url is not None
    with pytest.raises(asyncpg.InvalidPasswordError):
        await connect(with_login(stack.database_url, "accounting", "guessed"))


def test_the_compose_steps_make_logins_that_survive_a_second_up(tmp_path: Path) -> None:
    """deploy/dbroles.py as docker-compose.yml runs it: `secrets` once, then `apply` at every `up`, which
    keeps the passwords already written (running services keep working)."""
    from deploy.dbroles import _compose
    from deploy.stack import SUPERUSER_PASSWORD, Postgres, run_sync

    pg = Postgres(tmp_path / "pg").start()
    try:
        logins = tmp_path / "logins"
        logins.mkdir()
        (logins / "postgres.password").write_text((pg.data / SUPERUSER_PASSWORD).read_text())
        me = pwd.getpwuid(os.getuid()).pw_name
        args = ["apply", "--dir", str(logins), "--host", "127.0.0.1", "--port", str(pg.port), "--owner", me]
        _compose(args)
        first = {p.name: p.read_text() for p in logins.glob("*.url")}
        assert set(first) == {f"{s}.url" for s in SCHEMAS} | {"check.url"}
        _compose(args)
        assert {p.name: p.read_text() for p in logins.glob("*.url")} == first
        assert all((logins / name).stat().st_mode & 0o777 == 0o600 for name in first)

        async def whoami(url: str) -> str:
            conn = await asyncpg.connect(url)
            try:
                return await conn.fetchval("SELECT current_user")
            finally:
                await conn.close()

        for name, url in first.items():
            expected = "rackplane_check" if name == "check.url" else name.removesuffix(".url")
            assert run_sync(whoami(url.strip())) == expected
    finally:
        pg.stop()


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_services_session_does_not_outlive_its_machine(stack: Stack, schema: str) -> None:
    """A service's machine that vanishes (no FIN, no RST) leaves its backends holding their locks until the
    server notices: keepalives probe an idle peer within seconds, and a session left idle inside a
    transaction (a frozen process) is ended, so a copy of a command waiting on its claim, or a replica
    waiting on a pass's lock, waits seconds, not the kernel's two hours. Asked over TCP: the keepalives
    are TCP's (the services beside the one-machine stack's cluster use its socket, which closes with them)."""
    conn = await connect(over_tcp(stack, stack.service_database_urls[schema]))
    try:
        said = {
            name: await conn.fetchval(f"SHOW {name}")
            for name in (
                "tcp_keepalives_idle",
                "tcp_keepalives_interval",
                "tcp_keepalives_count",
                "idle_in_transaction_session_timeout",
            )
        }
    finally:
        await conn.close()
    assert said == {
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "3",
        "idle_in_transaction_session_timeout": "1min",
    }
