"""The database roles of a stack: one owner and one login role per service, and `rackctl check`'s
read-only role (deploy/sql/roles_*.sql), with passwords generated here and kept under the stack's folder.

Each login's URL is written to `<dir>/secrets/db/<role>.url` (mode 0600, in a 0700 folder): the stack
hands each service its own as DATABASE_URL, and `rackctl check` finds the checker's there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import re
import secrets
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import asyncpg

from deploy.migrations import SCHEMAS
from shared.config import DB_LOGINS
from shared.db import owner_role
from shared.errors import transient

SQL = Path(__file__).parent / "sql"
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
            async with conn.transaction():  # a savepoint: a role that exists fails alone
                await conn.execute(stmt)
        except asyncpg.DuplicateObjectError:
            if not stmt.startswith("CREATE ROLE"):  # a role made by an earlier start: altered next
                raise


def with_login(url: str, user: str, password: str, *, read_only: bool = False) -> str:
    """`url` (an administrator's) with another user and password. Its hosts stay as they are, one or
    several (a multi-host DSN over a Patroni cluster's nodes: `h1:p1,h2:p2`), and so does its query
    (`target_session_attrs=read-write`), except for a `read_only` role (default_transaction_read_only):
    no node is read-write to it, so it asks for the primary instead (a standby's rows may lag)."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{hosts}"
    query = parts.query
    if read_only:
        query = query.replace("target_session_attrs=read-write", "target_session_attrs=primary")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


async def provision(
    admin_url: str, logins: Path, owner: str | None = None, *, keep: bool = False
) -> dict[str, str]:
    """Create or update every role, write each login's URL to `logins` (owned by the user `owner`, if
    given), and return them by role: the service names of SCHEMAS, and "check". Every call sets new
    passwords, unless `keep` says to keep those already written (compose: running services keep theirs).
    """
    urls: dict[str, str] = {}

    def password(role: str) -> str:
        path = logins / f"{role}.url"
        if keep and path.exists() and (old := urlsplit(path.read_text().strip()).password):
            return unquote(old)
        return new_password()

    conn = await asyncpg.connect(admin_url)
    try:
        async with conn.transaction():
            checker_pw = password("check")
            database = await conn.fetchval("SELECT current_database()")
            await _apply(
                conn,
                render(
                    SQL / "roles_common.sql", checker=CHECKER, checker_password=checker_pw, database=database
                ),
            )
            urls["check"] = with_login(admin_url, CHECKER, checker_pw, read_only=True)
            for schema in SCHEMAS:
                pw = password(schema)
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
    folder_mode = 0o700 if owner is None else 0o755  # compose: the folder is a volume other users mount
    for role, url in urls.items():
        write_secret(logins / f"{role}.url", url, owner, folder_mode)
    return urls


def write_secret(path: Path, value: str, owner: str | int | None = None, folder_mode: int = 0o700) -> None:
    """Write `value` to `path`, readable by its owner only (`owner`, a user name or uid, if given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, folder_mode)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)
    if owner is not None:
        uid = owner if isinstance(owner, int) else pwd.getpwnam(owner).pw_uid
        os.chown(path, uid, -1)


# --- docker-compose.yml: the same roles, with the logins on a volume --------------------------------------

PG_IMAGE_UID = 999
"""The user the official postgres image runs as: it reads the superuser's password file at first start."""


def _compose(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.dbroles", description=__doc__)
    parser.add_argument("step", choices=["secrets", "apply"])
    parser.add_argument("--dir", type=Path, default=Path("/run/rackplane/db"))
    parser.add_argument(
        "--host", default="postgres", help="the server, or several comma-separated (Patroni's nodes)"
    )
    parser.add_argument("--port", type=int, default=5432)
    parser.add_argument("--wait", type=float, default=60, help="seconds to wait for a read-write server")
    parser.add_argument("--database", default="rackplane")
    parser.add_argument("--owner", default="rackplane", help="the user the services run as")
    a = parser.parse_args(argv)
    superuser = a.dir / "postgres.password"
    if a.step == "secrets":  # before PostgreSQL's first start: its superuser's password, made once
        if not superuser.exists():
            write_secret(superuser, new_password(), PG_IMAGE_UID, 0o755)
        return
    hosts = [h.strip() for h in a.host.split(",") if h.strip()]
    # several nodes: one URL over all of them that lands on the one taking writes, as the services' does
    query = "?target_session_attrs=read-write" if len(hosts) > 1 else ""
    netloc = ",".join(f"{h}:{a.port}" for h in hosts)
    admin = with_login(
        f"postgresql://{netloc}/{a.database}{query}", "postgres", superuser.read_text().strip()
    )
    deadline = time.monotonic() + a.wait
    while True:  # a node that is not up yet, or none that takes writes yet (Patroni still electing one)
        try:
            asyncio.run(provision(admin, a.dir, a.owner, keep=True))
            return
        except Exception as e:
            if not (transient(e) or isinstance(e, asyncpg.InvalidCatalogNameError)):
                raise
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"deploy.dbroles: no read-write server on {netloc} after {a.wait:g}s: {e}"
                ) from e
            time.sleep(1)


if __name__ == "__main__":
    _compose()
