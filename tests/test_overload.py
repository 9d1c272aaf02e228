"""Overload makes the control plane slower, never wrong (issue 33): 600 starts sent at once, with a
transition timeout (3 s) far shorter than the burst takes, all end running, and none was failed,
restarted or charged twice on the way. A start waiting its turn is not stuck: stuck is judged on the
sled's evidence (recovery's `stuck_instances`, the instance-manager's `stuck` order)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from shared.messages import Quota
from tests.bench import UNLIMITED
from tests.conftest import FAST, GiB, Rack, assert_invariants, eventually, private_rack, wait_state

INSTANCES = 600
TRANSITION_TIMEOUT = 3
SLED_UNKNOWN_AFTER = float(FAST["RACKPLANE_SLED_UNKNOWN_AFTER"])


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    env = {
        "RACKPLANE_SLEDS": "8",
        "RACKPLANE_SLED_SHAPES": "256:512",  # room for 8 x 256 one-vCPU, one-GiB instances
        "RACKPLANE_TRANSITION_TIMEOUT": str(TRANSITION_TIMEOUT),
        "RACKPLANE_LOG": "WARNING",
        "RACKPLANE_TRACES": "none",
    }
    async with private_rack("overload", timeout=60, **UNLIMITED, **env) as made:
        yield made


async def test_600_starts_at_once_all_run_none_failed_none_restarted(rack: Rack) -> None:
    _, client, db = rack
    await client.silo_create("load", quota=Quota(vcpus=10**6, ram_bytes=10**15, disk_bytes=10**16))
    await client.project_create("load", "p")
    gate = asyncio.Semaphore(32)  # the creates are not what is measured: 32 callers, as the bench

    async def create(i: int) -> None:
        async with gate:
            await client.instance_create("load", "p", f"vm-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    await asyncio.gather(*(create(i) for i in range(INSTANCES)))

    t0 = time.monotonic()
    await asyncio.gather(*(client.instance("start", "load", "p", f"vm-{i}") for i in range(INSTANCES)))
    replied = time.monotonic() - t0

    async def all_running() -> bool:
        n = await db.fetchval("SELECT count(*) FROM instance_manager.instances WHERE state = 'running'")
        return n >= INSTANCES

    await eventually(all_running, timeout=60, interval=0.2)
    burst = time.monotonic() - t0
    # The burst took several transition timeouts: what recovery saw was waiting, not stuck.
    told = client.told_busy
    print(f"\n{INSTANCES} starts: replied in {replied:.1f} s, all running in {burst:.1f} s, {told} told busy")
    rows = await db.fetch(
        "SELECT i.name, i.failed_at, i.last_error, i.auto_restarts FROM instance_manager.instances i "
        "JOIN instance_manager.projects p ON p.id = i.project_id "
        "JOIN instance_manager.silos s ON s.id = p.silo_id WHERE s.name = 'load'"
    )
    assert len(rows) == INSTANCES
    hurt = [dict(r) for r in rows if r["failed_at"] or r["last_error"] or r["auto_restarts"]]
    assert not hurt, f"{len(hurt)} instances failed or restarted while they waited: {hurt[:5]}"
    await assert_invariants(db)


async def test_a_start_waits_out_a_silence_it_cannot_judge(rack: Rack) -> None:
    """No inventory applied for a whole window (RACKPLANE_SLED_UNKNOWN_AFTER, 3 s here): the silence may be
    instance-manager's own (a burst holding the connections and cores its inventories wait for, as the
    test above makes on a loaded machine) or the whole rack's. A start placed meanwhile waits for the
    sleds' word instead of failing with "no active sled that answers". Made deterministic by pausing
    the sled agent (every simulated sled) for longer than the window."""
    stack, client, _ = rack
    await client.silo_create("hush")
    await client.project_create("hush", "p")
    await client.instance_create("hush", "p", "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    agent = stack.services["sled_agent"].proc
    assert agent is not None
    agent.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(SLED_UNKNOWN_AFTER + 1)  # every sled is silent to instance-manager now

        async def wake() -> None:
            await asyncio.sleep(2)
            agent.send_signal(signal.SIGCONT)

        woken = asyncio.create_task(wake())
        v = await client.instance("start", "hush", "p", "vm")  # was: refused at once
        assert v["state"] in ("starting", "running"), v
        await woken
    finally:
        agent.send_signal(signal.SIGCONT)
    v = await wait_state(client, "hush", "p", "vm", "running")
    assert v["last_error"] is None and v["auto_restarts"] == 0, v


async def test_inventories_are_applied_while_a_burst_of_starts_waits(rack: Rack) -> None:
    """The inventories (and reports, and charge outcomes) are applied on instance-manager's connections;
    a burst of starts must never hold them all, or every sled looks silent behind it. Twenty starts are
    held in their first step (their instances' rows locked here) for longer than the silence window:
    meanwhile every sled is still seen."""
    stack, client, db = rack
    await client.silo_create("jam")
    await client.project_create("jam", "p")
    names = [f"vm-{i}" for i in range(20)]
    for n in names:
        await client.instance_create("jam", "p", n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    assert stack.admin_database_url is not None
    admin = await asyncpg.connect(stack.admin_database_url)
    try:
        tx = admin.transaction()
        await tx.start()
        await admin.execute(
            "SELECT 1 FROM instance_manager.instances i JOIN instance_manager.projects p "
            "ON p.id = i.project_id JOIN instance_manager.silos s ON s.id = p.silo_id "
            "WHERE s.name = 'jam' FOR UPDATE OF i"
        )
        starts = [asyncio.create_task(client.instance("start", "jam", "p", n)) for n in names]
        await asyncio.sleep(SLED_UNKNOWN_AFTER + 1)
        silent = await db.fetch(
            "SELECT id, now() - last_seen_at AS silent FROM instance_manager.sleds "
            "WHERE last_seen_at < now() - make_interval(secs => $1)",
            SLED_UNKNOWN_AFTER,
        )
        await tx.rollback()
    finally:
        await admin.close()
    assert not silent, f"sleds looked silent while starts held instance-manager's connections: {silent}"
    await asyncio.gather(*starts)
    for n in names:
        await wait_state(client, "jam", "p", n, "running")
