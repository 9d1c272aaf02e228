"""Every order is a condition: no stale view may fail, destroy or restart a healthy instance.

A sled's boots only go forward, and its inventories are ordered by (boot number, sequence); recovery's
orders name what recovery saw and are refused as `stale` when that no longer holds; placement goes only to
sleds that answer; automatic restarts keep trying; and the checker sees a wrongful kill when the fence is
switched off on purpose. Each test has a stack of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.client import Client
from rackctl.invariants import check, no_wrongful_kills, sled_boots
from shared import bus
from shared.messages import (
    AutoRestart,
    HoldAcksFault,
    LostVmm,
    Model,
    Quota,
    ServiceFaults,
    VmmLost,
    VmmLostV2,
    VmmStuck,
    VmmZombie,
)
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
    restart_service,
    sleds_known,
    unique,
    wait_state,
)

MakeRack = Callable[..., Awaitable[Rack]]


@pytest.fixture
async def rack() -> AsyncIterator[MakeRack]:
    async with contextlib.AsyncExitStack() as racks:

        async def make(**env: str) -> Rack:
            return await racks.enter_async_context(private_rack("fences", **env))

        yield make


async def running(
    client: Client,
    silo: str,
    proj: str,
    names: list[str],
    vcpus: int = 1,
    policy: AutoRestart = AutoRestart.never,
) -> dict[str, dict[str, Any]]:
    for n in names:
        await client.instance_create(
            silo, proj, n, vcpus=vcpus, ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy
        )
    await asyncio.gather(*(client.instance("start", silo, proj, n) for n in names))
    return {n: await wait_state(client, silo, proj, n, "running") for n in names}


async def order(stack: Stack, body: Model) -> Any:
    """Send one of recovery's orders as recovery would: with its credential, on its fleet subject."""
    resource, verb = {
        VmmLost: ("vmm", "lost"),
        VmmLostV2: ("vmm", "lost"),
        VmmStuck: ("vmm", "stuck"),
        VmmZombie: ("vmm", "zombie"),
    }[type(body)]
    nc = await connect_as(stack, "recovery")
    try:
        return await bus.request(nc, subjects.command(None, resource, verb), body, source="recovery")
    finally:
        await nc.close()


async def sled_boot(client: Client, sled_id: str) -> int:
    return next(s["boot_number"] for s in await client.sled_list() if s["id"] == sled_id)


async def test_a_pre_reboot_inventory_redelivered_after_the_reboot_changes_nothing(rack: MakeRack) -> None:
    """Instances moved onto a sled that has just rebooted keep running on the same VMMs while JetStream
    redelivers, to instance-manager and to recovery, inventories that sled sent before its reboot."""
    _, client, db = await rack(RACKPLANE_SLEDS="1", RACKPLANE_ACK_WAIT="2")
    silo, proj = await new_project(client)
    names = ["a", "b", "c"]
    await running(client, silo, proj, names)
    await client.sim_sled("add", vcpus=64, ram_bytes=256 * GiB)
    await eventually(lambda: sleds_known(client, 2))
    held = ServiceFaults(
        hold_acks=HoldAcksFault(probability=0.5), only=[subjects.sled_report("sled-1", "inventory")], seed=7
    )
    for service in ("instance-manager", "recovery"):
        await client.faults(service, held)
    await asyncio.sleep(2.5)  # inventories of the first boot are held now, to come back after the reboot

    await client.sim_sled("reboot", "sled-1")
    await eventually(lambda: _boot_is(client, "sled-1", 2))
    for n in names:
        await client.instance_migrate(silo, proj, n, to_sled="sled-1")
    moved = {}
    for n in names:
        moved[n] = await eventually(lambda n=n: _on(client, silo, proj, n, "sled-1"), timeout=20)

    async def stale_in_both() -> bool:
        return all(
            [await counter(client, s, "inventories.stale") > 0 for s in ("instance-manager", "recovery")]
        )

    await eventually(stale_in_both, timeout=20)
    await asyncio.sleep(5)  # more redeliveries, and recovery's passes over them
    for n in names:
        now = await client.instance("show", silo, proj, n)
        assert (now["state"], now["active_vmm_id"]) == ("running", moved[n]["active_vmm_id"]), now
    await client.clear_faults()
    await assert_invariants(db)


async def _boot_is(client: Client, sled_id: str, number: int) -> bool:
    return await sled_boot(client, sled_id) == number


