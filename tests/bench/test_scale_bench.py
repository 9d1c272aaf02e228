"""Benchmark: a rack-wide power loss. Every sled of a rack of BENCH_SLEDS reboots at once under
BENCH_INSTANCES best_effort instances. Measured from the reboots: until the API stops calling any lost
instance running, and until all run again; each beside the time to start the same number fresh, in the
same run (the recovery benchmark's form, at rack scale). Also measured: what the idle rack costs each
process (before any instance), the reconcile pass at steady state
(recovery's own histogram), and the memory of every process.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_scale_bench.py)
Environment: BENCH_SLEDS (500), BENCH_INSTANCES (5,000), BENCH_INVENTORY_INTERVAL (5 s), BENCH_IDLE
(seconds the idle rack is watched first: two inventory intervals), BENCH_PLOT
(where the plot goes: docs/images/power-loss.png), BENCH_UNTIL (`back`, or `truthful` to end the run
there). Progress is printed every few seconds.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from deploy.stack import ROOT, Stack
from services.recovery.reconcile import RECONCILERS
from shared.db import queries as db_queries
from shared.messages import AutoRestart, Quota
from tests.bench import UNLIMITED
from tests.bench.processes import cpu_split, memory
from tests.conftest import GiB, private_rack

pytestmark = [pytest.mark.bench, pytest.mark.timeout(4 * 3600)]

SLEDS = int(os.environ.get("BENCH_SLEDS", "500"))
INSTANCES = int(os.environ.get("BENCH_INSTANCES", "5000"))
PLOT = Path(os.environ.get("BENCH_PLOT", str(ROOT / "docs" / "images" / "power-loss.png")))
INVENTORY_EVERY = float(os.environ.get("BENCH_INVENTORY_INTERVAL", "5"))
"""Seconds between a sled's inventories. One process simulates every sled on this machine's two cores:
at 5,000 sleds, every 5 s is 1,000 inventories a second through the simulator, the broker,
instance-manager and recovery, which leaves too little for the starts being measured."""
IDLE = float(os.environ.get("BENCH_IDLE", str(2 * INVENTORY_EVERY)))
"""Seconds the rack is watched doing nothing, before any instance: what its sleds' inventories and idle
pulls cost each process, which the starts measured after it do not get."""
UNTIL = os.environ.get("BENCH_UNTIL", "back")
"""`truthful` ends the run once the API is (the last phase, all back, is as long as the fresh starts)."""
SILO_SIZE = 10_000
"""Instances a silo of the bench holds at most: the rack's default limit (RACKPLANE_SILO_MAX_INSTANCES),
which a rack's tenants keep to. (Before migration 015 a create counted its silo's live instances under the
silo's lock: in one silo of 150,000 that took 33 ms, and the creates took turns at some 30 a second.)"""


def silo_of(i: int) -> str:
    return f"bench-{i // SILO_SIZE}"


CALLERS = 32
PROGRESS_EVERY = 5.0
PRODUCTION = {
    "RACKPLANE_INVENTORY_INTERVAL": f"{INVENTORY_EVERY:g}",
    "RACKPLANE_SLED_UNKNOWN_AFTER": f"{3 * INVENTORY_EVERY:g}",
    "RACKPLANE_TRANSITION_TIMEOUT": "60",
    "RACKPLANE_RECONCILE_INTERVAL": "10",
    "RACKPLANE_RESTART_COOLDOWN": "60",
    "RACKPLANE_ZOMBIE_GRACE": "10",
    "RACKPLANE_REPORT_RETRY": "1",
    "RACKPLANE_ACK_WAIT": "30",
    "RACKPLANE_FAULTS": "0",
}
"""The defaults a deployment runs with, in place of the tests' short ones (tests/conftest.py FAST): at
scale, a start that waits its turn is not stuck after 6 s, and a sled that reports every 5 s is not
silent after 3."""

