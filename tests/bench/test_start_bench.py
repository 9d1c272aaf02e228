"""Benchmark: how many instance starts a second the control plane takes, and how long a start's reply
takes, at 32 concurrent callers with a VMM boot time of zero, beside a baseline measured in the same run at
the same concurrency: `instance show`, the cheapest request that reaches instance-manager and its
database.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_start_bench.py)
It runs twice, on the one-machine stack and then on `make run HA=1`'s (three nats-server nodes, every
stream at three replicas, PostgreSQL under Patroni with a synchronous standby, two processes of each
service), and the second run prints its figures as ratios to the first's: the price of replication.
Environment: BENCH_STARTS (300, the size the issue measured; at 1,000 the rack does not settle today:
docs/benchmarks.md says why), BENCH_CALLERS (32), BENCH_IM_REPLICAS (1: instance-manager processes
on the one-machine stack; the HA stack runs two).

A start's reply comes once its saga has taken the interlock, charged the instance (accounting's outcome
included), placed it and asked its sled; then the instance runs when the sled reports. Both are timed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import AsyncIterator

import pytest

from deploy.patroni import installed
from shared.messages import Quota
from tests.bench import UNLIMITED
from tests.bench.processes import cpu_split
from tests.bench.test_pool_bench import summary, timed
from tests.conftest import GiB, Rack, eventually, private_rack

pytestmark = pytest.mark.bench

STARTS = int(os.environ.get("BENCH_STARTS", "300"))
CALLERS = int(os.environ.get("BENCH_CALLERS", "32"))
REPLICAS = int(os.environ.get("BENCH_IM_REPLICAS", "1"))


RESULTS: dict[str, dict[str, float]] = {}
"""Each stack's figures, by kind ("one", "ha"), for the ratios of the second run to the first."""
HA = {"RACKPLANE_HA": "1", "RACKPLANE_SLED_UNKNOWN_AFTER": "15", "RACKPLANE_TRANSITION_TIMEOUT": "30"}
"""The HA stack, with the silence a broker's failover needs (tests/ha/test_broker_loss.py says why)."""


@pytest.fixture(params=["one", "ha"])
async def rack(request: pytest.FixtureRequest) -> AsyncIterator[Rack]:
    if request.param == "ha" and (missing := installed()):
        pytest.skip("; ".join(missing))
    env = {
        "RACKPLANE_SLEDS": "8",
        "RACKPLANE_SLED_SHAPES": "1024:2048",
        "RACKPLANE_VMM_START_DELAY": "0",
        "RACKPLANE_LOG": "WARNING",
        "RACKPLANE_TRACES": "none",
    }
    if request.param == "ha":
        env |= HA
    async with private_rack("startbench", timeout=120, **UNLIMITED, **env) as made:
        for k in range(2, REPLICAS + 1 if request.param == "one" else 0):  # HA: two already
            made[0].start_service("instance_manager", replica=f"instance-manager-{k}")
        yield made


async def test_start_rate_and_reply_latency(rack: Rack, request: pytest.FixtureRequest) -> None:
    stack, client, db = rack
    kind = request.node.callspec.params["rack"]
    await client.silo_create("bench", quota=Quota(vcpus=10**6, ram_bytes=10**15, disk_bytes=10**16))
    await client.project_create("bench", "p")

    async def create(i: int) -> None:
        await client.instance_create("bench", "p", f"vm-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    made, made_wall = await timed(STARTS, CALLERS, create)

    async def show(i: int) -> None:
        await client.instance("show", "bench", "p", f"vm-{i}")

    shown, shown_wall = await timed(STARTS, CALLERS, show)

    async def start(i: int) -> None:
        await client.instance("start", "bench", "p", f"vm-{i}")

    commits = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    before = await db.fetchval(commits)

    async def all_running() -> bool:
        return (
            await db.fetchval("SELECT count(*) FROM instance_manager.instances WHERE state = 'running'")
            >= STARTS
        )

    with cpu_split(stack) as cpu:
        t0 = time.perf_counter()
        started, started_wall = await timed(STARTS, CALLERS, start)
        await eventually(all_running, timeout=600, interval=0.1)
        running_wall = time.perf_counter() - t0
    cpu_total = sum(cpu.values())
    per_start = (await db.fetchval(commits) - before) / STARTS
    p99 = statistics.quantiles(started, n=100)[98]
    mine = RESULTS[kind] = {
        "rate": STARTS / started_wall,
        "p50": statistics.median(started),
        "p99": p99,
        "running": STARTS / running_wall,
        "show p50": statistics.median(shown),
        "cpu": cpu_total / STARTS,
    }
    if kind == "ha" and (one := RESULTS.get("one")):
        print(
            "\nPRICE OF REPLICATION (the HA stack's figure / the one-machine stack's, same run): "
            + ", ".join(f"{k} {mine[k] / one[k]:.2f}x" for k in mine)
        )
    print(
        f"\nRESULT ({'HA stack' if kind == 'ha' else 'one machine'}) {STARTS} instances, {CALLERS} "
        f"concurrent callers, VMM boot time 0\n"
        f"{summary('create', made, made_wall)}\n"
        f"{summary('show (baseline)', shown, shown_wall)}\n"
        f"{summary('start', started, started_wall)}\n"
        f"  all {STARTS} running {running_wall:.1f} s after the first start "
        f"({STARTS / running_wall:.0f} a second)\n"
        f"  {per_start:.0f} database transactions a start (every service, until all run)\n"
        f"  start vs show: {statistics.median(started) / statistics.median(shown):.1f}x at p50, "
        f"{(STARTS / started_wall) / (STARTS / shown_wall):.2f} of its rate\n"
        f"  target: 400 starts a second ({STARTS / started_wall:.0f}), p99 <= 250 ms ({p99 * 1000:.0f} ms)\n"
        f"  CPU until all ran: {cpu_total:.1f} s, {cpu_total / running_wall:.2f} cores busy, "
        f"{cpu_total / STARTS * 1000:.1f} ms a start: "
        + ", ".join(f"{k} {v / cpu_total:.0%}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    )