async def _on(client: Client, silo: str, proj: str, name: str, sled_id: str) -> Any:
    v = await client.instance("show", silo, proj, name)
    return v if v["state"] == "running" and v["sled_id"] == sled_id else None


async def test_orders_decided_on_an_old_view_are_refused_as_stale(rack: MakeRack) -> None:
    """A stuck-check, a lost-VMM and a zombie order that a lagging recovery would send change nothing."""
    stack, client, db = await rack(RACKPLANE_SLEDS="2")
    silo, proj = await new_project(client)
    v = (await running(client, silo, proj, ["vm"]))["vm"]
    vmm, gen = uuid.UUID(v["active_vmm_id"]), v["generation"]
    iid = uuid.UUID(v["id"])
    boot = v["vmm_boot_number"]
    refused = [
        VmmStuck(instance_id=iid, generation=gen - 1, vmm_id=vmm, state="starting"),  # it has run since
        VmmStuck(
            instance_id=iid, generation=gen, vmm_id=vmm, state="starting"
        ),  # it is running, not starting
        VmmLost(
            instance_id=iid,
            generation=gen,
            vmm_id=vmm,
            sled_id=v["sled_id"],
            vmm_boot=boot,
            sled_boot=boot + 1,
        ),
        VmmZombie(vmm_id=vmm, sled_id=v["sled_id"]),  # the instance runs on it
    ]
    for body in refused:
        with pytest.raises(bus.CommandError) as e:
            await order(stack, body)
        assert e.value.code == "stale", (body, e.value.message)
    assert await counter(client, "instance-manager", "orders.stale.stuck") == 2
    assert await counter(client, "instance-manager", "orders.stale.lost") == 1
    assert await counter(client, "instance-manager", "orders.stale.zombie") == 1
    now = await client.instance("show", silo, proj, "vm")
    assert (now["state"], now["active_vmm_id"], now["generation"]) == ("running", v["active_vmm_id"], gen)
    await assert_invariants(db)


