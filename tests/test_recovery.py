"""Recovery (issue: after a sled reboots, is expunged, or an instance is stuck, the API tells the truth and
instances come back by policy). Each test gets its own stack: they reboot, freeze and expunge sleds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import AutoRestart, ServiceFaults, SimFaults
from shared.topology import subjects
from tests.conftest import (
    GiB,
    Rack,
    assert_invariants,
    connect_as,
    counter,
    eventually,
    new_project,
    private_rack,
    sleds_known,
    usage_is,
    wait_state,
)

Env = dict[str, str]
MakeRack = Callable[..., Awaitable[Rack]]


@pytest.fixture
async def rack() -> AsyncIterator[MakeRack]:
    """Each test builds the rack it needs (how many sleds, which timings)."""
    async with contextlib.AsyncExitStack() as racks:

        async def make(**env: str) -> Rack:
            return await racks.enter_async_context(private_rack("recovery", **env))

        yield make


async def start_many(
    client: Client, silo: str, proj: str, names: list[str], policy: dict[str, AutoRestart]
) -> None:
    await asyncio.gather(
        *(
            client.instance_create(
                silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy[n]
            )
            for n in names
        )
    )
    await asyncio.gather(*(client.instance("start", silo, proj, n) for n in names))
    await asyncio.gather(*(wait_state(client, silo, proj, n, "running") for n in names))


async def states(client: Client, silo: str, proj: str) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in await client.instance_list(silo, proj)}


async def test_a_rebooted_sled_fails_its_instances_and_policy_brings_them_back(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(20)]
    policy = {n: AutoRestart.best_effort if i % 2 == 0 else AutoRestart.never for i, n in enumerate(names)}
    await start_many(client, silo, proj, names, policy)
    assert {i["sled_id"] for i in (await states(client, silo, proj)).values()} == {"sled-0"}
    await client.sim_sled("add", vcpus=64, ram_bytes=256 * GiB)
    await client.sim_sled("add", vcpus=64, ram_bytes=256 * GiB)
    await eventually(lambda: sleds_known(client, 3))

    await client.sim_sled("reboot", "sled-0")

    async def settled() -> bool:
        now = await states(client, silo, proj)
        return all(now[n]["state"] == ("running" if policy[n] == "best_effort" else "stopped") for n in names)

    async def totals_always_match() -> None:  # "throughout": the ledger invariant holds at every moment
        while True:
            await assert_invariants(db, at_rest=False, timeout=0.5)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(totals_always_match())
    try:
        await eventually(settled, timeout=30)
    finally:
        watcher.cancel()
    final = await states(client, silo, proj)
    for n in names:
        # At least once: a restart placed before instance-manager has seen the sled's new boot id fails at
        # once on that sled and is restarted again, after the cooldown. Charges stay exact either way.
        if policy[n] == "best_effort":
            assert final[n]["auto_restarts"] >= 1, final[n]
        else:
            assert final[n]["auto_restarts"] == 0, final[n]
        assert "sled sled-0 rebooted" in (final[n]["last_error"] or ""), final[n]
    await usage_is(client, {"vcpus": 10, "ram_bytes": 10 * GiB, "disk_bytes": 20 * GiB}, silo)
    await assert_invariants(db)


async def test_a_power_loss_of_the_whole_rack_is_told_at_once_and_every_instance_comes_back(
    rack: MakeRack,
) -> None:
    """`sim rack reboot`: every sled reboots at once. No instance stays running on a lost VMM, each fails
    with its sled's reboot as the reason, and every best_effort one runs again, on the new boots."""
    _, client, db = await rack(RACKPLANE_SLEDS="4")
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(16)]
    await start_many(client, silo, proj, names, dict.fromkeys(names, AutoRestart.best_effort))
    assert (await client.sim_rack_reboot()) == {"rebooted": 4}

    async def all_back_on_the_new_boots() -> bool:
        now = await states(client, silo, proj)
        return all(now[n]["state"] == "running" and now[n]["vmm_boot_number"] == 2 for n in names)

    await eventually(all_back_on_the_new_boots, timeout=30)
    for i in (await states(client, silo, proj)).values():
        assert i["auto_restarts"] >= 1 and "rebooted" in (i["last_error"] or ""), i
    assert {s["boot_number"] for s in await client.sim_sled("list")} == {2}
    await usage_is(client, {"vcpus": 16, "ram_bytes": 16 * GiB, "disk_bytes": 16 * GiB}, silo)
    await assert_invariants(db)


