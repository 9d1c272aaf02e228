"""Benchmark: a sled holding 500 best_effort instances reboots. How long until the API stops calling them
running, and until all run again; beside the time to start 500 fresh instances, measured in the same run
(the machine is noisy: the ratio is what compares across machines).

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_recovery_bench.py)
Environment: BENCH_INSTANCES (500), BENCH_RUNS (3).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import asyncpg
import pytest

from rackctl.client import Client
from tests.bench import UNLIMITED
from tests.conftest import GiB, Rack, eventually, private_rack, sleds_known

pytestmark = pytest.mark.bench

N = int(os.environ.get("BENCH_INSTANCES", "500"))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))


def one_full_sled() -> AbstractAsyncContextManager[Rack]:
    """A rack whose one sled has room for all N instances (a second, empty, is added once they run)."""
    shape = f"{N + 64}:{N + 64}"
    return private_rack(
        "bench", timeout=120, RACKPLANE_SLEDS="1", RACKPLANE_SLED_SHAPES=shape, RACKPLANE_LOG="WARNING",
        RACKPLANE_TRACES="none", **UNLIMITED,
    )  # fmt: skip


async def count_running(db: asyncpg.Pool, silo: str, lost_boot: str | None) -> tuple[int, int]:
    """(instances running, of which on a VMM the reboot took away), straight from the instance table
    (500 `show`s a poll would measure the poller, not the system)."""
    row = await db.fetchrow(
        """
        SELECT count(*) FILTER (WHERE i.state = 'running') AS running,
               count(*) FILTER (WHERE i.state = 'running' AND v.boot_id = $2::uuid) AS lost
        FROM instance_manager.instances i
        JOIN instance_manager.projects p ON p.id = i.project_id
        JOIN instance_manager.silos si ON si.id = p.silo_id
        LEFT JOIN instance_manager.vmms v ON v.id = i.active_vmm_id
        WHERE si.name = $1 AND i.state <> 'destroyed'
        """,
        silo,
        lost_boot,
    )
    return row["running"], row["lost"]


async def wait_for(
    db: asyncpg.Pool, silo: str, lost_boot: str | None, done: Callable[[int, int], bool]
) -> float:
    """Seconds until done(running, running_on_lost_vmms) holds."""
    start = time.monotonic()
    while not done(*(await count_running(db, silo, lost_boot))):
        if time.monotonic() - start > 300:
            raise TimeoutError(f"not reached after 300s: {await count_running(db, silo, lost_boot)}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def new_boot_seen(db: asyncpg.Pool, lost_boot: str) -> float:
    """When (monotonic) instance-manager first holds an inventory of the sled's new boot."""
    q = "SELECT boot_id::text <> $1 FROM instance_manager.sleds WHERE id = 'sled-0'"
    while True:
        if await db.fetchval(q, lost_boot):
            return time.monotonic()
        await asyncio.sleep(0.005)


async def start_fresh(client: Client, silo: str, proj: str, names: list[str]) -> None:
    sem = asyncio.Semaphore(32)

    async def create(n: str) -> None:
        async with sem:
            await client.instance_create(silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def start(n: str) -> None:
        async with sem:
            await client.instance("start", silo, proj, n)

    await asyncio.gather(*(create(n) for n in names))
    await asyncio.gather(*(start(n) for n in names))


async def test_reboot_of_a_sled_with_500_instances() -> None:
    fresh, truthful, after_inventory, back = [], [], [], []
    for run in range(RUNS):
        async with one_full_sled() as (_, client, db):
            silo, proj = "bench", "p"
            await client.silo_create(silo)
            await client.project_create(silo, proj)
            names = [f"vm-{i}" for i in range(N)]

            # Baseline: create and start N fresh instances, until all run.
            t0 = time.monotonic()
            await start_fresh(client, silo, proj, names)
            await wait_for(db, silo, None, lambda running, lost: running == N)
            fresh.append(time.monotonic() - t0)

            # A second sled joins; then the first, holding all N, reboots.
            await client.sim_sled("add", vcpus=N + 64, ram_bytes=(N + 64) * GiB)
            await eventually(lambda c=client: sleds_known(c, 2), timeout=20)
            lost_boot = await db.fetchval(
                "SELECT boot_id::text FROM instance_manager.sleds WHERE id = 'sled-0'"
            )
            t0 = time.monotonic()
            await client.sim_sled("reboot", "sled-0")
            seen = asyncio.create_task(new_boot_seen(db, lost_boot))
            truthful.append(await wait_for(db, silo, lost_boot, lambda running, lost: lost == 0))
            after_inventory.append(t0 + truthful[-1] - await seen)
            await wait_for(db, silo, lost_boot, lambda running, lost: running == N and lost == 0)
            back.append(time.monotonic() - t0)
            print(
                f"\nrun {run}: {N} fresh starts {fresh[-1]:.2f}s; reboot of the sled holding all {N}: "
                f"API truthful after {truthful[-1]:.2f}s ({after_inventory[-1] * 1000:.0f} ms after the new "
                f"boot's first inventory), all running again after {back[-1]:.2f}s"
            )

    p50 = statistics.median
    print(
        f"\nRESULT instances={N} runs={RUNS}\n"
        f"  baseline: start {N} fresh instances       p50 {p50(fresh):6.2f}s  max {max(fresh):6.2f}s"
        f"  ({N / p50(fresh):.0f} starts/s)\n"
        f"  reboot: API stops calling them running  p50 {p50(truthful):6.2f}s  max {max(truthful):6.2f}s"
        f"  ({p50(truthful) / p50(fresh):.2f}x baseline)\n"
        f"    of which after the new boot's first inventory p50 {p50(after_inventory) * 1000:6.0f} ms"
        f"  max {max(after_inventory) * 1000:6.0f} ms\n"
        f"  reboot: all running again               p50 {p50(back):6.2f}s  max {max(back):6.2f}s"
        f"  ({p50(back) / p50(fresh):.2f}x baseline)"
    )
