"""Benchmark: a burst far past what instance-manager runs within its reply wait (issue 33, acceptance 2).
BENCH_OVERLOAD starts (2,000) are sent at once, with a transition timeout of 3 s, to one instance-manager:
how long the burst took (every reply; every instance running), and how many starts were told `busy` at
least once (and sent again by rackctl's client after the time they were told). None may fail, none may be
restarted, and the checker must find nothing: overload makes the control plane slower, never wrong.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_overload_bench.py)
Environment: BENCH_OVERLOAD (2000), BENCH_SAGA_BACKLOG (RACKPLANE_SAGA_BACKLOG: unset, the default 5 s;
a huge value turns the backpressure off, for comparison).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from shared.messages import Quota
from tests.bench import UNLIMITED
from tests.conftest import GiB, Rack, assert_invariants, counter, eventually, private_rack

pytestmark = pytest.mark.bench

STARTS = int(os.environ.get("BENCH_OVERLOAD", "2000"))
CALLERS = 32  # for the creates, which are not what is measured
CLIENT_TIMEOUT = 15.0
"""rackctl's client's own default timeout (`Client`): a reply later than that would have been a timeout."""


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    env = {
        "RACKPLANE_SLEDS": "8",
        "RACKPLANE_SLED_SHAPES": "1024:2048",
        "RACKPLANE_TRANSITION_TIMEOUT": "3",
        "RACKPLANE_LOG": "WARNING",
        "RACKPLANE_TRACES": "none",
    }
    if backlog := os.environ.get("BENCH_SAGA_BACKLOG"):
        env["RACKPLANE_SAGA_BACKLOG"] = backlog
    async with private_rack("overloadbench", timeout=300, **UNLIMITED, **env) as made:
        yield made


async def test_a_burst_of_starts_past_the_backlog(rack: Rack) -> None:
    _, client, db = rack
    await client.silo_create("bench", quota=Quota(vcpus=10**6, ram_bytes=10**15, disk_bytes=10**16))
    await client.project_create("bench", "p")
    gate = asyncio.Semaphore(CALLERS)

    async def create(i: int) -> None:
        async with gate:
            await client.instance_create("bench", "p", f"vm-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    await asyncio.gather(*(create(i) for i in range(STARTS)))
    told_before = client.told_busy
    refused_before = await counter(client, "instance-manager", "commands.busy")

    async def all_running() -> bool:
        n = await db.fetchval("SELECT count(*) FROM instance_manager.instances WHERE state = 'running'")
        return n >= STARTS

    async def start(i: int) -> float:
        t = time.perf_counter()
        await client.instance("start", "bench", "p", f"vm-{i}")
        return time.perf_counter() - t

    t0 = time.perf_counter()
    took = await asyncio.gather(*(start(i) for i in range(STARTS)))
    replied = time.perf_counter() - t0
    late = sum(1 for t in took if t > CLIENT_TIMEOUT)
    await eventually(all_running, timeout=600, interval=0.2)
    running = time.perf_counter() - t0
    told = client.told_busy - told_before
    refusals = await counter(client, "instance-manager", "commands.busy") - refused_before
    hurt = await db.fetchval(
        "SELECT count(*) FROM instance_manager.instances "
        "WHERE failed_at IS NOT NULL OR last_error IS NOT NULL OR auto_restarts > 0"
    )
    print(
        f"\nRESULT {STARTS} starts sent at once, transition timeout 3 s, one instance-manager\n"
        f"  every reply in {replied:.1f} s, all running in {running:.1f} s ({STARTS / running:.0f}/s)\n"
        f"  told busy at least once: {told} of {STARTS} ({refusals} busy answers in all)\n"
        f"  replies later than the client's default timeout ({CLIENT_TIMEOUT:g} s): {late}\n"
        f"  failed or restarted: {hurt}"
    )
    assert hurt == 0
    await assert_invariants(db, timeout=60)
