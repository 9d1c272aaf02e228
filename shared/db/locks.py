"""Advisory locks held by a session of their own, for work one replica does at a time."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from shared.db.queries import queries

SQL = Path(__file__).parent / "locks.sql"


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
            self._held = bool(await self._conn.fetchval(queries(SQL)["try_lock"], self.name))
        except Exception:
            self._conn = None
            raise
        return self._held

    async def __aexit__(self, *exc: object) -> None:
        if self._held and self._conn is not None and not self._conn.is_closed():
            try:
                await self._conn.execute(queries(SQL)["unlock"], self.name)
            except Exception:
                self._conn = None  # the lock went with the connection
        self._held = False
