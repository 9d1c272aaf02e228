"""How long the API stops answering when `make run HA=1` loses one machine, by kind of loss, under 8
callers cycling instances through `instance start` and `instance show` (tests/ha/callers.py), each loss
repeated HA_KILLS times (5): a broker node (the one leading a stream), a process of a replicated service,
the database primary's node (Patroni and its PostgreSQL). Each test prints, per loss and as p50 and max,
the gap in successful `show` and `start` calls beside the same gap in a window with no loss, and how many
attempts failed: in flight at the loss, or sent after it. Every lost process is started again before the
next loss; at the end the checker finds nothing and every service process is alive.

    .venv/bin/pytest -n 0 -m ha -s -p no:cacheprovider -o timeout=900 tests/ha/test_measure_loss.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from deploy.identities import ACCOUNT
from deploy.nats_cluster import NatsCluster
from deploy.patroni import PatroniCluster, installed
from deploy.stack import REPLICATED, replica_key
from shared.db import ACK_TIMEOUT
from tests.conftest import Rack, assert_invariants, private_rack
from tests.ha.callers import Loss, callers, measure, summary
from tests.ha.test_broker_loss import SILENCE

pytestmark = [
    pytest.mark.ha,
    pytest.mark.timeout(900),
    pytest.mark.skipif(bool(installed()), reason="; ".join(installed())),
]

CALLERS = 8
KILLS = int(os.environ.get("HA_KILLS", "5"))
CALL_TIMEOUT = float(os.environ.get("HA_CALL_TIMEOUT", "5"))
"""The callers' timeout: what a call in flight on a lost connection waits before it fails."""
QUIET = 5.0
"""Seconds of calls with no loss before the first: the baseline gap."""
SETTLE = 3.0
"""Seconds of calls after a lost process is back, inside the measured window, before the next loss."""


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    env = {"RACKPLANE_HA": "1", "RACKPLANE_SLEDS": "8", **SILENCE}
    async with private_rack("measure", **env) as made:
        yield made
        stack = made[0]
        dead = [key for key, svc in stack.services.items() if not svc.alive]
        assert not dead, {key: stack.logs(key) for key in dead}


async def quiet(window: float = QUIET) -> tuple[float, float]:
    t = time.monotonic()
    await asyncio.sleep(window)
    return t, time.monotonic()


async def test_broker_node_loss(rack: Rack) -> None:
    """SIGKILL the node leading `EVENTS` (then `SLED_CMD`, alternately), 6 s down, started again."""
    stack, _, db = rack
    cluster = stack.nats
    assert isinstance(cluster, NatsCluster)
    losses: list[Loss] = []
    async with callers(rack, CALLERS, CALL_TIMEOUT) as (rec, _):
        base = measure(rec, "none", *await quiet())
        for k in range(KILLS):
            stream = ("EVENTS", "SLED_CMD")[k % 2]
            leader = await asyncio.to_thread(cluster.stream_leader, stream, ACCOUNT)
            assert leader is not None
            at = time.monotonic()
            await asyncio.to_thread(cluster.kill, leader)
            await asyncio.sleep(6)
            await asyncio.to_thread(cluster.start_node, leader)
            await asyncio.to_thread(cluster.wait_meta_leader)
            await asyncio.sleep(SETTLE)
            what = f"{cluster.nodes[leader].name} ({stream} leader)"
            losses.append(measure(rec, what, at, time.monotonic()))
    print("\n" + summary("broker node SIGKILL", losses, base.gaps), f"\n  failed: {rec.codes()}")
    assert not rec.lost, rec.lost
    await assert_invariants(db, timeout=30)
    assert max(x.gaps["show"] for x in losses) <= 5, "a broker node's loss stopped the API for over 5 s"
    # starts wait for the lost node's streams to elect new leaders (nats-server's Raft: 4 to 9 s) and for
    # the outbox relay's publish in flight to it to time out (ACK_TIMEOUT): docs/reliability.md
    assert max(x.gaps["start"] for x in losses) <= 9 + ACK_TIMEOUT + 5


@pytest.mark.parametrize("service", REPLICATED)
async def test_service_process_loss(rack: Rack, service: str) -> None:
    """SIGKILL one of the service's two processes (each in turn), 3 s down, started again."""
    stack, _, db = rack
    losses: list[Loss] = []
    async with callers(rack, CALLERS, CALL_TIMEOUT) as (rec, _):
        base = measure(rec, "none", *await quiet())
        for k in range(KILLS):
            key = (service, replica_key(service))[k % 2]
            at = time.monotonic()
            stack.services[key].send(signal.SIGKILL)
            await asyncio.to_thread(stack.services[key].wait)
            await asyncio.sleep(3)
            stack.start_service(service, replica=None if key == service else key)
            await asyncio.to_thread(stack.wait_replicas_ready)
            await asyncio.sleep(SETTLE)
            losses.append(measure(rec, key, at, time.monotonic()))
    print("\n" + summary(f"{service} process SIGKILL", losses, base.gaps), f"\n  failed: {rec.codes()}")
    assert not rec.lost, rec.lost
    # the other process takes every new command at once: none sent after the loss fails
    assert sum(x.after for x in losses) == 0, [x.line() for x in losses]
    await assert_invariants(db, timeout=30)


async def test_database_primary_node_loss(rack: Rack) -> None:
    """SIGKILL the primary's Patroni and PostgreSQL; the old primary started again once the standby
    leads, and back as the synchronous standby before the next loss."""
    stack, _, db = rack
    cluster = stack.postgres
    assert isinstance(cluster, PatroniCluster)
    losses: list[Loss] = []
    promoted: list[float] = []
    async with callers(rack, CALLERS, CALL_TIMEOUT) as (rec, _):
        base = measure(rec, "none", *await quiet())
        for _k in range(KILLS):
            old = await asyncio.to_thread(cluster.wait_primary)
            at = time.monotonic()
            await asyncio.to_thread(cluster.kill_node, old)
            stack.write_manifest()
            await asyncio.to_thread(cluster.wait_primary, cluster.ttl + 15, old)
            promoted.append(time.monotonic() - at)
            await asyncio.sleep(SETTLE)
            cluster.start_node(old)
            await asyncio.to_thread(cluster.wait_standby, old, 120)
            stack.write_manifest()
            await asyncio.sleep(SETTLE)
            losses.append(measure(rec, f"{cluster.members[old].name} (primary)", at, time.monotonic()))
    print(
        "\n" + summary("database primary's node SIGKILL", losses, base.gaps),
        f"\n  new primary after {', '.join(f'{p:.1f}' for p in promoted)} s (ttl {cluster.ttl} s)",
        f"\n  failed: {rec.codes()}",
    )
    assert not rec.lost, rec.lost
    await assert_invariants(db, timeout=30)
    worst = max(x.gaps["show"] for x in losses)
    assert worst <= cluster.ttl + 5, f"the API stopped for {worst:.1f}s (ttl {cluster.ttl}s)"
