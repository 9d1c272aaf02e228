"""The pruner: finished records go once they are older than the retention (RACKPLANE_RETENTION).

Without it instance-manager keeps every finished saga, every charge outcome and every ended VMM record
for ever. A pass deletes, in chunks of a bounded size (each its own short transaction, so no lock is
held long):

- finished sagas (done, or failed once unwound) and their events;
- charge outcomes, except each instance's latest and those of an instance an unfinished saga works on
  (a charge step reads its outcome again after a crash);
- commands' recorded answers (`command_replies`: what a copy of a command sent again gets), after an
  hour (REPLIES_KEPT) or the retention if it is shorter;
- ended VMM records, except each instance's latest, any an instance names as active or migration
  target, and any an unfinished saga names. The fences act on live records only (a report about an
  ended VMM changes nothing, with its record or without; an order about one is refused as stale), and a
  zombie order about a VMM with no record still asks who claims it.

Kept for good: instances (their generations are the fences), failures (the evidence the checker holds
against the sleds' boot history) and pending charges (each goes when its outcome arrives). One replica
prunes at a time.

A pass also folds each silo's changes of its instance count into the count (migration 015): a create
folds its own silo's, so those of a silo where nothing but pools and deletes happen would pile up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg

from services.instance_manager.base import Q
from shared import telemetry
from shared.db import PassLock, queries

log = logging.getLogger(__name__)
SQL = queries(Path(__file__).with_name("prune.sql"))
PASS_LOCK = "instance-manager-prune"
REPLIES_KEPT = 3600.0
"""Seconds a command's recorded answer is kept (at most; less if the retention is shorter): far longer
than any caller waits before sending a command again (its own timeout, seconds), and short enough that a
busy rack's row a command does not pile up for the whole retention."""
EVENTS_PER_SAGA = 10
"""About how many events a saga logs: a chunk of sagas is this much smaller than a chunk of rows."""


def _deleted(status: str) -> int:
    """The row count of a `DELETE n` status."""
    return int(status.split()[-1])


@dataclass
class Pruner:
    pool: asyncpg.Pool
    dsn: str
    retention: float
    """Seconds a finished record is kept."""
    interval: float
    """Seconds between passes."""
    chunk: int = 5000
    """Rows deleted by one statement at most."""
    lock: PassLock = field(init=False)

    def __post_init__(self) -> None:
        self.lock = PassLock(self.dsn, PASS_LOCK)

    async def run(self) -> None:
        while True:
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("prune pass failed: %s", e)
                telemetry.count("prune.pass_errors")
            await asyncio.sleep(self.interval)

    async def run_pass(self) -> dict[str, int] | None:
        """One pass, if no other replica is running one. Returns how many rows went, by table."""
        async with self.lock as mine:
            if not mine:
                telemetry.count("prune.passes_skipped")
                return None
            cutoff: datetime = await self.pool.fetchval(SQL["cutoff"], self.retention)
            pruned = await self.sagas(cutoff)
            pruned["charge_outcomes"] = await self.charge_outcomes(cutoff)
            pruned["vmms"] = await self.vmms(cutoff)
            replies_cutoff = await self.pool.fetchval(SQL["cutoff"], min(self.retention, REPLIES_KEPT))
            pruned["command_replies"] = await self.command_replies(replies_cutoff)
            pruned["silo_instance_changes"] = await self.silo_instance_changes()
        for table, n in pruned.items():
            if n:
                telemetry.count(f"pruned.{table}", n)
        if any(pruned.values()):
            log.info(
                "pruned what finished before %s: %s",
                cutoff.isoformat(),
                ", ".join(f"{n} {table}" for table, n in pruned.items() if n),
            )
        return pruned

    async def _in_chunks(self, chunk: int, step: Callable[[], Awaitable[int]]) -> int:
        """Run `step` (which deletes `chunk` rows at most) until it deletes fewer; the total deleted."""
        total = 0
        while True:
            n = await step()
            total += n
            if n < chunk:
                return total
            await asyncio.sleep(0)  # let the service's other work in between

    async def sagas(self, cutoff: datetime) -> dict[str, int]:
        """Finished sagas last changed before `cutoff`, their events first (the foreign key's order)."""
        chunk = max(1, self.chunk // EVENTS_PER_SAGA)
        events = 0

        async def step() -> int:
            nonlocal events
            async with self.pool.acquire() as conn, conn.transaction():
                ids = [r["id"] for r in await conn.fetch(SQL["sagas_finished"], cutoff, chunk)]
                if not ids:
                    return 0
                events += _deleted(await conn.execute(SQL["saga_events_delete"], ids))
                return _deleted(await conn.execute(SQL["sagas_delete"], ids))

        sagas = await self._in_chunks(chunk, step)
        return {"sagas": sagas, "saga_events": events}

    async def charge_outcomes(self, cutoff: datetime) -> int:
        """Charge outcomes received before `cutoff` that nothing reads again."""

        async def step() -> int:
            return _deleted(await self.pool.execute(SQL["charge_outcomes_delete"], cutoff, self.chunk))

        return await self._in_chunks(self.chunk, step)

    async def command_replies(self, cutoff: datetime) -> int:
        """Commands' recorded answers (for a copy sent again) made before `cutoff`."""

        async def step() -> int:
            return _deleted(await self.pool.execute(SQL["command_replies_delete"], cutoff, self.chunk))

        return await self._in_chunks(self.chunk, step)

    async def vmms(self, cutoff: datetime) -> int:
        """VMM records that ended before `cutoff` and that nothing needs; the horizon is recorded first."""
        await self.pool.execute(SQL["vmms_horizon"], cutoff)

        async def step() -> int:
            return _deleted(await self.pool.execute(SQL["vmms_delete"], cutoff, self.chunk))

        return await self._in_chunks(self.chunk, step)

    async def silo_instance_changes(self) -> int:
        """Fold each silo's changes of its instance count, as a create does, under the silo's lock; a silo
        a create holds is left to it. How many changes were folded."""
        silos = [r["silo_id"] for r in await self.pool.fetch(SQL["silos_with_instance_changes"], self.chunk)]
        folded = 0
        for silo in silos:
            async with self.pool.acquire() as conn, conn.transaction():
                if await conn.fetchval(SQL["silo_lock_to_fold"], silo) is not None:
                    folded += (await conn.fetchrow(Q["silo_instances_count"], silo))["folded"]
        return folded