async def test_one_lost_order_for_many_vmms_checks_each_on_its_own(rack: MakeRack) -> None:
    """v2 of `vmm.lost` names a rebooted sled's VMMs together, and is applied in one transaction: what
    still holds fails, what has moved is refused as stale (counted), and the reply says which."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    v = await running(client, silo, proj, ["a", "b", "c"])
    stack.services["recovery"].stop()  # this test sends the orders recovery would
    await client.sim_sled("reboot", "sled-0")
    await eventually(lambda: _boot_is(client, "sled-0", 2))

    def seen(name: str, **moved: Any) -> LostVmm:
        i = v[name]
        return LostVmm(
            instance_id=uuid.UUID(i["id"]),
            generation=moved.get("generation", i["generation"]),
            vmm_id=moved.get("vmm_id", uuid.UUID(i["active_vmm_id"])),
            vmm_boot=i["vmm_boot_number"],
        )

    body = VmmLostV2(
        sled_id="sled-0",
        sled_boot=2,
        vmms=[seen("a"), seen("b", generation=v["b"]["generation"] - 1), seen("c", vmm_id=uuid.uuid4())],
    )
    results = (await order(stack, body))["results"]
    a, b, c = (results[str(x.vmm_id)] for x in body.vmms)
    assert a == "failed"
    assert b.startswith("stale: ") and "is at generation" in b, b
    assert c.startswith("stale: ") and "has no record" in c, c
    assert await counter(client, "instance-manager", "orders.stale.lost") == 2
    assert (await client.instance("show", silo, proj, "a"))["state"] == "failed"
    for n in ("b", "c"):  # refused: nothing recorded (the API shows them failed all the same: lost VMMs)
        now = await client.instance("show", silo, proj, n)
        assert (now["generation"], now["active_vmm_id"]) == (v[n]["generation"], v[n]["active_vmm_id"]), now
        assert (now["state"], now["failed_at"]) == ("failed", None), now

    stack.start_service("recovery")  # its own orders, on its own picture, finish the repair
    await wait_state(client, silo, proj, "b", "stopped", timeout=20)
    await wait_state(client, silo, proj, "c", "stopped", timeout=20)
    await assert_invariants(db)


async def test_lost_orders_for_many_sleds_at_once_are_each_answered_on_their_own(rack: MakeRack) -> None:
    """After a rack's power loss the lost orders (one a sled) come together, and instance-manager applies
    those that arrive together in one transaction: each order still gets its own answer, a stale one is
    refused alone, and a repeat of an order is no harm."""
    stack, client, db = await rack(RACKPLANE_SLEDS="3", RACKPLANE_SLED_SHAPES="2:2")
    silo, proj = await new_project(client)
    v = await running(client, silo, proj, [f"vm-{i}" for i in range(6)])
    stack.services["recovery"].stop()  # this test sends the orders recovery would
    await client.sim_rack_reboot()
    for sled in ("sled-0", "sled-1", "sled-2"):
        await eventually(lambda sled=sled: _boot_is(client, sled, 2))

    def lost(sled: str, boot: int = 2) -> VmmLostV2:
        on = [i for i in v.values() if i["sled_id"] == sled]
        vmms = [
            LostVmm(
                instance_id=uuid.UUID(i["id"]),
                generation=i["generation"],
                vmm_id=uuid.UUID(i["active_vmm_id"]),
                vmm_boot=i["vmm_boot_number"],
            )
            for i in on
        ]
        return VmmLostV2(sled_id=sled, sled_boot=boot, vmms=vmms)

    bodies = [lost("sled-0"), lost("sled-1", boot=3), lost("sled-2"), lost("sled-0")]
    replies = await asyncio.gather(*(order(stack, b) for b in bodies))
    for body, reply in zip(bodies, replies, strict=True):
        assert set(reply["results"]) == {str(x.vmm_id) for x in body.vmms}, reply
    assert set(replies[2]["results"].values()) == {"failed"}, replies[2]
    for vmm, result in replies[0]["results"].items():  # sled-0's order and its repeat: whichever came first
        again = replies[3]["results"][vmm]  # failed it, and the other one found it ended (or came with it)
        assert "failed" in (result, again), (result, again)
        assert {result, again} <= {"failed", f"stale: VMM {vmm} has ended already"}, (result, again)
    for result in replies[1]["results"].values():  # a boot sled-1 never had: refused, nothing recorded
        assert result.startswith("stale: ") and "not yet 3" in result, result
    for i in v.values():
        now = await client.instance("show", silo, proj, i["name"])
        recorded = now["generation"] > i["generation"]
        assert recorded == (i["sled_id"] != "sled-1"), (i, now)
    await assert_invariants(db)


async def test_a_lagging_recovery_fails_nothing_healthy(rack: MakeRack) -> None:
    """Recovery hears of instances 6 s late (a slow handler, redelivered after the ack wait), while VMMs
    take 3 s to boot and the transition timeout is 4 s: it sees each new VMM in an inventory before it
    hears of its instance (a zombie, to its eyes), and the instance starting long after it runs (stuck).
    What it orders on that view is refused as stale (or, for stuck, not even sent: its own inventories
    show the VMMs running, a late word, not a stuck VMM); every instance runs on the VMM it started on."""
    _, client, db = await rack(
        RACKPLANE_SLEDS="2",
        RACKPLANE_ACK_WAIT="6",
        RACKPLANE_VMM_START_DELAY="3",
        RACKPLANE_TRANSITION_TIMEOUT="4",
        RACKPLANE_ZOMBIE_GRACE="1",
    )
    silo, proj = await new_project(client)
    await client.faults(
        "recovery", ServiceFaults(slow_handler_seconds=10, only=[subjects.event(silo, "instance", "changed")])
    )
    started = await running(client, silo, proj, [f"vm-{i}" for i in range(4)])

    async def refused_as_stale() -> dict[str, int] | None:
        stats = (await client.stats("instance-manager"))["counters"]
        stale = {k: v for k, v in stats.items() if k.startswith("orders.")}
        late = await counter(client, "recovery", "reconcile.stuck_reports_late")
        return (
            stale if stale.get("orders.stale.zombie") and (stale.get("orders.stale.stuck") or late) else None
        )

    await eventually(refused_as_stale, timeout=30)
    await client.clear_faults()
    for n, v in started.items():
        now = await client.instance("show", silo, proj, n)
        assert (now["state"], now["active_vmm_id"]) == ("running", v["active_vmm_id"]), now
    await assert_invariants(db)


async def test_automatic_restarts_keep_trying_until_there_is_room(rack: MakeRack) -> None:
    """Expunge a sled when the others have no room for all of its best_effort instances: those that do not
    fit stay failed, with the reason and their next try, and run again once a sled is added."""
    _, client, db = await rack(
        RACKPLANE_SLEDS="2", RACKPLANE_SLED_SHAPES="4:16", RACKPLANE_RESTART_BACKOFF_MAX="3"
    )
    silo, proj = await new_project(client)
    names = [f"vm-{i}" for i in range(6)]
    placed = await running(client, silo, proj, names, policy=AutoRestart.best_effort)
    assert {v["sled_id"] for v in placed.values()} == {"sled-0", "sled-1"}
    await client.sled_expunge("sled-0")

    async def waiting() -> list[dict[str, Any]] | None:
        now = [await client.instance("show", silo, proj, n) for n in names]
        stuck = [v for v in now if v["state"] == "failed" and v["auto_restarts"] >= 2]
        return stuck if stuck and all(v["state"] in ("failed", "running") for v in now) else None

    stuck = await eventually(waiting, timeout=30)
    for v in stuck:
        assert v["intended_state"] == "running" and v["next_restart_at"] is not None, v
        assert "automatic restart failed: no active sled that answers has room" in v["last_error"], v
    await client.sim_sled("add", vcpus=4, ram_bytes=16 * GiB)

    async def all_run() -> bool:
        return all([(await client.instance("show", silo, proj, n))["state"] == "running" for n in names])

    await eventually(all_run, timeout=30)
    await assert_invariants(db)


async def test_a_refused_start_leaves_the_instance_stopped_and_meaning_to_stay_so(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="1")
    silo = unique("silo")
    await client.silo_create(silo, Quota(vcpus=1))
    await client.project_create(silo, "p")
    await client.instance_create(silo, "p", "big", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    with pytest.raises(bus.CommandError, match="vCPU quota exceeded"):
        await client.instance("start", silo, "p", "big")
    v = await client.instance("show", silo, "p", "big")
    assert (v["state"], v["intended_state"]) == ("stopped", "stopped"), v
    assert "vCPU quota exceeded" in v["last_error"]
    await assert_invariants(db)


async def test_a_start_never_lands_on_a_sled_that_has_gone_silent(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_SLED_UNKNOWN_AFTER="2")
    silo, proj = await new_project(client)
    await client.sim_sled("freeze", "sled-0")
    await asyncio.sleep(3)  # its last inventory is older than the unknown-after limit
    placed = await running(client, silo, proj, [f"vm-{i}" for i in range(6)])
    assert {v["sled_id"] for v in placed.values()} == {"sled-1"}
    await client.sim_sled("thaw", "sled-0")
    await assert_invariants(db)


HOLD_LEASE = (
    "UPDATE instance_manager.sagas SET lease_owner = $2, "
    "lease_until = CASE WHEN $2::text IS NOT NULL THEN now() + interval '1 hour' END WHERE id = $1"
)
"""Hold a saga's lease as another process would (services/instance_manager/sagas/), or ($2 NULL) free it."""


