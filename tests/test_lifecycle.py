"""Acceptance 2 and 3: the instance lifecycle, its charges, and the start interlock."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import SimFaults, VmmState
from tests.conftest import GiB, assert_invariants, usage_is, wait_state

ZERO = {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}


async def test_charges_follow_the_lifecycle(
    client: Client, db: asyncpg.Pool, project: tuple[str, str]
) -> None:
    silo, proj = project
    fleet_before = (await client.usage())["usage"]

    def fleet_plus(cpus: int, ram: int, disk: int) -> dict[str, int]:
        return {
            "vcpus": fleet_before["vcpus"] + cpus,
            "ram_bytes": fleet_before["ram_bytes"] + ram,
            "disk_bytes": fleet_before["disk_bytes"] + disk,
        }

    v = await client.instance_create(silo, proj, "db", vcpus=4, ram_bytes=8 * GiB, disk_bytes=20 * GiB)
    assert v["state"] == "stopped"
    disk_only = {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 20 * GiB}
    await usage_is(client, disk_only, silo, proj)

    started = await client.instance("start", silo, proj, "db")
    assert started["state"] in ("starting", "running")
    running = await wait_state(client, silo, proj, "db", "running")
    assert running["sled_id"] is not None
    charged = {"vcpus": 4, "ram_bytes": 8 * GiB, "disk_bytes": 20 * GiB}
    await usage_is(client, charged, silo, proj)
    await usage_is(client, charged, silo)
    await usage_is(
        client,
        fleet_plus(4, 8 * GiB, 20 * GiB),
    )
    await assert_invariants(db)

    await client.instance("stop", silo, proj, "db")
    await wait_state(client, silo, proj, "db", "stopped")
    await usage_is(client, disk_only, silo, proj)
    await usage_is(client, disk_only, silo)
    await usage_is(
        client,
        fleet_plus(0, 0, 20 * GiB),
    )

    await client.instance("delete", silo, proj, "db")
    with pytest.raises(CommandError, match="no instance"):
        await client.instance("show", silo, proj, "db")
    await usage_is(client, ZERO, silo, proj)
    await usage_is(client, ZERO, silo)
    await usage_is(
        client,
        fleet_before,
    )
    await assert_invariants(db)


async def test_ten_concurrent_starts_make_one_vmm_and_one_charge(
    client: Client, db: asyncpg.Pool, project: tuple[str, str]
) -> None:
    silo, proj = project
    v = await client.instance_create(silo, proj, "app", vcpus=2, ram_bytes=2 * GiB, disk_bytes=GiB)
    replies = await asyncio.gather(*(client.instance("start", silo, proj, "app") for _ in range(10)))
    assert all(r["state"] in ("starting", "running") for r in replies)
    await wait_state(client, silo, proj, "app", "running")

    vmms = await db.fetchval("SELECT count(*) FROM instance_manager.vmms WHERE instance_id = $1", v["id"])
    sagas = await db.fetchval(
        "SELECT count(*) FROM instance_manager.sagas "
        "WHERE kind = 'instance-start' AND params->>'instance_id' = $1",
        v["id"],
    )
    assert (vmms, sagas) == (1, 1)
    await usage_is(client, {"vcpus": 2, "ram_bytes": 2 * GiB, "disk_bytes": GiB}, silo, proj)

    # Starting a running instance is a successful no-op: same VMM, same charge.
    again = await client.instance("start", silo, proj, "app")
    assert (
        again["state"] == "running"
        and again["active_vmm_id"] == (await client.instance("show", silo, proj, "app"))["active_vmm_id"]
    )
    assert (
        await db.fetchval("SELECT count(*) FROM instance_manager.vmms WHERE instance_id = $1", v["id"]) == 1
    )
    await assert_invariants(db)


async def test_starting_a_stopping_instance_is_a_conflict(
    client: Client, db: asyncpg.Pool, project: tuple[str, str]
) -> None:
    silo, proj = project
    await client.instance_create(silo, proj, "slow", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "slow")
    running = await wait_state(client, silo, proj, "slow", "running")
    sled = running["sled_id"]
    # Hold every "stopped" report of this sled for a while, so the instance stays stopping.
    await client.sim_faults(
        SimFaults(sled_id=sled, delay_state=VmmState.stopped, delay_seconds=2.5, delay_count=1000)
    )
    try:
        stopping = await client.instance("stop", silo, proj, "slow")
        assert stopping["state"] == "stopping"
        with pytest.raises(CommandError, match="instance is stopping") as e:
            await client.instance("start", silo, proj, "slow")
        assert e.value.code == "conflict"
    finally:
        await client.sim_faults(SimFaults(sled_id=sled))
    await wait_state(client, silo, proj, "slow", "stopped")
    await assert_invariants(db)
