"""The database roles of a stack: one owner and one login role per service, and `rackctl check`'s
read-only role (deploy/sql/roles_*.sql), with passwords generated here and kept under the stack's folder.

Each login's URL is written to `<dir>/secrets/db/<role>.url` (mode 0600, in a 0700 folder): the stack
hands each service its own as DATABASE_URL, and `rackctl check` finds the checker's there.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

from shared.config import DB_LOGINS
from shared.db import owner_role

SQL = Path(__file__).parent / "sql"
SCHEMAS = ("instance_manager", "accounting", "recovery")
"""The services that keep state in PostgreSQL: each has a schema, and roles, of its own."""
CHECKER = "rackplane_check"
_VAR = re.compile(r""":(["'])(\w+)\1""")


def secrets_dir(stack_dir: Path) -> Path:
    return stack_dir / DB_LOGINS


def new_password() -> str:
    return secrets.token_urlsafe(24)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def render(path: Path, **values: str) -> list[str]:
    """The statements of a roles file with its psql-style variables (:"name", :'name') filled in."""

    def sub(m: re.Match[str]) -> str:
        value = values[m.group(2)]
        return _ident(value) if m.group(1) == '"' else _literal(value)

    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in _VAR.sub(sub, text).split(";") if s.strip()]


async def _apply(conn: asyncpg.Connection, statements: list[str]) -> None:
    for stmt in statements:
        try:
            await conn.execute(stmt)
        except asyncpg.DuplicateObjectError:
            if not stmt.startswith("CREATE ROLE"):  # a role made by an earlier start: altered next
                raise


def with_login(url: str, user: str, password: str) -> str:
    """`url` (an administrator's) with another user and password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


async def provision(admin_url: str, stack_dir: Path) -> dict[str, str]:
    """Create or update every role (new passwords each time), and return each login's URL by role:
    the service names of SCHEMAS, and "check"."""
    urls: dict[str, str] = {}
    conn = await asyncpg.connect(admin_url)
    try:
        async with conn.transaction():
            checker_pw = new_password()
            await _apply(conn, render(SQL / "roles_common.sql", checker=CHECKER, checker_password=checker_pw))
            urls["check"] = with_login(admin_url, CHECKER, checker_pw)
            for schema in SCHEMAS:
                pw = new_password()
                await _apply(
                    conn,
                    render(
                        SQL / "roles_service.sql",
                        schema=schema,
                        owner=owner_role(schema),
                        app=schema,
                        app_password=pw,
                        checker=CHECKER,
                    ),
                )
                urls[schema] = with_login(admin_url, schema, pw)
    finally:
        await conn.close()
    write_urls(stack_dir, urls)
    return urls


def write_urls(stack_dir: Path, urls: dict[str, str]) -> None:
    folder = secrets_dir(stack_dir)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for role, url in urls.items():
        path = folder / f"{role}.url"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(url + "\n")
        os.chmod(path, 0o600)


def read_url(stack_dir: Path, role: str) -> str | None:
    path = secrets_dir(stack_dir) / f"{role}.url"
    return path.read_text().strip() if path.exists() else None