VIEW = (
    db_queries(ROOT / "services" / "instance_manager" / "queries.sql")["instance_view"].rstrip().rstrip(";")
)
COUNTS = f"""SELECT count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'running' AND vmm_boot_id IN (SELECT unnest($5::uuid[]))) AS lost
FROM ({VIEW}) AS view"""
"""What a reply says of each instance (`instance show`, `instance list`), counted: the same view instance-
manager answers from, of all of them in one query, summed where it runs. It is the truth the bench checks
PROBE and LOST against (`check_probe`: before the power loss and at the end): at 150,000 instances one
poll of it takes seconds, too coarse a clock for the API's truth after a power loss."""
PROBE = """SELECT count(*) AS running,
       count(*) FILTER (WHERE v.boot_id IN (SELECT unnest($1::uuid[]))) AS lost
FROM instance_manager.instances i
LEFT JOIN instance_manager.vmms v ON v.id = i.active_vmm_id
LEFT JOIN instance_manager.sleds sl ON sl.id = v.sled_id
WHERE i.state = 'running' AND NOT coalesce(v.ended_at IS NULL AND sl.boot_number > v.boot_number, false)"""
"""COUNTS without the view's formatting, for polling: instance_view's rule for what it calls running (an
instance in state running, unless its VMM is live on a boot its sled has since left: `lost`), restated as
three joins."""
LOST = """SELECT count(*) FILTER (WHERE i.id IS NOT NULL) AS lost, count(DISTINCT sl.id) AS behind
FROM instance_manager.sleds sl
LEFT JOIN instance_manager.vmms v
       ON v.sled_id = sl.id AND v.ended_at IS NULL AND v.boot_number = sl.boot_number
LEFT JOIN instance_manager.instances i ON i.active_vmm_id = v.id AND i.state = 'running'
WHERE sl.boot_id IN (SELECT unnest($1::uuid[]))"""
"""PROBE's `lost` alone, found from the sleds instance-manager still holds at an ended boot (`behind`),
through the index of live VMMs by sled (every record here has its boot number: the bench's rack is
new): its cost falls with what is left to do, so that polling it closely after a power loss does not
take the cores the API needs to become truthful (at 150,000 instances, PROBE is a second's work for
PostgreSQL, the view's several)."""
POLL_EVERY = max(1.0, INSTANCES / 30_000)
"""Seconds between polls outside the truth phase: a poll's cost grows with the instances, and should not
take a share of the cores the phase measures."""


async def counts(db: asyncpg.Pool, ended: list[uuid.UUID]) -> tuple[int, int]:
    """(instances the API calls running, of which on a VMM of a boot that has ended), by PROBE."""
    row = await db.fetchrow(PROBE, ended)
    return row["running"], row["lost"]


async def check_probe(db: asyncpg.Pool, ids: list[uuid.UUID], ended: list[uuid.UUID]) -> None:
    """PROBE and LOST say what the view says, all read in one snapshot."""
    async with db.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        await conn.execute("SET LOCAL search_path TO instance_manager")
        t0 = time.monotonic()
        view = await conn.fetchrow(COUNTS, ids, 15, 60, 600, ended)
        t1 = time.monotonic()
        probe = await conn.fetchrow(PROBE, ended)
        t2 = time.monotonic()
        lost = await conn.fetchval(LOST, ended)
        t3 = time.monotonic()
    assert (probe["running"], probe["lost"], lost) == (view["running"], view["lost"], view["lost"]), (
        dict(probe),
        dict(view),
        lost,
    )
    print(f"  the probes agree with the view: {probe['running']} running, {lost} lost; PROBE "
          f"{(t2 - t1) * 1000:.0f} ms, LOST {(t3 - t2) * 1000:.0f} ms, the view {(t1 - t0) * 1000:.0f} ms",
          flush=True)  # fmt: skip


async def in_parallel(n: int, one: Callable[[int], Awaitable[None]]) -> None:
    """`one(i)` for i in range(n), by CALLERS workers, with progress."""
    queue = iter(range(n))
    done = 0

    async def worker() -> None:
        nonlocal done
        for i in queue:
            await one(i)
            done += 1

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            print(f"    {done}/{n}", flush=True)

    ticker = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(worker() for _ in range(CALLERS)))
    finally:
        ticker.cancel()


Samples = list[tuple[float, int, int]]
"""(seconds since the start of a phase, instances running as the API says, of which lost in truth)."""


async def until(
    db: asyncpg.Pool,
    ended: list[uuid.UUID],
    done: Callable[[int, int], bool],
    what: str,
    samples: Samples,
    t0: float,
    limit: float = 3600,
) -> float:
    """Seconds since t0 until done(running, lost) holds, polled every POLL_EVERY seconds, at most `limit`;
    every poll is kept in `samples` for the plot."""
    last = 0.0
    while True:
        running, lost = await counts(db, ended)
        now = time.monotonic()
        samples.append((now - t0, running, lost))
        if done(running, lost):
            return now - t0
        if now - last >= PROGRESS_EVERY:
            print(f"    {what}: {now - t0:6.1f}s  running {running}/{INSTANCES}, lost {lost}", flush=True)
            last = now
        if now - t0 > limit:
            raise TimeoutError(f"{what}: not reached after {limit:.0f} s (running {running}, lost {lost})")
        await asyncio.sleep(POLL_EVERY)


