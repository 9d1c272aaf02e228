"""Acceptance 4: quotas are checked in the same statement as the charge, so they hold under concurrency."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import Quota
from tests.conftest import GiB, assert_invariants, eventually, unique, usage_is, wait_state


async def quota_project(client: Client, quota: Quota) -> tuple[str, str]:
    silo, proj = unique("quota"), unique("proj")
    await client.silo_create(silo, quota)
    await client.project_create(silo, proj)
    return silo, proj


async def test_reaching_the_quota_exactly_is_allowed_and_exceeding_it_is_refused(
    client: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await quota_project(client, Quota(vcpus=6, ram_bytes=12 * GiB))
    await client.instance_create(silo, proj, "big", vcpus=4, ram_bytes=8 * GiB, disk_bytes=GiB)
    await client.instance_create(silo, proj, "fits", vcpus=2, ram_bytes=4 * GiB, disk_bytes=GiB)
    await client.instance_create(silo, proj, "extra", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "big")
    await client.instance("start", silo, proj, "fits")  # 6 of 6 vCPUs, 12 of 12 GiB: exactly the quota
    await wait_state(client, silo, proj, "fits", "running")

    with pytest.raises(CommandError) as refused:
        await client.instance("start", silo, proj, "extra")
    assert refused.value.code == "refused"
    assert "vCPU quota exceeded: 6 of 6 used, 1 asked" in refused.value.message

    extra = await client.instance("show", silo, proj, "extra")
    assert extra["state"] == "stopped" and extra["active_vmm_id"] is None
    assert "vCPU quota exceeded" in extra["last_error"]
    # No charge, no reservation, no VMM left behind by the refused start.
    assert (
        await db.fetchval("SELECT count(*) FROM instance_manager.vmms WHERE instance_id = $1", extra["id"])
        == 0
    )
    charge = await db.fetchrow(
        "SELECT vcpus, ram_bytes FROM accounting.instance_charges WHERE instance_id = $1", extra["id"]
    )
    assert (charge["vcpus"], charge["ram_bytes"]) == (0, 0)
    await usage_is(client, {"vcpus": 6, "ram_bytes": 12 * GiB, "disk_bytes": 3 * GiB}, silo)
    await assert_invariants(db)


async def test_storage_quota_is_checked_at_create(client: Client, db: asyncpg.Pool) -> None:
    silo, proj = await quota_project(client, Quota(disk_bytes=10 * GiB))
    await client.instance_create(silo, proj, "a", vcpus=1, ram_bytes=GiB, disk_bytes=10 * GiB)
    with pytest.raises(CommandError, match=r"storage quota exceeded: 10 GiB of 10 GiB used, 1 GiB asked"):
        await client.instance_create(silo, proj, "b", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    # A refused create leaves nothing: the name is free again once the disk fits.
    with pytest.raises(CommandError, match="no instance"):
        await client.instance("show", silo, proj, "b")
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 10 * GiB}, silo)
    await assert_invariants(db)


async def test_twenty_concurrent_starts_against_a_quota_of_ten(client: Client, db: asyncpg.Pool) -> None:
    silo, proj = await quota_project(client, Quota(vcpus=10))
    names = [f"vm-{i}" for i in range(20)]
    await asyncio.gather(
        *(client.instance_create(silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB) for n in names)
    )

    peak = 0
    done = asyncio.Event()

    async def watch_usage() -> None:
        nonlocal peak
        while not done.is_set():
            row = await db.fetchrow("SELECT vcpus FROM accounting.silos WHERE name = $1", silo)
            peak = max(peak, row["vcpus"])
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch_usage())
    results = await asyncio.gather(
        *(client.instance("start", silo, proj, n) for n in names), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, CommandError)]
    assert len(refused) == 10 and all("vCPU quota exceeded" in r.message for r in refused)

    async def ten_running() -> bool:
        listed = await client.instance_list(silo, proj)
        return sum(i["state"] == "running" for i in listed) == 10

    await eventually(ten_running)
    done.set()
    await watcher
    assert peak <= 10
    await usage_is(client, {"vcpus": 10, "ram_bytes": 10 * GiB, "disk_bytes": 20 * GiB}, silo)
    await assert_invariants(db)
