"""Acceptance 6: every delta delivered twice, and out of order, gives the same totals as once in order.

Deltas are published straight to accounting's stream, each with its own message id, so the broker's
duplicate window does not hide the repeats: accounting's generation fence must.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg

from deploy.stack import Stack
from rackctl.client import Client
from services.accounting.ledger import Charge, Decided, apply_batch
from shared import bus
from shared.db import create_pool
from shared.messages import ProvisionDelta
from shared.topology import subjects
from tests.conftest import GiB, JetStreamAs, assert_invariants, counter, eventually, unique


def lifecycle_deltas(
    instance_id: uuid.UUID, project_id: uuid.UUID, silo_id: uuid.UUID, rng: random.Random
) -> list[ProvisionDelta]:
    """A plausible history: create (disk), then start/stop cycles, sometimes a delete at the end."""
    vcpus, ram, disk = rng.randint(1, 8), rng.randint(1, 16) * GiB, rng.randint(1, 50) * GiB
    out, gen = [], 1

    def d(v: int, r: int, k: int) -> ProvisionDelta:
        return ProvisionDelta(
            instance_id=instance_id,
            project_id=project_id,
            silo_id=silo_id,
            generation=gen,
            vcpus=v,
            ram_bytes=r,
            disk_bytes=k,
        )

    out.append(d(0, 0, disk))
    for _ in range(rng.randint(1, 4)):
        gen += rng.randint(1, 3)
        out.append(d(vcpus, ram, disk))
        gen += rng.randint(1, 3)
        if rng.random() < 0.8:
            out.append(d(0, 0, disk))
    if rng.random() < 0.3:
        gen += 1
        out.append(d(0, 0, 0))
    return out


async def silo_ids(client: Client, db: asyncpg.Pool) -> tuple[str, str, uuid.UUID, uuid.UUID]:
    silo, proj = unique("fence"), unique("proj")
    s = await client.silo_create(silo)
    p = await client.project_create(silo, proj)
    project_id = uuid.UUID(p["id"])

    async def known() -> bool:  # accounting learns of the silo and the project from their creation events
        return bool(await db.fetchval("SELECT count(*) FROM accounting.projects WHERE id = $1", project_id))

    await eventually(known)
    return silo, proj, uuid.UUID(s["id"]), uuid.UUID(p["id"])


async def test_duplicated_and_reordered_deltas_give_the_same_totals(
    client: Client, db: asyncpg.Pool, jetstream_as: JetStreamAs
) -> None:
    js = await jetstream_as("instance-manager")  # the only identity that may send deltas
    rng = random.Random(4277)
    once_silo, once_proj, once_silo_id, once_proj_id = await silo_ids(client, db)
    twice_silo, twice_proj, twice_silo_id, twice_proj_id = await silo_ids(client, db)
    dup_before = await counter(client, "accounting", "deltas.duplicate")
    stale_before = await counter(client, "accounting", "deltas.stale")

    once: list[ProvisionDelta] = []
    twice: list[ProvisionDelta] = []
    for _ in range(30):
        seed = rng.random()
        once += lifecycle_deltas(uuid.uuid4(), once_proj_id, once_silo_id, random.Random(seed))
        twice += lifecycle_deltas(uuid.uuid4(), twice_proj_id, twice_silo_id, random.Random(seed))

    for d in once:
        await bus.publish(js, subjects.provision_delta(once_silo, once_proj, d.instance_id), d, source="test")
    shuffled = twice + twice
    rng.shuffle(shuffled)
    for d in shuffled:
        await bus.publish(
            js, subjects.provision_delta(twice_silo, twice_proj, d.instance_id), d, source="test"
        )

    async def settled() -> bool:
        a = (await client.usage(once_silo))["usage"]
        b = (await client.usage(twice_silo))["usage"]
        applied = await db.fetchval(
            "SELECT count(*) FROM accounting.instance_charges c JOIN accounting.silos s ON s.id = c.silo_id "
            "WHERE s.name = ANY($1::text[]) AND c.generation > 0",
            [once_silo, twice_silo],
        )
        return a == b and applied == 60 and a["disk_bytes"] > 0

    await eventually(settled, timeout=20)
    await asyncio.sleep(0.5)
    assert (await client.usage(once_silo))["usage"] == (await client.usage(twice_silo))["usage"]
    assert await counter(client, "accounting", "deltas.duplicate") > dup_before
    assert await counter(client, "accounting", "deltas.stale") > stale_before
    await assert_invariants(db, at_rest=False)


async def test_concurrent_applications_of_one_charge_serialize(
    client: Client, db: asyncpg.Pool, stack: Stack
) -> None:
    """Ten transactions apply the same charge at once (as replicas would, under READ COMMITTED): the
    instance's row lock makes them serialize, so exactly one moves the totals."""
    silo, proj, silo_id, proj_id = await silo_ids(client, db)
    delta = ProvisionDelta(
        instance_id=uuid.uuid4(),
        project_id=proj_id,
        silo_id=silo_id,
        generation=7,
        vcpus=2,
        ram_bytes=GiB,
        disk_bytes=GiB,
    )
    dsn = stack.service_database_urls["accounting"]  # accounting's own role, as the service would
    pool = await create_pool(dsn, "accounting", min_size=10, max_size=10)
    try:
        async with pool.acquire() as conn, conn.transaction():  # the instance exists, with its disk
            first = delta.model_copy(update={"generation": 1, "vcpus": 0, "ram_bytes": 0})
            await apply_batch(conn, [Charge(silo, proj, first)])
        start = asyncio.Event()

        async def apply_once() -> str:
            async with pool.acquire() as conn, conn.transaction():
                await start.wait()
                [result] = await apply_batch(conn, [Charge(silo, proj, delta)])
                assert isinstance(result, Decided)
                await asyncio.sleep(0.05)  # hold the transaction open while the others queue up
                return result.outcome.value + (" (repeat)" if result.repeat else "")

        tasks = [asyncio.create_task(apply_once()) for _ in range(10)]
        await asyncio.sleep(0.1)
        start.set()
        results = await asyncio.gather(*tasks)
    finally:
        await pool.close()
    assert sorted(results) == ["applied"] + ["applied (repeat)"] * 9
    assert (await client.usage(silo))["usage"] == {"vcpus": 2, "ram_bytes": GiB, "disk_bytes": GiB}
    await assert_invariants(db, at_rest=False)
