"""The simulator's acknowledged commands survive its crash, and a migration's hand-over leaves the guest on
exactly one sled whatever the crash point; and a sled can be made to report less capacity (and back).

The crash points `sled-agent:write:<name>` kill the simulator just before the write of its state file
that carries a named change: a command (`vmm.ensure`, `vmm.stop`, `vmm.migrate`), or one of the hand-over's
two writes (`handover-target`, then `handover-source`)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deploy.stack import Stack
from rackctl.client import Client
from rackctl.sizes import format_size
from shared.bus import CommandError
from shared.messages.simulator import SimFaults, SimSledCapacity
from shared.topology import subjects
from tests.conftest import (
    GiB,
    Rack,
    assert_invariants,
    eventually,
    private_rack,
    restart_service,
    usage_is,
    wait_state,
)
from tests.test_cli import rackctl


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    # Unacked commands come back fast (2 s); nothing is called stuck while the simulator is away.
    async with private_rack(
        "simdur", RACKPLANE_SLEDS="2", RACKPLANE_ACK_WAIT="2", RACKPLANE_TRANSITION_TIMEOUT="120"
    ) as r:
        yield r


async def restart_simulator(stack: Stack, crash_at: str | None = None) -> None:
    """Restart the simulator, armed to die at a crash point (or not). Armed, wait for every sled's first
    inventory, which reserves its block of sequence numbers with a write of its state: the write of the
    command to come is then its own (a write made on the way, before the ack, would hide the bug)."""
    restart_service(stack, "sled_agent", crash_at)
    if crash_at:
        await asyncio.sleep(1.5)  # RACKPLANE_INVENTORY_INTERVAL is 1 s in tests


async def crashed(stack: Stack) -> None:
    async def dead() -> bool:
        return not stack.services["sled_agent"].alive

    await eventually(dead, timeout=20)


async def new_instance(client: Client, silo: str, *, running: bool) -> tuple[str, str, str]:
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    await client.instance_create(silo, "p", "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    if running:
        await client.instance("start", silo, "p", "vm")
        await wait_state(client, silo, "p", "vm", "running")
    return silo, "p", "vm"


async def ask(call: Any) -> None:
    """A request whose reply may never come: the simulator may die on the way."""
    try:
        await call
    except CommandError:
        pass


def live_vmms(stack: Stack, instance_id: str) -> list[tuple[str, str]]:
    """(sled, state) of every VMM of the instance that a sled's state file holds."""
    found = []
    for path in sorted((stack.dir / "sim").glob("sled-*.json")):
        state = json.loads(path.read_text())
        found += [(path.stem, v["state"]) for v in state["vmms"] if v["instance_id"] == instance_id]
    return found


async def exactly_one_running(stack: Stack, instance_id: str) -> list[tuple[str, str]]:
    """The instance's one VMM, running, if that is what the sleds' files hold (else empty)."""
    found = live_vmms(stack, instance_id)
    return found if len(found) == 1 and found[0][1] == "running" else []