async def until_truthful(db: asyncpg.Pool, ended: list[uuid.UUID], samples: Samples, t0: float) -> float:
    """Seconds since t0 until the API calls no lost instance running, by LOST, polled as closely as its
    cost allows (each poll waits twice as long as the last one took, so that at most a third of a core
    goes to polling). The plot takes what the API calls running in these few seconds to be what is
    lost: a restart that finishes within them is left out of its curve."""
    last = 0.0
    while True:
        began = time.monotonic()
        row = await db.fetchrow(LOST, ended)
        now = time.monotonic()
        samples.append((now - t0, row["lost"], row["lost"]))
        if row["lost"] == 0:
            return now - t0
        if now - last >= 0.5:
            print(f"    {now - t0:5.2f}s  lost {row['lost']} still called running; sleds at an ended boot "
                  f"{row['behind']}; a poll {(now - began) * 1000:.0f} ms", flush=True)  # fmt: skip
            last = now
        if now - t0 > 600:
            raise TimeoutError(f"API truthful: not reached after 600 s ({row['lost']} lost)")
        await asyncio.sleep(max(0.02, 2 * (now - began)))


async def restart_story(db: asyncpg.Pool) -> list[str]:
    """How many automatic restarts the instances took, and why the ones after the first failed: the
    power loss should cost each instance one restart; any more is time the rack spent not running it."""
    shape = r"[0-9a-f]{8}-[0-9a-f-]{27}|\d+(\.\d+)?"  # ids and numbers, so that like reasons group
    tries = await db.fetch(
        "SELECT auto_restarts, count(*) AS n FROM instance_manager.instances GROUP BY 1 ORDER BY 1"
    )
    why = await db.fetch(
        "SELECT regexp_replace(coalesce(last_error, '(none)'), $1, '#', 'g') AS reason, count(*) AS n "
        "FROM instance_manager.instances WHERE auto_restarts > 1 GROUP BY 1 ORDER BY 2 DESC LIMIT 5",
        shape,
    )
    sagas = await db.fetch(
        "SELECT kind, status, regexp_replace(coalesce(error, ''), $1, '#', 'g') AS error, count(*) AS n "
        "FROM instance_manager.sagas WHERE status <> 'done' GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 5",
        shape,
    )
    lines = ["restarts per instance: " + ", ".join(f"{r['auto_restarts']}: {r['n']}" for r in tries)]
    lines += [f"  more than one, last error: {r['n']} {r['reason'][:100]}" for r in why]
    lines += [f"  saga {r['kind']} {r['status']}: {r['n']} {r['error'][:100]}" for r in sagas]
    return lines


def reconcile_pass_seconds(stack: Stack, reconciler: str) -> tuple[float, int]:
    """One of recovery's reconcilers' passes so far: (total seconds, count), from its /metrics."""
    text = urllib.request.urlopen(stack.http_url("recovery"), timeout=10).read().decode()

    def total(name: str) -> float:
        series = rf'^{name}{{[^}}]*reconciler="{reconciler}"[^}}]*}} (\S+)$'
        return sum(float(v) for v in re.findall(series, text, re.M))

    return total("rackplane_reconcile_pass_duration_seconds_sum"), int(
        total("rackplane_reconcile_pass_duration_seconds_count")
    )