async def test_a_silent_sled_is_unknown_until_expunged(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_SLED_UNKNOWN_AFTER="2")
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(6)]
    await start_many(client, silo, proj, names, dict.fromkeys(names, AutoRestart.best_effort))
    on_0 = [n for n, i in (await states(client, silo, proj)).items() if i["sled_id"] == "sled-0"]
    assert on_0, "placement spreads instances over both sleds"
    charged = {"vcpus": 6, "ram_bytes": 6 * GiB, "disk_bytes": 6 * GiB}

    await client.sim_sled("freeze", "sled-0")

    async def unknown() -> bool:
        now = await states(client, silo, proj)
        return all(now[n]["health"] == "unknown" for n in on_0)

    await eventually(unknown, timeout=10)
    await asyncio.sleep(3)  # several reconcile passes: nothing may be failed or restarted
    now = await states(client, silo, proj)
    assert all(now[n]["state"] == "running" and now[n]["auto_restarts"] == 0 for n in names)
    await usage_is(client, charged, silo)

    expunged = await client.sled_expunge("sled-0")
    assert expunged["state"] == "expunged" and expunged["vmms_failed"] == len(on_0)

    async def back_elsewhere() -> bool:
        now = await states(client, silo, proj)
        return all(now[n]["state"] == "running" and now[n]["sled_id"] == "sled-1" for n in on_0)

    await eventually(back_elsewhere, timeout=20)
    await usage_is(client, charged, silo)
    more = [f"new-{i}" for i in range(4)]
    await start_many(client, silo, proj, more, dict.fromkeys(more, AutoRestart.never))
    assert all(i["sled_id"] == "sled-1" for i in (await states(client, silo, proj)).values())
    sleds = {s["id"]: s for s in await client.sled_list()}
    assert sleds["sled-0"]["state"] == "expunged" and sleds["sled-0"]["reserved_vcpus"] == 0
    await client.sim_sled("thaw", "sled-0")  # its zombies get destroyed
    await assert_invariants(db)


async def test_stuck_starting_and_stopping_instances_fail_and_follow_their_policy(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_TRANSITION_TIMEOUT="2")
    silo, proj = await new_project(client)
    await start_many(client, silo, proj, ["halt"], {"halt": AutoRestart.best_effort})
    for sled in ("sled-0", "sled-1"):
        await client.sim_faults(SimFaults(sled_id=sled, drop_commands=True))

    for name, policy in (("again", AutoRestart.best_effort), ("never", AutoRestart.never)):
        await client.instance_create(
            silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy
        )
        await client.instance("start", silo, proj, name)
    await client.instance("stop", silo, proj, "halt")

    stopped = await wait_state(client, silo, proj, "never", "stopped", timeout=20)
    assert "starting for over 2s" in stopped["last_error"]
    await wait_state(client, silo, proj, "halt", "stopped", timeout=20)  # the user wanted it stopped

    async def restarting() -> bool:
        return (await client.instance("show", silo, proj, "again"))["auto_restarts"] >= 1

    await eventually(restarting, timeout=20)
    for sled in ("sled-0", "sled-1"):
        await client.sim_faults(SimFaults(sled_id=sled))
    await wait_state(client, silo, proj, "again", "running", timeout=20)
    await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 3 * GiB}, silo)

    async def no_zombies() -> bool:  # the VMM "halt" left running is destroyed once the sled listens again
        return sum(s["vmms"] for s in await client.sim_sled("list")) == 1

    await eventually(no_zombies, timeout=20)
    await assert_invariants(db)


