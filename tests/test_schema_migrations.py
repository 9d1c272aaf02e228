"""Migrations an operator can trust, against a real PostgreSQL: each applied file's sha256 is kept and a
changed file is refused, a migration waits for a lock only so long, replicas apply each file once, and
RACKPLANE_MIGRATE lets one step migrate while the services only check (`python -m deploy.migrations`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from deploy import dbroles
from deploy.migrations import SCHEMAS, migrations_dir
from deploy.stack import Postgres, run_sync
from shared import db

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Postgres, dict[str, str]]]:
    """A cluster of its own with the stack's roles: the superuser's URL and each login's."""
    folder = tmp_path_factory.mktemp("migrations")
    cluster = Postgres(folder / "pg").start()
    try:
        yield cluster, run_sync(dbroles.provision(cluster.url, folder / "logins"))
    finally:
        cluster.stop()


@pytest.fixture
async def scratch(
    pg: tuple[Postgres, dict[str, str]], tmp_path: Path
) -> AsyncIterator[tuple[asyncpg.Pool, str, Path]]:
    """A fresh schema (as the superuser) and an empty folder of migrations for it, `svc/migrations`."""
    schema = f"scratch_{uuid.uuid4().hex[:8]}"
    pool = await db.create_pool(pg[0].url, schema, max_size=4)
    folder = tmp_path / "svc" / "migrations"
    folder.mkdir(parents=True)
    try:
        yield pool, schema, folder
    finally:
        await pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await pool.close()


async def test_each_applied_file_is_recorded_with_its_checksum_and_a_changed_one_is_refused(
    scratch: tuple[asyncpg.Pool, str, Path],
) -> None:
    pool, schema, folder = scratch
    (folder / "001_things.sql").write_text("CREATE TABLE things (id int PRIMARY KEY);")
    assert await db.migrate(pool, schema, folder) == ["shared/001_outbox.sql", "svc/001_things.sql"]
    rows = {
        r["name"]: r["checksum"] for r in await pool.fetch("SELECT name, checksum FROM schema_migrations")
    }
    assert rows["svc/001_things.sql"] == hashlib.sha256((folder / "001_things.sql").read_bytes()).hexdigest()
    assert await db.migrate(pool, schema, folder) == []

    (folder / "002_more.sql").write_text("ALTER TABLE things ADD COLUMN label text;")
    (folder / "001_things.sql").write_text("CREATE TABLE things (id bigint PRIMARY KEY);")
    with pytest.raises(db.MigrationError) as refused:
        await db.migrate(pool, schema, folder)
    line = str(refused.value)
    assert (
        line.startswith(f"schema {schema}: svc/001_things.sql changed after it was applied")
        and "\n" not in line
    )
    assert "002_more" not in {r["name"] for r in await pool.fetch("SELECT name FROM schema_migrations")}
    async with pool.acquire() as conn:
        states = {m.name: m.state for m in await db.migration_states(conn, folder)}
        assert states == {
            "shared/001_outbox.sql": "applied",
            "svc/001_things.sql": "changed",
            "svc/002_more.sql": "pending",
        }
        with pytest.raises(db.MigrationError, match="changed after it was applied"):
            db.require_current(schema, await db.migration_states(conn, folder))


async def test_a_schema_migrated_before_checksums_gets_them_without_running_anything_again(
    scratch: tuple[asyncpg.Pool, str, Path],
) -> None:
    pool, schema, folder = scratch
    (folder / "001_things.sql").write_text("CREATE TABLE things (id int PRIMARY KEY);")
    await pool.execute(
        "CREATE TABLE schema_migrations (name text PRIMARY KEY, applied_at "
        "timestamptz NOT NULL DEFAULT now());"
        + (db.SHARED_SQL / "001_outbox.sql").read_text()
        + (folder / "001_things.sql").read_text()
        + "INSERT INTO schema_migrations (name) VALUES ('shared/001_outbox.sql'), ('svc/001_things.sql')"
    )
    assert await db.migrate(pool, schema, folder) == []
    assert await pool.fetchval("SELECT count(*) FROM schema_migrations WHERE checksum IS NULL") == 0
    (folder / "001_things.sql").write_text("-- edited\nCREATE TABLE things (id int PRIMARY KEY);")
    with pytest.raises(db.MigrationError, match=r"svc/001_things\.sql changed"):
        await db.migrate(pool, schema, folder)


async def test_a_migration_waits_for_a_lock_only_so_long_and_is_rolled_back_whole(
    scratch: tuple[asyncpg.Pool, str, Path],
) -> None:
    pool, schema, folder = scratch
    (folder / "001_things.sql").write_text("CREATE TABLE things (id int PRIMARY KEY);")
    await db.migrate(pool, schema, folder)
    (folder / "002_more.sql").write_text(
        "CREATE TABLE more (id int); ALTER TABLE things ADD COLUMN label text;"
    )
    async with pool.acquire() as reader, reader.transaction():
        await reader.execute("SELECT * FROM things")  # holds ACCESS SHARE until its transaction ends
        started = time.monotonic()
        with pytest.raises(db.MigrationError) as timed_out:
            await db.migrate(pool, schema, folder, lock_timeout=0.5)
        assert time.monotonic() - started < 5
    assert str(timed_out.value) == (
        f"schema {schema}: svc/002_more.sql waited over 0.5s for a lock (RACKPLANE_MIGRATE_LOCK_TIMEOUT) "
        "and was rolled back: retry once the transaction holding it ends"
    )
    assert await pool.fetchval("SELECT to_regclass('more')") is None
    assert await db.migrate(pool, schema, folder, lock_timeout=0.5) == ["svc/002_more.sql"]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SHOW lock_timeout") == "0"  # the pool's connection is as it was


