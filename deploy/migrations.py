"""`python -m deploy.migrations`: the migrations of every schema, listed or applied, from one entry point.

    python -m deploy.migrations --status [SCHEMA ...]   applied, pending and changed migrations; exit 0
                                                        when every schema listed is current, 1 otherwise
    python -m deploy.migrations [SCHEMA ...]            apply what is pending, then exit

The database is $DATABASE_URL (or the file $DATABASE_URL_FILE names), or --database-url. Migrations run
as each schema's owner role: with a service's own login, name its schema only; `--status` needs only read
access (`rackctl check`'s read-only login reads every schema). Services apply their own migrations at
start unless RACKPLANE_MIGRATE says otherwise (docs/architecture.md, "Migrations"). These are schema
migrations; moving a running instance to another sled is a live migration (services/instance_manager).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import asyncpg

from shared import db
from shared.config import ConfigError, Settings

SCHEMAS = ("instance_manager", "accounting", "recovery")
"""The services that keep state in PostgreSQL: each has a schema (and roles) of its own, named as its
package, whose MIGRATIONS names its folder of migrations."""

SQL = Path(__file__).parent / "sql" / "migrations.sql"


def migrations_dir(schema: str) -> Path:
    """The migrations of `schema`: the folder its service names (services/<schema>/__init__.py)."""
    return Path(importlib.import_module(f"services.{schema}").MIGRATIONS)


async def status(url: str, schemas: tuple[str, ...] = SCHEMAS) -> dict[str, list[db.Migration]]:
    """Each schema's migrations and their state, read only."""
    conn = await asyncpg.connect(url)
    try:
        out = {}
        for schema in schemas:
            await conn.execute(db.queries(SQL)["search_path"], schema)
            try:
                out[schema] = await db.migration_states(conn, migrations_dir(schema))
            except asyncpg.InsufficientPrivilegeError as e:
                raise db.MigrationError(f"schema {schema}: {e} (this login cannot read it)") from None
        return out
    finally:
        await conn.close()


async def apply(url: str, schemas: tuple[str, ...], lock_timeout: float) -> dict[str, list[str]]:
    """Apply what is pending in each schema, in order; a failure stops at once (MigrationError)."""
    out = {}
    for schema in schemas:
        pool = await db.create_pool(url, schema, max_size=1)
        try:
            out[schema] = await db.migrate(pool, schema, migrations_dir(schema), lock_timeout=lock_timeout)
        finally:
            await pool.close()
    return out


def status_text(states: dict[str, list[db.Migration]]) -> str:
    lines = []
    for schema, ms in states.items():
        counts = {s: sum(m.state == s for m in ms) for s in ("applied", "pending", "changed", "unknown")}
        current = not counts["pending"] and not counts["changed"]
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines.append(f"{schema}: {'current' if current else 'not current'} ({summary or 'no migrations'})")
        for m in ms:
            when = m.applied_at.strftime("%Y-%m-%d %H:%M:%SZ") if m.applied_at else ""
            note = {
                "changed": "  (its file changed after it was applied)",
                "unknown": "  (applied; no such file here: a newer version applied it)",
            }.get(m.state, "")
            lines.append(f"  {m.state:<8} {when:<20} {m.name}{note}")
    return "\n".join(lines)


def _as_json(states: dict[str, list[db.Migration]]) -> dict[str, Any]:
    return {
        schema: [
            {
                "name": m.name,
                "state": m.state,
                "applied_at": m.applied_at.isoformat() if m.applied_at else None,
                "checksum": m.checksum,
                "applied_checksum": m.recorded,
            }
            for m in ms
        ]
        for schema, ms in states.items()
    }


def _schema(text: str) -> str:
    if text not in SCHEMAS:
        raise argparse.ArgumentTypeError(f"unknown schema {text!r}: expected one of {', '.join(SCHEMAS)}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deploy.migrations",
        description="List or apply the migrations of rackplane's schemas.",
        epilog="examples:\n"
        "  $ python -m deploy.migrations --status\n"
        "  $ DATABASE_URL_FILE=/run/rackplane/db/accounting.url python -m deploy.migrations accounting",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "schemas", nargs="*", type=_schema, metavar="SCHEMA", help=f"{', '.join(SCHEMAS)} (default: all)"
    )
    p.add_argument("--status", action="store_true", help="list each migration's state; apply nothing")
    p.add_argument("--json", action="store_true", help="with --status: as JSON")
    p.add_argument("--database-url", metavar="URL", help="default: $DATABASE_URL, or $DATABASE_URL_FILE's")
    args = p.parse_args(argv)
    schemas = tuple(dict.fromkeys(args.schemas)) or SCHEMAS
    try:
        settings = Settings.from_env()
        url = args.database_url or settings.database_url
        if args.status:
            states = asyncio.run(status(url, schemas))
            print(json.dumps(_as_json(states), indent=2) if args.json else status_text(states))
            current = all(m.state not in ("pending", "changed") for ms in states.values() for m in ms)
            return 0 if current else 1
        for schema, names in asyncio.run(apply(url, schemas, settings.migration_lock_timeout)).items():
            print(
                f"{schema}: applied {', '.join(names)}" if names else f"{schema}: current, nothing to apply"
            )
        return 0
    except (ConfigError, db.MigrationError) as e:
        return _error(str(e))
    except (OSError, asyncpg.PostgresError) as e:
        return _error(f"database: {e}")


def _error(message: str) -> int:
    print(f"migrate: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
