"""Benchmark: picking a VM from a warm pool, at 16 concurrent pickers, beside the ordinary way to get a
running VM (create, then start) measured in the same run at the same concurrency.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_pool_bench.py)
Environment: BENCH_PICKS (160), BENCH_PICKERS (16).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from shared.messages import SimFaults
from tests.bench import UNLIMITED
from tests.conftest import GiB, Rack, eventually, private_rack

pytestmark = pytest.mark.bench

PICKS = int(os.environ.get("BENCH_PICKS", "160"))
PICKERS = int(os.environ.get("BENCH_PICKERS", "16"))


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    env = {"RACKPLANE_SLEDS": "2", "RACKPLANE_SLED_SHAPES": "512:512", "RACKPLANE_LOG": "WARNING"}
    async with private_rack("poolbench", timeout=120, RACKPLANE_TRACES="none", **UNLIMITED, **env) as made:
        yield made


async def timed(
    n: int, concurrency: int, one: Callable[[int], Awaitable[object]]
) -> tuple[list[float], float]:
    """Latencies of n calls made by `concurrency` workers, and the wall time of them all."""
    latencies: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            t = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


def summary(name: str, lat: list[float], wall: float) -> str:
    p99 = statistics.quantiles(lat, n=100)[98]
    return (
        f"  {name:<28} p50 {statistics.median(lat) * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"
        f"  {len(lat) / wall:7.1f} per second"
    )


async def test_pick_latency_and_rate(rack: Rack) -> None:
    _, client, _db = rack
    await client.silo_create("bench")
    await client.project_create("bench", "p")
    await client.pool_create("bench", "p", "warm", size=PICKS, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def full() -> bool:
        return (await client.pool("show", "bench", "p", "warm"))["idle"] == PICKS

    await eventually(full, timeout=300)
    for sled in ("sled-0", "sled-1"):  # replenishment must not compete with the picks being measured
        await client.sim_faults(SimFaults(sled_id=sled, drop_commands=True))

    async def pick(i: int) -> None:
        reply = await client.instance_from_pool("bench", "p", f"pick-{i}", "warm", require=True)
        assert reply["source"] == "pool"

    picks, picks_wall = await timed(PICKS, PICKERS, pick)
    for sled in ("sled-0", "sled-1"):
        await client.sim_faults(SimFaults(sled_id=sled))

    async def create_and_start(i: int) -> None:
        await client.instance_create("bench", "p", f"new-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", "bench", "p", f"new-{i}")

    fresh, fresh_wall = await timed(PICKS, PICKERS, create_and_start)
    ratio = statistics.median(fresh) / statistics.median(picks)
    print(
        f"\nRESULT {PICKS} each, {PICKERS} concurrent callers\n"
        f"{summary('pick from a warm pool', picks, picks_wall)}\n"
        f"{summary('create + start (baseline)', fresh, fresh_wall)}\n"
        f"  a pick is {ratio:.1f}x faster at p50 (and its VM is already running)"
    )
