"""Versions that evolve (docs/subjects.md, "Versions"): `rp.evt.instance.changed` v2 goes out beside v1
for the deprecation window, a reader of either sees every change, v1 can be turned off, and a recovery of
the release before v2, reading v1 alone, still repairs what a reboot broke. `rp.cmd.vmm.lost` v2 falls
back to v1 when the instance-manager that answers knows only v1."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from nats.aio.msg import Msg

from rackctl.client import Client
from services.recovery.reconcile import Reconciler
from shared import bus
from shared.config import ConfigError, Settings
from shared.messages import AutoRestart, LostVmm, VmmLost, VmmLostV2
from shared.topology import subjects
from tests import release
from tests.conftest import (
    GiB,
    assert_invariants,
    connect_as,
    eventually,
    instance_changes,
    private_rack,
    unique,
    wait_state,
)


async def lifecycle(client: Client, silo: str, proj: str, name: str) -> None:
    """One instance through create, start, stop and delete: a change of generation at every step."""
    await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, name)
    await wait_state(client, silo, proj, name, "running")
    await client.instance("stop", silo, proj, name)
    await wait_state(client, silo, proj, name, "stopped")
    await client.instance("delete", silo, proj, name)


async def test_every_change_reaches_a_v1_reader_and_a_v2_reader_alike(
    client: Client, project: tuple[str, str]
) -> None:
    """While RACKPLANE_EVENT_V1 is on (the default), each change goes out as v1 and as v2, saying the same."""
    silo, proj = project
    await lifecycle(client, silo, proj, "vm")

    async def both() -> tuple[dict[Any, Any], dict[Any, Any]] | None:
        v1 = await instance_changes(client, subjects.event(silo, "instance", "changed"))
        v2 = await instance_changes(client, subjects.event(silo, "instance", "changed", version=2))
        final = any(view["state"] == "destroyed" for view in v2.values())
        return (v1, v2) if final and v1.keys() == v2.keys() else None

    v1, v2 = await eventually(both)
    assert len(v1) >= 5, sorted(v1)  # created, starting, placed, running, stopping, stopped, destroyed...
    assert v1 == v2


async def test_with_v1_turned_off_only_v2_is_sent() -> None:
    async with private_rack("v2-only", RACKPLANE_SLEDS="2", RACKPLANE_EVENT_V1="0") as (_, client, db):
        silo, proj = unique("silo"), unique("proj")
        await client.silo_create(silo)
        await client.project_create(silo, proj)
        await lifecycle(client, silo, proj, "vm")

        async def destroyed() -> dict[Any, Any] | None:
            v2 = await instance_changes(client, subjects.event(silo, "instance", "changed", version=2))
            return v2 if any(view["state"] == "destroyed" for view in v2.values()) else None

        assert len(await eventually(destroyed)) >= 5
        assert await instance_changes(client, subjects.event(silo, "instance", "changed")) == {}
        await assert_invariants(db)


def test_the_window_setting_takes_on_and_off_and_names_itself_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RACKPLANE_EVENT_V1", raising=False)
    assert Settings.from_env().event_v1 is True  # the deprecation window is open by default
    for value, expected in (("0", False), ("off", False), ("No", False), ("1", True), ("true", True)):
        monkeypatch.setenv("RACKPLANE_EVENT_V1", value)
        assert Settings.from_env().event_v1 is expected
    monkeypatch.setenv("RACKPLANE_EVENT_V1", "maybe")
    with pytest.raises(ConfigError, match=r"^RACKPLANE_EVENT_V1='maybe': expected 1 or 0"):
        Settings.from_env()


async def test_a_recovery_at_the_release_before_v2_still_gets_every_event_and_repairs_a_reboot() -> None:
    """Today's instance-manager, with v1 on, beside a recovery of the release before v2 (which reads
    `recovery-instances`, v1, alone): its picture keeps up with every instance, and it fails and restarts
    the instances a sled's reboot took away. The sleds are of that release too: they roll after every
    service that reads their inventories (docs/operations.md, "Upgrades": consumers before producers),
    for today's carry fields an older reader refuses."""
    with release.checkout() as old:
        async with private_rack("v1-reader", RACKPLANE_SLEDS="1") as (stack, client, db):
            for name in ("recovery", "sled_agent"):  # today's away: the old ones alone run
                stack.services.pop(name).stop()
                stack.start_service(name, replica=f"{name}-old", root=old)
            stack.wait_ready(("recovery", "sled_agent"))
            silo, proj = unique("silo"), unique("proj")
            await client.silo_create(silo)
            await client.project_create(silo, proj)
            names = [f"vm-{i}" for i in range(4)]
            for n in names:
                await client.instance_create(
                    silo,
                    proj,
                    n,
                    vcpus=1,
                    ram_bytes=GiB,
                    disk_bytes=GiB,
                    auto_restart=AutoRestart.best_effort,
                )
                await client.instance("start", silo, proj, n)
            for n in names:
                await wait_state(client, silo, proj, n, "running")
            await client.sim_sled("reboot", "sled-0")

            async def all_back() -> bool:
                now = {i["name"]: i for i in await client.instance_list(silo, proj)}
                return all(now[n]["state"] == "running" and now[n]["auto_restarts"] >= 1 for n in names)

            await eventually(all_back, timeout=40)

            async def caught_up() -> bool:
                """Recovery's picture is at every instance's generation: it got every change, on v1."""
                behind = await db.fetch(
                    "SELECT i.id FROM instance_manager.instances i LEFT JOIN recovery.instances r USING (id) "
                    "WHERE r.generation IS DISTINCT FROM i.generation"
                )
                return not behind

            await eventually(caught_up)
            v2 = await client.nc.jetstream().consumer_info(subjects.EVENTS_STREAM, "recovery-instances-v2")
            assert v2.num_pending > 0  # left unread: the old recovery did all of it on v1
            assert stack.services["recovery-old"].alive
            await assert_invariants(db)


async def test_recovery_sends_lost_orders_one_by_one_to_an_instance_manager_that_knows_only_v1() -> None:
    """Mid-upgrade, an instance-manager of the release before `rp.cmd.vmm.lost` v2 answers it
    `unsupported_version`: recovery then sends the same order as v1, one VMM at a time."""
    async with private_rack("lost-v1", RACKPLANE_SLEDS="1") as (stack, _, _):
        stack.services["instance_manager"].stop()
        old, nc = await connect_as(stack, "instance-manager"), await connect_as(stack, "recovery")
        got: list[VmmLost] = []

        async def v1_only(body: VmmLost, msg: Msg) -> dict[str, Any]:
            got.append(body)
            return {"result": "failed"}

        try:
            await bus.serve(
                old, subjects.command_pattern("vmm"), {VmmLost: v1_only}, queue="instance-manager"
            )
            await old.flush()  # the broker holds the subscription before recovery's order comes
            vmms = [
                LostVmm(instance_id=uuid.uuid4(), generation=4, vmm_id=uuid.uuid4(), vmm_boot=1)
                for _ in "abc"
            ]
            await Reconciler(None, nc, stack.database_url)._lost(  # type: ignore[arg-type]
                VmmLostV2(sled_id="sled-0", sled_boot=2, vmms=vmms)
            )
        finally:
            await old.close()
            await nc.close()
        assert sorted(v.vmm_id for v in got) == sorted(v.vmm_id for v in vmms)
        assert {(v.sled_id, v.sled_boot, v.vmm_boot, v.generation) for v in got} == {("sled-0", 2, 1, 4)}
