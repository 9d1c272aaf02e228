"""Schema migrations: plain NNN_*.sql files applied in order, each in its own transaction, each recorded
with its sha256 so that a file changed after it was applied stops the service rather than leaving the
schema other than its files say. The directories come from the caller (each service its own), so this
module knows nothing of which services exist."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import asyncpg

from shared.db.queries import queries

SHARED_SQL = Path(__file__).parent.parent / "sql"
"""The migrations every schema has first (the outbox), recorded as `shared/NNN_name.sql`."""
SQL = Path(__file__).parent / "migrations.sql"


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
    q = queries(SQL)
    recorded: dict[str, asyncpg.Record] = {}
    if await conn.fetchval(q["table_exists"]):
        recorded = {r["name"]: r for r in await conn.fetch(q["recorded"])}
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
            f"apply {'them' if many else 'it'} first (python -m deploy.migrations {schema}, or "
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
    q = queries(SQL)
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        await conn.execute(q["lock"], f"migrate:{schema}")
        owner = owner_role(schema)
        if await conn.fetchval(q["can_become"], owner):
            await conn.execute(f'SET ROLE "{owner}"')
        await conn.execute(q["set_lock_timeout"], f"{round(lock_timeout * 1000)}ms")
        try:
            if not await conn.fetchval(q["may_create"], schema):
                raise MigrationError(
                    f"schema {schema}: {await conn.fetchval(q['current_user'])} may not create in it: "
                    "migrate it with its own service's login (a member of its owner role) or an "
                    "administrator's"
                )
            await conn.execute(q["create_table"])
            if not await conn.fetchval(q["has_checksum"]):  # made before checksums were kept
                await conn.execute(q["add_checksum"])
            states = await migration_states(conn, *dirs)
            refuse_changed(schema, states)
            for m in states:
                if m.state == "applied" and m.recorded is None:  # applied before checksums: trusted as it is
                    await conn.execute(q["record_checksum"], m.name, m.checksum)
            for m in (m for m in states if m.state == "pending"):
                assert m.path is not None
                try:
                    async with conn.transaction():
                        await conn.execute(m.path.read_text())
                        await conn.execute(q["record"], m.name, m.checksum)
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
            await conn.execute(q["reset_lock_timeout"])
            await conn.execute(q["reset_role"])
            await conn.execute(q["unlock"], f"migrate:{schema}")
    return applied_now


def owner_role(schema: str) -> str:
    """The NOLOGIN role that owns `schema` and runs its migrations (deploy/sql/roles_service.sql)."""
    return f"{schema}_owner"
