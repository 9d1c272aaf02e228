"""Acceptance 5: the race of omicron#4277. A sled's first "stopped" report is delayed; its retry stops the
instance; the instance is started again (a new charge); then the delayed report arrives. The charge stays
and the instance stays running: the late report is about a VMM that has already ended, and is fenced."""

from __future__ import annotations

import asyncio

import asyncpg

from rackctl.client import Client
from shared.messages import SimFaults, VmmState
from tests.conftest import GiB, assert_invariants, counter, eventually, usage_is, wait_state

DELAY = 3.0


async def test_a_late_stopped_report_neither_releases_the_new_charge_nor_stops_the_instance(
    client: Client, db: asyncpg.Pool, project: tuple[str, str]
) -> None:
    silo, proj = project
    await client.instance_create(silo, proj, "racy", vcpus=3, ram_bytes=6 * GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "racy")
    first = await wait_state(client, silo, proj, "racy", "running")
    sled = first["sled_id"]
    delivered_before = await counter(client, "sled-agent", "sled.fault.delayed_delivered")
    stale_before = await counter(client, "instance-manager", "reports.stale")

    await client.sim_faults(
        SimFaults(sled_id=sled, delay_state=VmmState.stopped, delay_seconds=DELAY, delay_count=1)
    )
    await client.instance("stop", silo, proj, "racy")
    await wait_state(client, silo, proj, "racy", "stopped")  # the retry got through
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo, proj)

    await client.instance("start", silo, proj, "racy")
    second = await wait_state(client, silo, proj, "racy", "running")
    assert second["active_vmm_id"] != first["active_vmm_id"]
    charged = {"vcpus": 3, "ram_bytes": 6 * GiB, "disk_bytes": GiB}
    await usage_is(client, charged, silo, proj)

    # The delayed first attempt arrives now, after the restart...
    async def delayed_arrived() -> bool:
        return await counter(client, "sled-agent", "sled.fault.delayed_delivered") > delivered_before

    await eventually(delayed_arrived, timeout=DELAY + 5)

    # ...and instance-manager fenced it off as stale.
    async def fenced() -> bool:
        return await counter(client, "instance-manager", "reports.stale") > stale_before

    await eventually(fenced)
    await asyncio.sleep(0.5)  # anything it could have caused would have landed by now
    now = await client.instance("show", silo, proj, "racy")
    assert now["state"] == "running" and now["active_vmm_id"] == second["active_vmm_id"]
    assert (await client.usage(silo, proj))["usage"] == charged
    await assert_invariants(db)