async def test_a_failing_migration_is_one_line_and_leaves_nothing(
    scratch: tuple[asyncpg.Pool, str, Path],
) -> None:
    pool, schema, folder = scratch
    (folder / "001_half.sql").write_text("CREATE TABLE half (id int); CREATE TABEL oops (id int);")
    with pytest.raises(db.MigrationError) as failed:
        await db.migrate(pool, schema, folder)
    assert str(failed.value).startswith(
        f"schema {schema}: svc/001_half.sql failed and was rolled back: syntax error"
    )
    assert await pool.fetchval("SELECT to_regclass('half')") is None


async def test_replicas_starting_at_once_apply_each_migration_once(
    scratch: tuple[asyncpg.Pool, str, Path],
) -> None:
    pool, schema, folder = scratch
    (folder / "001_counted.sql").write_text("CREATE TABLE counted (n int); INSERT INTO counted VALUES (1);")
    done = await asyncio.gather(*(db.migrate(pool, schema, folder) for _ in range(4)))
    assert sorted(len(names) for names in done) == [0, 0, 0, 2]
    assert await pool.fetchval("SELECT count(*) FROM counted") == 1


# --- RACKPLANE_MIGRATE and python -m deploy.migrations, as a deployment runs them ------------------------


def run(args: list[str], url: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DATABASE_URL": url,
        "NATS_URL": "nats://127.0.0.1:1",
        **env,
    }
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=60)


def test_a_deployment_migrates_once_and_its_services_only_check(pg: tuple[Postgres, dict[str, str]]) -> None:
    cluster, logins = pg
    # Nothing applied yet: a service that must not migrate refuses to start, in one line.
    refused = run(["-m", "services.accounting"], logins["accounting"], RACKPLANE_MIGRATE="skip")
    assert refused.returncode == 1
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "accounting: schema accounting: 5 migrations pending (shared/001_outbox.sql, "
            "accounting/001_initial.sql"
        )
    )
    status = run(["-m", "deploy.migrations", "--status"], logins["check"])
    assert status.returncode == 1 and "accounting: not current (5 pending)" in status.stdout, status.stderr

    # One step migrates, each schema with its own login (as its owner role), and exits.
    only = run(["-m", "services.accounting"], logins["accounting"], RACKPLANE_MIGRATE="only")
    assert only.returncode == 0, only.stderr
    assert "exiting (RACKPLANE_MIGRATE=only)" in only.stderr
    for schema in ("instance_manager", "recovery"):
        applied = run(["-m", "deploy.migrations", schema], logins[schema])
        assert applied.returncode == 0, applied.stderr
        assert applied.stdout.startswith(f"{schema}: applied shared/001_outbox.sql, {schema}/001_initial.sql")
    again = run(["-m", "deploy.migrations", "recovery"], logins["recovery"])
    assert again.stdout == "recovery: current, nothing to apply\n"
    elsewhere = run(["-m", "deploy.migrations", "accounting"], logins["recovery"])
    assert elsewhere.returncode == 1
    assert elsewhere.stderr == (
        "migrate: error: schema accounting: recovery may not create in it: migrate it with its own service's "
        "login (a member of its owner role) or an administrator's\n"
    )

    # Now every schema is current: the read-only login says so, with every file and its checksum.
    status = run(["-m", "deploy.migrations", "--status", "--json"], logins["check"])
    assert status.returncode == 0, status.stderr
    listed = json.loads(status.stdout)
    assert set(listed) == set(SCHEMAS)
    for schema, migrations in listed.items():
        files = sorted(p.name for p in migrations_dir(schema).glob("[0-9]*.sql"))
        assert [m["name"] for m in migrations] == ["shared/001_outbox.sql", *(f"{schema}/{f}" for f in files)]
        assert all(m["state"] == "applied" and m["checksum"] == m["applied_checksum"] for m in migrations)
    text = run(["-m", "deploy.migrations", "--status", "accounting"], logins["check"]).stdout
    assert text.splitlines()[0] == "accounting: current (5 applied)"

    # The tables belong to the owner role, not to the login that ran the migrations.
    async def owners() -> set[str]:
        conn = await asyncpg.connect(cluster.url)
        try:
            rows = await conn.fetch(
                "SELECT tableowner FROM pg_tables WHERE schemaname = ANY($1::text[])", SCHEMAS
            )
            return {r["tableowner"] for r in rows}
        finally:
            await conn.close()

    assert run_sync(owners()) == {db.owner_role(s) for s in SCHEMAS}


def test_a_bad_migrate_setting_names_its_variable(pg: tuple[Postgres, dict[str, str]]) -> None:
    bad = run(["-m", "services.recovery"], pg[1]["recovery"], RACKPLANE_MIGRATE="sometimes")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "recovery: RACKPLANE_MIGRATE='sometimes': expected 'auto', 'skip' or 'only'"
    ]
    bad = run(["-m", "deploy.migrations"], pg[1]["recovery"], RACKPLANE_MIGRATE_LOCK_TIMEOUT="forever")
    assert bad.returncode == 1 and "RACKPLANE_MIGRATE_LOCK_TIMEOUT='forever'" in bad.stderr