async def one_running_vmm_one_charge(client: Client, db: Any, silo: str, name: str) -> dict[str, Any]:
    v = await client.instance("show", silo, "p", name)
    async with db.acquire() as conn:
        live = await conn.fetch(
            "SELECT id FROM instance_manager.vmms WHERE instance_id = $1 AND ended_at IS NULL",
            uuid.UUID(v["id"]),
        )
    assert [r["id"] for r in live] == [uuid.UUID(v["active_vmm_id"])], v
    await usage_is(client, {"vcpus": 2, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db)
    return v


@pytest.mark.parametrize("verb", ["vmm.ensure", "vmm.stop", "vmm.migrate"])
async def test_a_command_is_acked_only_once_its_effect_is_on_disk(rack: Rack, verb: str) -> None:
    """The simulator dies just before writing what a command did. Acked first (the bug), the command is
    gone: the VMM never starts, never stops, the instance never moves. Acked after the write, the
    command comes back to the restarted simulator and takes effect."""
    stack, client, db = rack
    silo, proj, name = await new_instance(
        client, f"acked-{verb.replace('.', '-')}", running=verb != "vmm.ensure"
    )
    before = await client.instance("show", silo, proj, name)

    await restart_simulator(stack, crash_at=f"sled-agent:write:{verb}")
    client.timeout = 3.0
    try:
        if verb == "vmm.ensure":
            await ask(client.instance("start", silo, proj, name))
        elif verb == "vmm.stop":
            await ask(client.instance("stop", silo, proj, name))
        else:
            await ask(client.instance_migrate(silo, proj, name))
    finally:
        client.timeout = 15.0
    await crashed(stack)
    await restart_simulator(stack)

    if verb == "vmm.ensure":
        await wait_state(client, silo, proj, name, "running", timeout=15)
    elif verb == "vmm.stop":
        await wait_state(client, silo, proj, name, "stopped", timeout=15)
        await client.instance("start", silo, proj, name)  # and it runs again, on a VMM of its own
        await wait_state(client, silo, proj, name, "running")
    else:

        async def moved() -> bool:
            v = await client.instance("show", silo, proj, name)
            return v["state"] == "running" and v["sled_id"] != before["sled_id"]

        # well within the target's wait (RACKPLANE_MIGRATE_TIMEOUT, 20 s), which would call it off
        await eventually(moved, timeout=15)
    await one_running_vmm_one_charge(client, db, silo, name)


async def test_the_report_of_a_vmm_that_ended_is_sent_again_after_a_crash_until_acknowledged(
    rack: Rack,
) -> None:
    """A VMM that ended is in none of its sled's lists. The simulator dies after writing the end and
    before the broker acknowledged its report: only the report kept with the state (`unsent`) is left to
    tell instance-manager. Without it the instance waits in `stopping` for ever: its sled lists the VMM no
    more, which recovery takes for a late report (the chaos soak found this)."""
    stack, client, db = rack
    silo, proj, name = await new_instance(client, "unsent", running=True)
    v = await client.instance("show", silo, proj, name)
    await client.sim_faults(SimFaults(sled_id=v["sled_id"], drop_probability=1.0))  # no report leaves
    try:
        await client.instance("stop", silo, proj, name)

        async def ended_on_disk() -> bool:
            return not live_vmms(stack, v["id"])

        await eventually(ended_on_disk, timeout=15)
        assert (await client.instance("show", silo, proj, name))["state"] == "stopping"
    finally:
        stack.services["sled_agent"].kill()  # its faults die with it
    await restart_simulator(stack)
    await wait_state(client, silo, proj, name, "stopped", timeout=15)
    await client.instance("start", silo, proj, name)
    await wait_state(client, silo, proj, name, "running")
    await one_running_vmm_one_charge(client, db, silo, name)


@pytest.mark.parametrize("point", ["handover-target", "handover-source"])
async def test_a_crash_mid_hand_over_leaves_the_guest_on_exactly_one_sled(rack: Rack, point: str) -> None:
    """The hand-over writes two sleds' files. Whichever write the simulator dies before, the restarted
    simulator has the guest on one sled, running, on its own (instance-manager and recovery are away,
    so that nothing but the sleds' files decides); then the control plane finishes the migration."""
    stack, client, db = rack
    silo, proj, name = await new_instance(client, f"handover-{point}", running=True)
    before = await client.instance("show", silo, proj, name)

    await restart_simulator(stack, crash_at=f"sled-agent:write:{point}")
    await client.instance_migrate(silo, proj, name)
    await crashed(stack)
    for service in ("instance_manager", "recovery"):
        stack.services[service].kill()
    try:
        await restart_simulator(stack)
        try:
            found = await eventually(lambda: exactly_one_running(stack, before["id"]), timeout=5)
        except AssertionError:
            vmms = live_vmms(stack, before["id"])
            raise AssertionError(f"not on exactly one sled: (sled, state) {vmms}") from None
        listed = {s["sled_id"]: s["vmms"] for s in await client.sim_sled("list")}
        on_disk = {
            p.stem: len(json.loads(p.read_text())["vmms"]) for p in (stack.dir / "sim").glob("sled-*.json")
        }
        assert listed == on_disk, "the running simulator holds what its files say"
        if point == "handover-source":
            assert found[0][0] != before["sled_id"], (
                "the target took over before the crash: it keeps the guest"
            )
    finally:  # the control plane back, however the test went: the module's other tests share the stack
        for service in ("instance_manager", "recovery"):
            stack.start_service(service)
        stack.wait_ready(("instance_manager", "recovery"))

    async def moved() -> bool:
        v = await client.instance("show", silo, proj, name)
        return v["state"] == "running" and v["sled_id"] == found[0][0] and v["target_vmm_id"] is None

    await eventually(moved, timeout=20)
    v = await one_running_vmm_one_charge(client, db, silo, name)
    assert live_vmms(stack, before["id"]) == [(v["sled_id"], "running")]


async def test_a_sled_reports_the_capacity_it_is_given_and_then_its_own_again(rack: Rack) -> None:
    """`rp.sim.sled.capacity` shrinks what the sled's next inventory says (sent at once), and null fields
    restore what it was made with; a simulator restart keeps it. `rackctl sim sled capacity` says it."""
    stack, client, _ = rack

    async def recorded(sled_id: str, vcpus: int, ram_bytes: int) -> bool:
        sled = next(s for s in await client.sled_list() if s["id"] == sled_id)
        return (sled["vcpus"], sled["ram_bytes"]) == (vcpus, ram_bytes)

    made = next(s for s in await client.sim_sled("list") if s["sled_id"] == "sled-1")
    shrink = SimSledCapacity(sled_id="sled-1", vcpus=4, ram_bytes=8 * GiB)
    shrunk = await client.call(subjects.sim_control("sled.capacity"), shrink)
    assert (shrunk["vcpus"], shrunk["ram_bytes"]) == (4, 8 * GiB), shrunk
    assert (shrunk["nominal_vcpus"], shrunk["nominal_ram_bytes"]) == (made["vcpus"], made["ram_bytes"])
    await eventually(lambda: recorded("sled-1", 4, 8 * GiB), timeout=5)

    await restart_simulator(stack)
    again = next(s for s in await client.sim_sled("list") if s["sled_id"] == "sled-1")
    assert (again["vcpus"], again["ram_bytes"]) == (4, 8 * GiB), again

    restored = await client.call(subjects.sim_control("sled.capacity"), SimSledCapacity(sled_id="sled-1"))
    assert (restored["vcpus"], restored["ram_bytes"]) == (made["vcpus"], made["ram_bytes"]), restored
    await eventually(lambda: recorded("sled-1", made["vcpus"], made["ram_bytes"]), timeout=5)
    with pytest.raises(CommandError) as e:
        await client.call(subjects.sim_control("sled.capacity"), SimSledCapacity(sled_id="sled-99"))
    assert e.value.code == "not_found"

    r = await rackctl(stack, "sim", "sled", "capacity", "sled-1", "--cpus", "2", "--ram", "4GiB")
    assert (r.code, r.err) == (0, ""), r
    ram = format_size(made["ram_bytes"])
    assert r.out == f"sled-1 reports 2 vCPUs, 4 GiB RAM (made with {made['vcpus']} vCPUs, {ram} RAM)\n", r
    await eventually(lambda: recorded("sled-1", 2, 4 * GiB), timeout=5)
    r = await rackctl(stack, "sim", "sled", "capacity", "sled-1")
    assert r.out == f"sled-1 reports {made['vcpus']} vCPUs, {ram} RAM\n", r
    r = await rackctl(stack, "sim", "sled", "capacity", "sled-1", "--cpus", "0")
    assert r.code == 2 and "--cpus must be at least 1" in r.err, r
