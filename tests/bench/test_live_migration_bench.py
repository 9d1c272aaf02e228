"""Benchmark: live migration of running instances, at 16 concurrent callers, each move timed from the
command to the instance running on its new sled, beside a start (command to running) of as many stopped
instances, measured in the same run at the same concurrency.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_live_migration_bench.py)
Environment: BENCH_MOVES (160), BENCH_MOVERS (16).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import AsyncIterator

import pytest

from rackctl.client import Client
from tests.bench import UNLIMITED
from tests.bench.test_pool_bench import summary, timed
from tests.conftest import GiB, Rack, private_rack

pytestmark = pytest.mark.bench

MOVES = int(os.environ.get("BENCH_MOVES", "160"))
MOVERS = int(os.environ.get("BENCH_MOVERS", "16"))


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    env = {"RACKPLANE_SLEDS": "2", "RACKPLANE_SLED_SHAPES": "512:1024", "RACKPLANE_LOG": "WARNING"}
    async with private_rack("movebench", timeout=120, RACKPLANE_TRACES="none", **UNLIMITED, **env) as made:
        yield made


async def until(client: Client, name: str, done: str) -> None:
    """Poll until the instance is running on a VMM other than `done` ("" for any VMM)."""
    delay = 0.01
    while True:
        v = await client.instance("show", "bench", "p", name)
        if v["state"] == "running" and v["active_vmm_id"] != done:
            return
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.1)


async def test_migration_latency_and_rate(rack: Rack) -> None:
    _, client, _db = rack
    await client.silo_create("bench")
    await client.project_create("bench", "p")
    names = [f"vm-{i}" for i in range(MOVES)]
    for n in names:
        await client.instance_create("bench", "p", n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def start(i: int) -> None:
        await client.instance("start", "bench", "p", names[i])
        await until(client, names[i], "")

    starts, starts_wall = await timed(MOVES, MOVERS, start)

    async def move(i: int) -> None:
        reply = await client.instance_migrate("bench", "p", names[i])
        await until(client, names[i], reply["migration"]["source_vmm_id"])

    moves, moves_wall = await timed(MOVES, MOVERS, move)
    usage = (await client.usage("bench"))["usage"]
    assert usage == {"vcpus": MOVES, "ram_bytes": MOVES * GiB, "disk_bytes": MOVES * GiB}
    ratio = statistics.median(moves) / statistics.median(starts)
    print(
        f"\nRESULT {MOVES} each, {MOVERS} concurrent callers, simulated hand-over "
        f"{os.environ.get('RACKPLANE_MIGRATE_DELAY', '0.3')} s\n"
        f"{summary('migrate (to running there)', moves, moves_wall)}\n"
        f"{summary('start (baseline)', starts, starts_wall)}\n"
        f"  a move takes {ratio:.2f}x a start at p50, and the instance runs throughout"
    )
