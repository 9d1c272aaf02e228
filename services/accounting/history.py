"""Usage over time: the totals of each silo and project after every change (table usage_history), and
their history compacted into a bounded number of intervals for `rp.cmd.<silo>.usage.history`.

The fleet has no rows of its own: its level at any moment is the sum of its silos' latest rows, so that
it can never disagree with them.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg

from shared import bus
from shared.db import queries
from shared.messages import UsageHistoryGet
from shared.topology import subjects

Q = queries(Path(__file__).parent / "queries.sql")
RESOURCES = ("vcpus", "ram_bytes", "disk_bytes")


async def append_history(conn: asyncpg.Connection, rows: list[tuple[str, UUID, UUID, int, int, int]]) -> None:
    """Append the totals of every silo and project a change touched, each row (scope: `silo` or `project`,
    its id, its silo's id, vcpus, ram_bytes, disk_bytes), in the caller's transaction once their rows are
    locked, so that `at` follows the order of the changes. One statement, whatever the number of rows."""
    if not rows:
        return
    columns = list(zip(*rows, strict=True))
    await conn.execute(Q["history_append"], *(list(c) for c in columns))


async def history(pool: asyncpg.Pool, body: UsageHistoryGet) -> dict[str, Any]:
    """The usage of the fleet, a silo or a project over the last `since_seconds`, in `buckets` intervals."""
    async with pool.acquire() as conn:
        if body.silo is None:
            scope, name, quota = "fleet", subjects.FLEET, None
            series, ids = "silo", [r["id"] for r in await conn.fetch(Q["silo_ids"])]
        else:
            silo = await conn.fetchrow(Q["silo_by_name"], body.silo)
            if silo is None:
                raise bus.NotFound(f"no silo {body.silo}")
            if body.project is None:
                scope, name, series, ids = "silo", body.silo, "silo", [silo["id"]]
                quota = {k: silo[f"quota_{k}"] for k in RESOURCES}
            else:
                p = await conn.fetchrow(Q["project_by_name"], body.silo, body.project)
                if p is None:
                    raise bus.NotFound(f"no project {body.silo}/{body.project}")
                scope, name, quota = "project", f"{body.silo}/{body.project}", None
                series, ids = "project", [p["id"]]
        until = await conn.fetchval(Q["history_now"])
        since = until - timedelta(seconds=body.since_seconds)
        width = body.since_seconds / body.buckets
        rows = await conn.fetch(Q["history_buckets"], series, ids, since, width, body.buckets)
    return {
        "scope": scope,
        "name": name,
        "quota": quota,
        "since": since.isoformat(),
        "until": until.isoformat(),
        "bucket_seconds": width,
        **compact(rows, since, width, body.buckets),
    }


def compact(rows: list[asyncpg.Record], since: Any, width: float, buckets: int) -> dict[str, Any]:
    """Every bucket, the quiet ones too: each starts at the level the one before ended with, so that its
    min and max cover that level as well as the changes inside it."""
    by_bucket = {r["bucket"]: r for r in rows}
    level = {k: by_bucket[-1][f"{k}_last"] for k in RESOURCES}
    start = dict(level)
    points = []
    for b in range(buckets):
        r = by_bucket.get(b)
        point: dict[str, Any] = {"at": (since + timedelta(seconds=width * (b + 1))).isoformat()}
        for k in RESOURCES:
            if r is None:
                point[k] = {"min": level[k], "max": level[k], "last": level[k]}
            else:
                point[k] = {
                    "min": min(level[k], r[f"{k}_min"]),
                    "max": max(level[k], r[f"{k}_max"]),
                    "last": r[f"{k}_last"],
                }
                level[k] = r[f"{k}_last"]
        points.append(point)
    return {"start": start, "points": points}
