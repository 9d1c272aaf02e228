"""The HA stack loses a broker node, and then the database primary's node, while 8 callers start
instances: every start answered ok runs, the charges are exact (`usage audit` finds no drift), the checker
finds nothing, and the old primary comes back as the standby.

The broker node is the one leading SLED_CMD (the orders to sleds: the start pipeline stalls until a new
leader is elected); the database node is Patroni and its PostgreSQL, killed together (SIGKILL), as a
machine is lost. Each is started again, as an operator would, before the next loss: one machine at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from deploy.identities import ACCOUNT
from deploy.nats_cluster import NatsCluster
from deploy.patroni import PatroniCluster
from rackctl.client import Client
from tests.conftest import GiB, Rack, assert_invariants, eventually, private_rack, unique, usage_is
from tests.ha.test_broker_loss import SILENCE, Calls, all_running, caller
from tests.test_cli import assert_ok
from tests.test_usage_audit import audit

pytestmark = pytest.mark.ha

CALLERS = 8
PER_CALLER = 40
CALL_TIMEOUT = 5.0


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    async with private_rack("ha-both", RACKPLANE_HA="1", RACKPLANE_SLEDS="8", **SILENCE) as made:
        yield made


async def test_a_broker_node_then_the_database_primary_lost_while_starts_run(rack: Rack) -> None:
    stack, client, db = rack
    nats, pg = stack.nats, stack.postgres
    assert isinstance(nats, NatsCluster) and isinstance(pg, PatroniCluster)
    silo, proj = unique("ha"), unique("proj")
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    names = [[f"vm-{c}-{i}" for i in range(PER_CALLER)] for c in range(CALLERS)]
    for mine in names:
        for name in mine:
            await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    calls, acked, done = Calls(), set[str](), asyncio.Event()
    clients = [await Client.connect(stack.nats_url, timeout=CALL_TIMEOUT) for _ in names]
    callers = asyncio.gather(
        *(caller(c, silo, proj, mine, calls, acked, done) for c, mine in zip(clients, names, strict=True))
    )
    try:
        await asyncio.sleep(1.5)
        # a broker node: the one leading the orders to sleds, down until a new leader is elected and a
        # little longer
        leader = nats.stream_leader("SLED_CMD", ACCOUNT)
        assert leader is not None
        await asyncio.to_thread(nats.kill, leader)
        await eventually(lambda: _elsewhere(nats, leader), timeout=30)  # a new leader on a survivor
        await asyncio.sleep(2)
        await asyncio.to_thread(nats.start_node, leader)
        await asyncio.sleep(2)
        # then the database primary's node, Patroni and PostgreSQL together
        old = pg.primary()
        assert old is not None
        db_lost = time.monotonic()
        await asyncio.to_thread(pg.kill_node, old)
        new = await asyncio.to_thread(pg.wait_primary, pg.ttl + 15, old)
        promoted = time.monotonic() - db_lost
        await asyncio.sleep(3)
        done.set()
        await callers
    finally:
        done.set()
        await asyncio.gather(callers, return_exceptions=True)
        for c in clients:
            await c.close()
    print(
        f"\nbroker node {nats.nodes[leader].name} lost, then database primary node {old}: node {new} led "
        f"{promoted:.1f}s after, no successful start for {calls.gap('start', db_lost):.1f}s; "
        f"{len(calls.log)} calls, {len(acked)} starts acknowledged, failed {calls.failed()}"
    )
    assert acked, "no start was acknowledged"

    await all_running(client, silo, proj, acked, timeout=60)
    n, every = len(acked), sum(len(mine) for mine in names)
    await usage_is(client, {"vcpus": n, "ram_bytes": n * GiB, "disk_bytes": every * GiB}, silo)
    await assert_invariants(db, timeout=60)
    assert_ok(await audit(stack, silo, "--settle", "30"))
    # the old primary's node back, as the synchronous standby of the new primary
    await asyncio.to_thread(pg.start_node, old)
    await asyncio.to_thread(pg.wait_standby, old, 120)
    assert pg.primary() == new


async def _elsewhere(nats: NatsCluster, lost: int) -> bool:
    return await asyncio.to_thread(nats.stream_leader, "SLED_CMD", ACCOUNT) not in (None, lost)