@pytest.mark.parametrize("step", ["create_vmm", "ensure_on_sled"])
async def test_an_expunge_during_a_start_leaves_no_vmm_on_the_expunged_sled(
    rack: MakeRack, step: str
) -> None:
    """The start is placed on sled-0 (the only sled it fits on), then held before `step` while sled-0 is
    expunged: the start unwinds (before create_vmm) or is called off (before the ensure), and sled-0 is
    never asked to run its VMM."""
    stack, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_SLED_SHAPES="64:256,2:8")
    silo, proj = await new_project(client)
    await client.instance_create(
        silo, proj, "vm", vcpus=4, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    restart_service(stack, "instance_manager", crash_at=f"saga:instance-start/{step}")
    client.timeout = 2
    with contextlib.suppress(bus.CommandError):
        await client.instance("start", silo, proj, "vm")
    client.timeout = 15
    await eventually(lambda: _dead(stack), timeout=15)
    async with db.acquire() as conn:
        saga_id = await conn.fetchval(
            "SELECT id FROM instance_manager.sagas WHERE status = 'running' AND kind = 'instance-start'"
        )
        assert saga_id is not None
        holder = await asyncpg.connect(stack.admin_database_url)
        await holder.execute(HOLD_LEASE, saga_id, "test-holder")
    try:
        # it cannot resume the saga while the lease is held: it serves the expunge
        restart_service(stack, "instance_manager")
        await client.sled_expunge("sled-0")
    finally:
        await holder.execute(HOLD_LEASE, saga_id, None)  # the saga resumes now, finds sled-0 expunged
        await holder.close()

    async def saga_over() -> Any:
        async with db.acquire() as conn:
            return await conn.fetchval(
                "SELECT status FROM instance_manager.sagas WHERE id = $1 AND status IN ('done', 'failed')",
                saga_id,
            )

    assert await eventually(saga_over, timeout=20) == "failed"
    v = await client.instance("show", silo, proj, "vm")
    assert v["state"] in ("stopped", "failed") and v["active_vmm_id"] is None, v
    async with db.acquire() as conn:
        live = await conn.fetchval(
            "SELECT count(*) FROM instance_manager.vmms WHERE sled_id = 'sled-0' AND ended_at IS NULL"
        )
    assert live == 0
    await asyncio.sleep(1)  # were an ensure sent, sled-0 would run the VMM by now
    assert next(s for s in await client.sim_sled("list") if s["sled_id"] == "sled-0")["vmms"] == 0
    await assert_invariants(db)


async def _dead(stack: Stack) -> bool:
    return not stack.services["instance_manager"].alive


async def test_the_checker_reports_a_wrongful_kill_and_nothing_after_a_real_reboot(rack: MakeRack) -> None:
    """With instance-manager's records lied to on purpose (a reboot of the sled that never happened,
    written into its database), a lost-VMM order that claims that reboot passes the fence and fails a
    healthy instance: the checker, holding the failure against the sled's own boot history, says so.
    A real reboot's failures it accepts."""
    stack, client, db = await rack(RACKPLANE_SLEDS="2")
    silo, proj = await new_project(client)
    started = await running(client, silo, proj, ["victim", "rebooted"])
    v = started["victim"]
    other = started["rebooted"]
    if other["sled_id"] == v["sled_id"]:
        await client.instance_migrate(silo, proj, "rebooted")
        other = await eventually(lambda: _moved_off(client, silo, proj, "rebooted", v["sled_id"]), timeout=20)

    await client.sim_sled("reboot", other["sled_id"])  # a real reboot: its failure is justified
    await wait_state(client, silo, proj, "rebooted", "stopped", timeout=20)
    async with db.acquire() as conn:
        assert await no_wrongful_kills(conn, await sled_boots(client.nc) or {}) == []

    boot = v["vmm_boot_number"]
    liar = await asyncpg.connect(stack.admin_database_url)
    try:  # later inventories of the sled, of an older boot, are ignored: the lie stands
        await liar.execute(PLANT_BOOT, v["sled_id"], boot + 1)
    finally:
        await liar.close()
    lie = VmmLost(
        instance_id=uuid.UUID(v["id"]),
        generation=v["generation"],
        vmm_id=uuid.UUID(v["active_vmm_id"]),
        sled_id=v["sled_id"],
        vmm_boot=boot,
        sled_boot=boot + 1,
    )
    await order(stack, lie)
    await wait_state(client, silo, proj, "victim", "stopped")
    async with db.acquire() as conn:
        found = await check(conn, at_rest=True, js=client.nc.jetstream(), nc=client.nc)
    wrongful = [line for line in found if "wrongful kill" in line]
    assert len(wrongful) == 1 and "instance victim" in wrongful[0], found


PLANT_BOOT = "UPDATE instance_manager.sleds SET boot_number = $2 WHERE id = $1"
"""A reboot of sled $1 (its boot $2) that never happened, in instance-manager's records."""


async def _moved_off(client: Client, silo: str, proj: str, name: str, sled_id: str) -> Any:
    v = await client.instance("show", silo, proj, name)
    return v if v["state"] == "running" and v["sled_id"] != sled_id else None


async def test_a_stop_on_a_silent_sled_is_recorded_and_settled_when_the_sled_is_expunged(
    rack: MakeRack,
) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_SLED_UNKNOWN_AFTER="2")
    silo, proj = await new_project(client)
    v = (await running(client, silo, proj, ["vm"]))["vm"]
    await client.sim_sled("freeze", v["sled_id"])
    await eventually(lambda: _health(client, silo, proj, "vm", "unknown"), timeout=10)
    stopping = await client.instance("stop", silo, proj, "vm")
    assert (stopping["state"], stopping["intended_state"]) == ("stopping", "stopped")
    await asyncio.sleep(2)  # past the transition timeout's checks: a silent sled's instance is not failed
    assert (await client.instance("show", silo, proj, "vm"))["state"] == "stopping"
    await client.sled_expunge(v["sled_id"])
    stopped = await wait_state(client, silo, proj, "vm", "stopped")
    assert stopped["active_vmm_id"] is None
    await client.sim_sled("thaw", v["sled_id"])
    await assert_invariants(db)


async def _health(client: Client, silo: str, proj: str, name: str, health: str) -> bool:
    return (await client.instance("show", silo, proj, name))["health"] == health