async def test_a_reboot_whose_first_inventory_is_lost_is_answered_and_still_noticed(rack: MakeRack) -> None:
    """`sim sled reboot` sends the new boot id at once; when that message cannot go, the reboot has happened
    all the same (the command says so, not `internal`), and the next timed inventory carries the news."""
    _, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await start_many(client, silo, proj, ["vm"], {"vm": AutoRestart.best_effort})
    inventory = subjects.sled_report("sled-0", "inventory")
    await client.faults("sled-agent", ServiceFaults(drop_first_attempt=True, only=[inventory]))
    dropped = await counter(client, "sled-agent", "faults.drop_first_attempt")
    before = (await client.sim_sled("list"))[0]["boot_id"]

    rebooted = await client.sim_sled("reboot", "sled-0")
    assert rebooted["boot_id"] != before
    assert await counter(client, "sled-agent", "faults.drop_first_attempt") > dropped
    await client.faults("sled-agent", ServiceFaults(clear=True))

    async def back() -> bool:
        v = await client.instance("show", silo, proj, "vm")
        return v["state"] == "running" and v["auto_restarts"] == 1

    await eventually(back, timeout=20)
    await assert_invariants(db)


async def test_a_zombie_vmm_is_destroyed(rack: MakeRack) -> None:
    import uuid

    from shared import bus
    from shared.messages import VmmEnsure
    from shared.topology import subjects

    stack, client, _ = await rack(RACKPLANE_SLEDS="1")
    zombie = VmmEnsure(vmm_id=uuid.uuid4(), instance_id=uuid.uuid4(), vcpus=1, ram_bytes=GiB)
    im = await connect_as(stack, "instance-manager")  # the only identity that may command a sled
    try:
        await bus.publish(
            im.jetstream(), subjects.sled_command("sled-0", "vmm.ensure"), zombie, source="test"
        )
    finally:
        await im.close()

    async def running(n: int) -> bool:
        return (await client.sim_sled("list"))[0]["vmms"] == n

    await eventually(lambda: running(1), timeout=5)
    await eventually(lambda: running(0), timeout=15)
    assert (await client.stats("recovery"))["counters"]["reconcile.zombie"] >= 1  # ordered by recovery
    assert (await client.stats("instance-manager"))["counters"]["zombies.destroyed"] >= 1  # carried out


async def test_a_crash_loop_is_throttled_by_the_cooldown_and_a_user_stop_wins(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="1", RACKPLANE_RESTART_COOLDOWN="2")
    silo, proj = await new_project(client)
    await client.sim_faults(SimFaults(sled_id="sled-0", fail_starts=True))
    await client.instance_create(silo, proj, "loop", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "loop")
    await asyncio.sleep(7)
    shown = await client.instance("show", silo, proj, "loop")
    assert 2 <= shown["auto_restarts"] <= 4, shown  # at most one every 2 s, the first at once
    starts = await db.fetch(
        "SELECT created_at FROM instance_manager.sagas WHERE kind = 'instance-start' "
        "AND params->>'instance_id' = $1 AND params ? 'expected_generation' ORDER BY created_at",
        shown["id"],
    )
    gaps = [(b["created_at"] - a["created_at"]).total_seconds() for a, b in itertools.pairwise(starts)]
    assert all(g >= 1.9 for g in gaps), gaps

    # The user stops it between two automatic restarts: it stays stopped. (On a busy machine the next
    # restart may come before the stop does: a starting instance refuses a stop, so the user tries again.)
    async def stopped_while_failed() -> bool:
        if not await _failed(client, silo, proj, "loop"):
            return False
        try:
            await client.instance("stop", silo, proj, "loop")
        except CommandError as e:
            if e.code != "conflict":
                raise
            return False
        return True

    await eventually(stopped_while_failed, timeout=20)
    await asyncio.sleep(3)
    final = await client.instance("show", silo, proj, "loop")
    assert final["state"] == "stopped"
    restarts_after_stop = final["auto_restarts"]
    await asyncio.sleep(2.5)
    assert (await client.instance("show", silo, proj, "loop"))["auto_restarts"] == restarts_after_stop
    await assert_invariants(db)


