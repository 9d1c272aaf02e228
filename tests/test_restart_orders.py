"""An automatic restart is checked against instance-manager's own records and clock (issue 28, finding
6): a restart order for an instance whose policy is `never`, for one meant to stay stopped, or for one
whose next restart is not due yet, is refused as stale and changes nothing, whatever recovery saw."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from shared import bus
from shared.messages import AutoRestart, InstanceRestart, SimFaults
from shared.topology import subjects
from tests.conftest import GiB, connect_as, counter, eventually, new_project, private_rack, wait_state


async def restart(stack: Stack, v: dict[str, Any]) -> Any:
    """Recovery's restart order for the instance as `v` shows it, sent with recovery's credential."""
    nc = await connect_as(stack, "recovery")
    try:
        body = InstanceRestart(instance_id=uuid.UUID(v["id"]), generation=v["generation"])
        return await bus.request(nc, subjects.command(None, "instance", "restart"), body, source="recovery")
    finally:
        await nc.close()


def kept(v: dict[str, Any]) -> tuple[Any, ...]:
    return v["state"], v["generation"], v["active_vmm_id"], v["auto_restarts"], v["intended_state"]


async def test_restart_orders_are_checked_against_policy_intent_and_due_time() -> None:
    env = {"RACKPLANE_SLEDS": "1", "RACKPLANE_RESTART_COOLDOWN": "60", "RACKPLANE_RESTART_BACKOFF_MAX": "60"}
    async with private_rack("restart-orders", **env) as (stack, client, _):
        stack.services["recovery"].stop()  # the test sends recovery's orders itself
        await client.sim_faults(SimFaults(sled_id="sled-0", fail_starts=True))  # every VMM fails as it boots
        silo, proj = await new_project(client)
        policies = {
            "never": AutoRestart.never,
            "stays": AutoRestart.best_effort,
            "soon": AutoRestart.best_effort,
        }
        for name, policy in policies.items():
            await client.instance_create(
                silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy
            )
            await client.instance("start", silo, proj, name)
        failed = {n: await wait_state(client, silo, proj, n, "failed") for n in policies}

        # Meant to stay stopped (as a user's stop racing the failure would leave it), same generation:
        # only the intent check can refuse it.
        assert stack.admin_database_url is not None
        admin = await asyncpg.connect(stack.admin_database_url)
        try:
            await admin.execute(
                "UPDATE instance_manager.instances SET intended_state = 'stopped' WHERE id = $1",
                uuid.UUID(failed["stays"]["id"]),
            )
        finally:
            await admin.close()
        failed["stays"] = await client.instance("show", silo, proj, "stays")

        # Restarted once (due at once: its first), failed again: the next is a cooldown (60 s) away.
        await restart(stack, failed["soon"])

        async def failed_again() -> Any:
            v = await client.instance("show", silo, proj, "soon")
            return v if v["state"] == "failed" and v["auto_restarts"] == 1 else None

        failed["soon"] = await eventually(failed_again)
        assert failed["soon"]["next_restart_at"] is not None

        reasons = {
            "never": "instance's auto-restart policy is never",
            "stays": "instance is meant to stay stopped",
            "soon": "its next restart is due in",
        }
        for name, reason in reasons.items():
            with pytest.raises(bus.CommandError) as e:
                await restart(stack, failed[name])
            assert e.value.code == "stale" and e.value.message.startswith(reason), (name, e.value.message)
        assert await counter(client, "instance-manager", "orders.stale.restart") == len(reasons)
        for name in reasons:
            assert kept(await client.instance("show", silo, proj, name)) == kept(failed[name]), name
        await client.sim_faults(SimFaults(sled_id="sled-0"))
