"""Warm pools (issue: pre-provisioned VMs handed to exactly one customer, marked once they may hold
customer data). Each test has its own stack: they fill pools, inject faults and reboot sleds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rackctl.client import Client
from rackctl.invariants import pool_vms_handed_out_once
from shared import bus
from shared.bus import CommandError
from shared.messages import PoolChanged, PoolView, SimFaults
from shared.topology import subjects
from tests.conftest import (
    GiB,
    Rack,
    assert_invariants,
    connect_as,
    eventually,
    private_rack,
    unique,
    usage_is,
)

CHARGE_OF = (
    "SELECT vcpus, ram_bytes, disk_bytes, generation FROM accounting.instance_charges WHERE instance_id = $1"
)


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    async with private_rack("pools", RACKPLANE_SLEDS="2") as made:
        yield made


async def pool_of(client: Client, size: int) -> tuple[str, str, str]:
    silo, proj, pool = unique("silo"), unique("proj"), "warm"
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    await client.pool_create(silo, proj, pool, size=size, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    return silo, proj, pool


async def idle(client: Client, silo: str, proj: str, pool: str, n: int) -> Any:
    async def check() -> Any:
        v = await client.pool("show", silo, proj, pool)
        return v if v["idle"] == n else None

    return await eventually(check, timeout=30)


async def freeze_provisioning(client: Client, on: bool) -> None:
    """Sleds take commands but do nothing with them: no new pool VM can become idle meanwhile."""
    for sled in ("sled-0", "sled-1"):
        await client.sim_faults(SimFaults(sled_id=sled, drop_commands=on))


async def test_fifty_concurrent_picks_from_a_pool_of_twenty(rack: Rack) -> None:
    _, client, db = rack
    silo, proj, pool = await pool_of(client, 20)
    await idle(client, silo, proj, pool, 20)
    await freeze_provisioning(client, True)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(client.instance_from_pool(silo, proj, f"c-{i}", pool, require=True) for i in range(50)),
                return_exceptions=True,
            ),
            timeout=30,  # no deadlock
        )
    finally:
        await freeze_provisioning(client, False)
    picked = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, CommandError)]
    assert len(picked) == 20 and len(refused) == 30, results
    assert all(r.code == "conflict" and "has no idle VM" in r.message for r in refused)
    assert len({p["id"] for p in picked}) == 20  # twenty distinct VMs, none handed out twice
    assert all(p["source"] == "pool" and p["state"] == "running" for p in picked)
    # Each was marked in the statement that claimed it, and carries its new name.
    rows = await db.fetch(
        "SELECT name, has_customer_data_at FROM instance_manager.instances WHERE id = ANY($1::uuid[])",
        [p["id"] for p in picked],
    )
    assert all(r["has_customer_data_at"] is not None and r["name"].startswith("c-") for r in rows)
    await idle(client, silo, proj, pool, 20)  # replenished after the picks
    await assert_invariants(db)
    assert await pool_vms_handed_out_once(client.nc.jetstream()) == []


async def test_an_empty_pool_falls_back_to_a_new_instance_and_says_so(rack: Rack) -> None:
    _, client, db = rack
    silo, proj, pool = await pool_of(client, 0)
    made = await client.instance_from_pool(silo, proj, "fresh", pool)
    assert made["source"] == "new" and "had no idle VM" in made["note"]
    assert (made["vcpus"], made["ram_bytes"], made["disk_bytes"]) == (1, GiB, GiB)  # the pool's shape
    assert made["state"] in ("starting", "running")
    with pytest.raises(CommandError, match="has no idle VM"):
        await client.instance_from_pool(silo, proj, "strict", pool, require=True)
    await assert_invariants(db)


async def test_destroyed_unpicked_vms_are_marked_and_the_pool_keeps_its_size(rack: Rack) -> None:
    _, client, db = rack
    silo, proj, pool = await pool_of(client, 6)
    await idle(client, silo, proj, pool, 6)
    await client.pool("resize", silo, proj, pool, size=2)
    await idle(client, silo, proj, pool, 2)

    async def retired() -> bool:
        n = await db.fetchval(
            "SELECT count(*) FROM instance_manager.instances i "
            "JOIN instance_manager.pools p ON p.id = i.pool_id WHERE p.name = $1 AND i.state = 'destroyed'",
            pool,
        )
        return n >= 4

    await eventually(retired, timeout=20)
    unmarked = await db.fetchval(
        "SELECT count(*) FROM instance_manager.instances "
        "WHERE state = 'destroyed' AND has_customer_data_at IS NULL"
    )
    assert unmarked == 0
    await assert_invariants(db)


async def test_the_pool_refills_after_a_sled_holding_its_vms_reboots(rack: Rack) -> None:
    _, client, db = rack
    silo, proj, pool = await pool_of(client, 8)
    await idle(client, silo, proj, pool, 8)
    await client.sim_sled("reboot", "sled-0")

    async def dipped() -> bool:
        return (await client.pool("show", silo, proj, pool))["idle"] < 8

    await eventually(dipped, timeout=10)
    await idle(client, silo, proj, pool, 8)
    await assert_invariants(db)


async def test_pool_vms_are_charged_like_any_and_a_pick_moves_no_charge(rack: Rack) -> None:
    _, client, db = rack
    silo, proj, pool = await pool_of(client, 4)
    await idle(client, silo, proj, pool, 4)
    await assert_invariants(db)  # the idle pool VMs are charged as the running instances they are
    await usage_is(client, {"vcpus": 4, "ram_bytes": 4 * GiB, "disk_bytes": 4 * GiB}, silo, proj)

    await freeze_provisioning(client, True)
    try:
        picked = await client.instance_from_pool(silo, proj, "mine", pool)
        before = await db.fetchrow(CHARGE_OF, picked["id"])
        await asyncio.sleep(1)
        after = await db.fetchrow(CHARGE_OF, picked["id"])
        assert before == after and (after["vcpus"], after["ram_bytes"]) == (1, GiB)  # no delta for a pick
        await assert_invariants(db, at_rest=False)  # totals exact while the pool replenishes
    finally:
        await freeze_provisioning(client, False)
    await idle(client, silo, proj, pool, 4)
    await assert_invariants(db)
    await usage_is(client, {"vcpus": 5, "ram_bytes": 5 * GiB, "disk_bytes": 5 * GiB}, silo, proj)


async def test_the_checker_would_see_a_vm_handed_out_twice(rack: Rack) -> None:
    """The check reads the durable pool events: a second "picked" event for one VM is a violation."""
    _, client, _ = rack
    silo, proj, pool = await pool_of(client, 1)
    await idle(client, silo, proj, pool, 1)
    picked = await client.instance_from_pool(silo, proj, "once", pool, require=True)
    js = client.nc.jetstream()

    async def announced() -> bool:
        return await pool_vms_handed_out_once(js) == []

    await eventually(announced)
    v = await client.pool("show", silo, proj, pool)
    forged = PoolChanged(pool=PoolView.model_validate(v), change="picked", instance_id=picked["id"])
    im = await connect_as(rack[0], "instance-manager")  # the only identity that may publish pool events
    try:
        await bus.publish(im.jetstream(), subjects.event(silo, "pool", "changed"), forged, source="test")
    finally:
        await im.close()
    twice = [f"pool VM {picked['id']} was handed out 2 times"]

    async def seen_twice() -> bool:  # the pick's own event may still be on its way, through the outbox
        return await pool_vms_handed_out_once(js) == twice

    await eventually(seen_twice)