def plot(samples: Samples, truthful: float, back: float, fresh: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    ax.plot(t, [s[1] for s in samples], label="running, as the API says")
    ax.plot(t, [s[1] - s[2] for s in samples], label="running, in truth (on a VMM of the new boot)")
    ax.axvline(truthful, color="grey", linestyle=":", label=f"API truthful ({truthful:.2f} s)")
    ax.axvline(back, color="grey", linestyle="--", label=f"all running again ({back:.1f} s)")
    ax.set_xlabel("seconds since every sled rebooted")
    ax.set_ylabel("instances")
    ax.set_title(
        f"Rack-wide power loss: {SLEDS} sleds, {INSTANCES} best_effort instances "
        f"(fresh starts: {fresh:.1f} s)"
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT)
    plt.close(fig)


async def test_power_loss_of_the_whole_rack() -> None:
    per_sled = -(-INSTANCES // SLEDS) + 4
    env = {
        "RACKPLANE_SLEDS": str(SLEDS),
        "RACKPLANE_SLED_SHAPES": f"{per_sled}:{per_sled}",
        "RACKPLANE_VMM_START_DELAY": "0",
        "RACKPLANE_LOG": "WARNING",
        "RACKPLANE_TRACES": "none",
        **PRODUCTION,
    }
    print(f"\nscale benchmark: {SLEDS} sleds, {INSTANCES} instances", flush=True)
    async with private_rack("scale", timeout=600, **UNLIMITED, **env) as (stack, client, db):
        await asyncio.sleep(INVENTORY_EVERY)  # every sled has reported since it was announced
        with cpu_split(stack) as idle:
            await asyncio.sleep(IDLE)
        idle_line = f"idle rack: {sum(idle.values()) / IDLE:.2f} cores busy: " + ", ".join(
            f"{k} {v / IDLE:.2f}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1]) if v / IDLE >= 0.005
        )
        print(f"  {idle_line}", flush=True)
        quota = Quota(vcpus=10**7, ram_bytes=10**16, disk_bytes=10**17)
        for silo in (silo_of(i) for i in range(0, INSTANCES, SILO_SIZE)):
            await client.silo_create(silo, quota=quota)
            await client.project_create(silo, "p")

        print("  creating", flush=True)

        async def create(i: int) -> None:
            await client.instance_create(
                silo_of(i), "p", f"vm-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB,
                auto_restart=AutoRestart.best_effort,
            )  # fmt: skip

        await in_parallel(INSTANCES, create)

        print("  starting (the baseline)", flush=True)
        t0 = time.monotonic()

        async def start(i: int) -> None:
            await client.instance("start", silo_of(i), "p", f"vm-{i}")

        await in_parallel(INSTANCES, start)
        ids = [r["id"] for r in await db.fetch("SELECT id FROM instance_manager.instances")]
        fresh = await until(
            db, [], lambda running, lost: running == INSTANCES, "fresh starts", [], t0,
            limit=max(3600, INSTANCES / 10),
        )  # fmt: skip
        print(f"  {INSTANCES} fresh starts: {fresh:.1f}s ({INSTANCES / fresh:.0f}/s)", flush=True)

        before = {r: reconcile_pass_seconds(stack, r) for r in RECONCILERS}
        await asyncio.sleep(25)  # a few passes at steady state (every RACKPLANE_RECONCILE_INTERVAL)
        passes = {}
        for r, (sum0, n0) in before.items():
            sum1, n1 = reconcile_pass_seconds(stack, r)
            passes[r] = ((sum1 - sum0) / max(n1 - n0, 1), n1 - n0)
        mem = memory(stack)
        for r, (pass_s, n) in passes.items():  # printed now too: a long run's early phases are worth keeping
            print(f"  reconcile pass at steady state ({r}): {pass_s * 1000:.1f} ms, {n} passes", flush=True)
        memory_line = "memory (PSS, MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(mem.items()))
        print(f"  {memory_line}", flush=True)

        ended = [r["boot_id"] for r in await db.fetch("SELECT boot_id FROM instance_manager.sleds")]
        await check_probe(db, ids, ended)
        print("  power loss: every sled reboots", flush=True)
        samples: Samples = []
        t0 = time.monotonic()
        announced: list[float] = []  # when the simulator had rebooted and announced every sled
        reboot = asyncio.create_task(client.sim_rack_reboot())
        reboot.add_done_callback(lambda _: announced.append(time.monotonic() - t0))
        truthful = await until_truthful(db, ended, samples, t0)
        print(f"  API truthful after {truthful:.2f}s", flush=True)
        await reboot
        if UNTIL == "truthful":
            print(f"  announced {announced[0]:.2f}s; BENCH_UNTIL=truthful: the run ends here", flush=True)
            await check_probe(db, ids, ended)
            return
        back = await until(
            db, ended, lambda running, lost: running == INSTANCES and lost == 0, "all back", samples, t0,
            limit=max(3600, 3 * fresh),
        )  # fmt: skip
        samples += [(back + POLL_EVERY, *(await counts(db, ended)))]
        await check_probe(db, ids, ended)
        story = await restart_story(db)
        plot(samples, truthful, back, fresh)

    rows = [
        (
            f"baseline: start {INSTANCES} fresh instances",
            f"{fresh:8.2f}s",
            f"{INSTANCES / fresh:.0f} starts/s",
        ),
        ("power loss: every sled announced its new boot", f"{announced[0]:8.2f}s", "the simulator's share"),
        ("power loss: API stops calling lost ones running", f"{truthful:8.2f}s", f"{truthful / fresh:.3f}x"),
        ("power loss: all running again", f"{back:8.2f}s", f"{back / fresh:.2f}x baseline"),
    ]
    rows += [
        (f"reconcile pass at steady state ({r})", f"{pass_s * 1000:7.1f}ms", f"{n} passes")
        for r, (pass_s, n) in passes.items()
    ]
    print(f"\nRESULT sleds={SLEDS} instances={INSTANCES}")
    for what, value, ratio in rows:
        print(f"  {what:<50} {value}  ({ratio})")
    print(f"  {idle_line}")
    print(f"  {memory_line}")
    print("  " + "\n  ".join(story))
    print(f"  plot: {PLOT}")
