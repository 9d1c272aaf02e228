"""A sled's boot and sequence are recorded even when its capacity cannot be (issue 28, finding 4).

A sled that comes back reporting less capacity than is reserved on it (it lost a DIMM, a CPU was
disabled) used to break the sleds table's CHECK: its inventory was dead-lettered, and so was every later
one, including the one that carried its next boot, so that its lost VMMs were never failed nor their
instances restarted. Now the sled is recorded as it reports itself, overcommitted: nothing new is placed
on it until its VMMs end, and its boots are recorded as ever.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from rackctl.client import Client
from shared.messages import AutoRestart
from tests.conftest import (
    GiB,
    assert_invariants,
    counter,
    eventually,
    new_project,
    private_rack,
    sleds_known,
    wait_state,
)


async def sled(client: Client, sled_id: str) -> dict[str, Any]:
    return next(s for s in await client.sled_list() if s["id"] == sled_id)


async def test_a_sled_that_shrinks_below_its_reservation_is_recorded_and_its_reboot_too() -> None:
    async with private_rack("shrink", RACKPLANE_SLEDS="1", RACKPLANE_SLED_SHAPES="4:16") as (
        stack,
        client,
        db,
    ):
        silo, proj = await new_project(client)
        policy = {"again": AutoRestart.best_effort, "never": AutoRestart.never}
        for name, auto_restart in policy.items():
            await client.instance_create(
                silo, proj, name, vcpus=2, ram_bytes=4 * GiB, disk_bytes=GiB, auto_restart=auto_restart
            )
            await client.instance("start", silo, proj, name)
            await wait_state(client, silo, proj, name, "running")
        await client.sim_sled("add", vcpus=8, ram_bytes=32 * GiB)
        await eventually(lambda: sleds_known(client, 2))
        assert (await sled(client, "sled-0"))["reserved_vcpus"] == 4

        # sled-0 comes back from a restart of its agent with 1 vCPU and 2 GiB: less than its 4 vCPUs and
        # 8 GiB reserved. Same boot, same VMMs.
        await asyncio.sleep(0.5)  # its last changes on disk
        stack.services["sled_agent"].stop()
        path = stack.dir / "sim" / "sled-0.json"
        state = json.loads(path.read_text())
        path.write_text(json.dumps({**state, "vcpus": 1, "ram_bytes": 2 * GiB}))
        stack.start_service("sled_agent")
        restarted = datetime.now(UTC)

        async def shrunk() -> dict[str, Any] | None:
            s = await sled(client, "sled-0")
            return s if (s["vcpus"], s["ram_bytes"]) == (1, 2 * GiB) else None

        overcommitted = await eventually(shrunk, timeout=20)

        async def both_answer() -> bool:  # sled-1 reports again too: a slow restart may have made it quiet
            views = await client.sled_list()
            return all(datetime.fromisoformat(v["last_seen_at"]) > restarted for v in views)

        await eventually(both_answer, timeout=20)
        assert (overcommitted["reserved_vcpus"], overcommitted["reserved_ram_bytes"]) == (4, 8 * GiB)
        # An overcommitted sled takes no new placement, however small.
        await client.instance_create(silo, proj, "new", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", silo, proj, "new")
        assert (await wait_state(client, silo, proj, "new", "running"))["sled_id"] == "sled-1"

        await client.sim_sled("reboot", "sled-0")

        async def boot_2_recorded() -> bool:
            return (await sled(client, "sled-0"))["boot_number"] == 2

        await eventually(boot_2_recorded, timeout=15)
        stopped = await wait_state(client, silo, proj, "never", "stopped", timeout=20)
        assert "sled sled-0 rebooted" in stopped["last_error"], stopped
        assert stopped["failed_at"] is not None, stopped  # recorded by a lost order, not only shown
        again = await wait_state(client, silo, proj, "again", "running", timeout=20)
        assert again["sled_id"] == "sled-1" and again["auto_restarts"] == 1, again
        after = await sled(client, "sled-0")
        assert (after["vcpus"], after["reserved_vcpus"], after["reserved_ram_bytes"]) == (1, 0, 0), after
        for service, durable in (
            ("instance-manager", "instance-manager-inventory"),
            ("recovery", "recovery-inventory"),
        ):
            assert await counter(client, service, f"{durable}.dead_lettered") == 0
        # Both VMMs were settled by lost orders. One sent from a picture a moment behind may be refused
        # as stale first and sent again: that is the fence working, not the shrink getting in the way.
        assert await counter(client, "recovery", "reconcile.vmm_lost") >= 2
        await assert_invariants(db)