async def _failed(client: Client, silo: str, proj: str, name: str) -> bool:
    return (await client.instance("show", silo, proj, name))["state"] == "failed"


async def test_a_simulator_restart_is_not_a_sled_reboot(rack: MakeRack) -> None:
    stack, client, db = await rack(RACKPLANE_SLEDS="2")
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(6)]
    await start_many(client, silo, proj, names, dict.fromkeys(names, AutoRestart.best_effort))
    boots = {s["sled_id"]: s["boot_id"] for s in await client.sim_sled("list")}

    stack.services["sled_agent"].kill()
    await asyncio.sleep(2)
    stack.start_service("sled_agent")
    stack.wait_ready(("sled_agent",))
    assert {s["sled_id"]: s["boot_id"] for s in await client.sim_sled("list")} == boots
    await asyncio.sleep(3)  # inventories come in; reconcile passes run
    now = await states(client, silo, proj)
    assert all(
        i["state"] == "running" and i["auto_restarts"] == 0 and i["health"] == "ok" for i in now.values()
    )
    await usage_is(client, {"vcpus": 6, "ram_bytes": 6 * GiB, "disk_bytes": 6 * GiB}, silo)
    await assert_invariants(db)


async def test_a_simulator_restart_right_after_a_rack_reboot_keeps_the_new_boots(rack: MakeRack) -> None:
    """A rack-wide reboot writes every sled's new boot in one file (the sleds' own files follow with their
    next change): a simulator restarted before any sled changed again still has the new boots."""
    stack, client, _ = await rack(RACKPLANE_SLEDS="3")
    await client.sim_rack_reboot()
    rebooted = {s["sled_id"]: (s["boot_number"], s["boot_id"]) for s in await client.sim_sled("list")}
    assert {n for n, _ in rebooted.values()} == {2}
    on_disk = {
        p.stem: json.loads(p.read_text())["boot_number"] for p in (stack.dir / "sim").glob("sled-*.json")
    }
    assert on_disk == dict.fromkeys(rebooted, 1), "the sleds' own files wait for their next change"

    stack.services["sled_agent"].kill()
    stack.start_service("sled_agent")
    stack.wait_ready(("sled_agent",))
    again = await client.sim_sled("list")
    assert {s["sled_id"]: (s["boot_number"], s["boot_id"]) for s in again} == rebooted
    assert all([b["number"] for b in s["boots"]] == [1, 2] for s in again), again


async def test_the_api_calls_a_rebooted_sleds_instances_failed_before_recovery_records_it(
    rack: MakeRack,
) -> None:
    """From the moment instance-manager applies the new boot's inventory, the API says failed, with the
    reboot as the reason, even with recovery away; recovery's order records it (a new generation) once
    it is back, and the policy brings the instance back."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await start_many(client, silo, proj, ["vm"], {"vm": AutoRestart.best_effort})
    before = await client.instance("show", silo, proj, "vm")
    stack.services["recovery"].kill()
    await client.sim_sled("reboot", "sled-0")
    shown = await wait_state(client, silo, proj, "vm", "failed", timeout=5)
    assert shown["generation"] == before["generation"], shown  # nothing recorded yet: only seen
    assert shown["health"] == "failed", shown
    assert shown["last_error"] == "sled sled-0 rebooted (boot 1 ended; boot 2 began)", shown
    assert (await client.instance_list(silo, proj))[0]["state"] == "failed"
    stack.start_service("recovery")
    stack.wait_ready(("recovery",))
    back = await wait_state(client, silo, proj, "vm", "running", timeout=30)
    assert back["generation"] > before["generation"] and back["vmm_boot_number"] == 2, back
    assert back["auto_restarts"] == 1 and back["last_error"] == shown["last_error"], back
    await assert_invariants(db)


async def test_a_lost_order_refused_for_a_boot_not_yet_seen_is_sent_again_soon(rack: MakeRack) -> None:
    """Recovery hears a sled's new boot before instance-manager does (here its inventories are handled
    2 s late): the lost order is refused as stale, and recovery looks again within a second
    (reconcile.LOOK_AGAIN), not at the next interval (a minute here), so the failure is recorded and the
    instance (policy never) comes to rest stopped within seconds."""
    _, client, db = await rack(RACKPLANE_SLEDS="1", RACKPLANE_RECONCILE_INTERVAL="60")
    silo, proj = await new_project(client)
    await start_many(client, silo, proj, ["vm"], {"vm": AutoRestart.never})
    late = ServiceFaults(slow_handler_seconds=2, only=["rp.sled.sled-0.report.inventory"])
    await client.faults("instance-manager", late)
    await client.sim_sled("reboot", "sled-0")
    settled = await wait_state(client, silo, proj, "vm", "stopped", timeout=15)
    assert "sled sled-0 rebooted" in (settled["last_error"] or ""), settled
    assert await counter(client, "recovery", "reconcile.vmm_lost_stale") >= 1
    assert await counter(client, "recovery", "reconcile.vmm_lost") == 1
    await client.faults("instance-manager", ServiceFaults(clear=True))
    await assert_invariants(db)


async def test_a_stop_while_recovery_is_away_is_not_undone(rack: MakeRack) -> None:
    """The sled reboots while recovery is down; the user stops the instance (which in truth runs nowhere);
    when recovery comes back and finds the VMM lost, the instance ends stopped, not restarted."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await start_many(client, silo, proj, ["vm"], {"vm": AutoRestart.best_effort})
    stack.services["recovery"].kill()
    await client.sim_sled("reboot", "sled-0")
    await client.instance("stop", silo, proj, "vm")
    stack.start_service("recovery")
    stack.wait_ready(("recovery",))
    final = await wait_state(client, silo, proj, "vm", "stopped", timeout=15)
    await asyncio.sleep(2)
    assert (await client.instance("show", silo, proj, "vm"))["state"] == "stopped"
    assert final["auto_restarts"] == 0
    await assert_invariants(db)


async def test_killing_recovery_mid_pass_and_running_two_replicas_converges(rack: MakeRack) -> None:
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(20)]
    await start_many(client, silo, proj, names, dict.fromkeys(names, AutoRestart.best_effort))
    await client.sim_sled("add", vcpus=64, ram_bytes=256 * GiB)

    await client.sim_sled("reboot", "sled-0")
    await asyncio.sleep(0.15)  # recovery is in the middle of its pass
    stack.services["recovery"].kill()
    stack.start_service("recovery")
    stack.start_service("recovery", replica="recovery-2")
    stack.wait_ready(("recovery",))

    async def all_back() -> bool:  # not merely "running": until recovery has seen the reboot, they seem so
        now = (await states(client, silo, proj)).values()
        return all(i["state"] == "running" and i["auto_restarts"] >= 1 for i in now)

    await eventually(all_back, timeout=30)
    await asyncio.sleep(2)
    final = await states(client, silo, proj)
    assert all(i["state"] == "running" for i in final.values())
    restarts = {n: i["auto_restarts"] for n, i in final.items()}
    assert set(restarts.values()) == {1}, restarts  # each restarted exactly once
    sagas = await db.fetch(
        "SELECT params->>'instance_id' AS id, count(*) AS n FROM instance_manager.sagas "
        "WHERE kind = 'instance-start' AND status = 'done' GROUP BY 1"
    )
    assert {r["n"] for r in sagas} == {2}  # the user's start and one automatic restart
    await usage_is(client, {"vcpus": 20, "ram_bytes": 20 * GiB, "disk_bytes": 20 * GiB}, silo)
    await assert_invariants(db)
