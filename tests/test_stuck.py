"""A VMM is judged stuck only on its sled's evidence (issue 28, finding 1).

The transition timeout alone says that a report has not come, not that the VMM is not there: a sled whose
reports are held past the timeout, while its inventories list the VMM running, has a late report, not a
stuck VMM. Neither recovery nor instance-manager may then fail the start, nor call off a migration whose
target already runs the instance (after the hand-over, its only copy). A start the sled never runs is
still failed. Nor is a start whose order waits unread on its sled's command stream, or that its sled has
been booting for less than the timeout (issue 33: waiting is not failing). Each test has a stack of its
own, with a 3 s transition timeout.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from deploy.stack import Stack
from rackctl import invariants as checker
from rackctl.client import Client
from shared import bus
from shared.messages import AutoRestart, SimFaults, VmmStuck
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
    usage_is,
    wait_state,
)

MakeRack = Callable[..., Awaitable[Rack]]
TIMEOUT = "3"


@pytest.fixture
async def rack() -> AsyncIterator[MakeRack]:
    async with contextlib.AsyncExitStack() as racks:

        async def make(**env: str) -> Rack:
            return await racks.enter_async_context(
                private_rack("stuck", RACKPLANE_TRANSITION_TIMEOUT=TIMEOUT, **env)
            )

        yield make


async def hold_reports(client: Client, sled: str) -> None:
    """Every VMM report of `sled` is held (each attempt delayed far beyond the test) until released."""
    await client.sim_faults(SimFaults(sled_id=sled, delay_seconds=600, delay_count=1000))


async def release_reports(client: Client, sled: str) -> None:
    await client.sim_faults(SimFaults(sled_id=sled))


async def vmms_on(client: Client) -> dict[str, int]:
    return {s["sled_id"]: s["vmms"] for s in await client.sim_sled("list")}


async def stuck_order(stack: Stack, body: VmmStuck) -> str:
    """Send a stuck order as recovery would; returns `applied: <result>` or `stale: <why>`."""
    nc = await connect_as(stack, "recovery")
    try:
        reply = await bus.request(nc, subjects.command(None, "vmm", "stuck"), body, source="recovery")
        return f"applied: {reply['result']}"
    except bus.CommandError as e:
        assert e.code == "stale", e
        return f"stale: {e.message}"
    finally:
        await nc.close()


async def refused_as_late(stack: Stack, body: VmmStuck) -> str | None:
    """The order, once the sled's evidence is in: refused because the report is late, not the VMM (on
    anything else, None: still too early to judge, or, on the old code, the VMM was failed)."""
    answer = await stuck_order(stack, body)
    return answer if "its report is late, not the VMM" in answer else None


async def test_a_start_whose_reports_are_held_past_the_timeout_runs_on_its_vmm(rack: MakeRack) -> None:
    """The reviewer's reproduction: auto-restart `never`, reports held past the 3 s timeout, the VM
    running on its sled all along. Nothing is failed: the instance ends running on the same VMM,
    charged, with no automatic restart and no error."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await client.instance_create(
        silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    await hold_reports(client, "sled-0")
    starting = await client.instance("start", silo, proj, "vm")
    vmm = starting["active_vmm_id"]
    assert starting["state"] == "starting" and vmm is not None, starting
    await eventually(lambda: _runs(client, "sled-0", 1), timeout=10)

    body = VmmStuck(
        instance_id=uuid.UUID(starting["id"]),
        generation=(await client.instance("show", silo, proj, "vm"))["generation"],
        vmm_id=uuid.UUID(vmm),
        state="starting",
    )
    answer = await eventually(lambda: refused_as_late(stack, body), timeout=15, interval=0.5)
    assert "sled sled-0 lists VMM" in answer and "as running" in answer, answer
    # Recovery's own picture (its inventories) saw the same, and sent no order for it.
    await eventually(lambda: _more(counter(client, "recovery", "reconcile.stuck_reports_late"), 0))
    held = await client.instance("show", silo, proj, "vm")
    assert (held["state"], held["active_vmm_id"], held["failed_at"]) == ("starting", vmm, None), held

    await release_reports(client, "sled-0")
    running = await wait_state(client, silo, proj, "vm", "running", timeout=15)
    assert running["active_vmm_id"] == vmm and running["auto_restarts"] == 0, running
    assert running["last_error"] is None and running["failed_at"] is None, running
    await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    assert await vmms_on(client) == {"sled-0": 1}
    await assert_invariants(db)


async def test_a_migration_whose_reports_are_held_past_the_timeout_keeps_its_vm(rack: MakeRack) -> None:
    """Both sleds' reports held past the timeout while the hand-over completes on the sleds: the target
    runs the only copy of the instance. It is never destroyed; the move ends on it, charged once."""
    stack, client, db = await rack(RACKPLANE_SLEDS="2")
    silo, proj = await new_project(client)
    await client.instance_create(
        silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    await client.instance("start", silo, proj, "vm")
    before = await wait_state(client, silo, proj, "vm", "running")
    source = before["sled_id"]
    target_sled = "sled-1" if source == "sled-0" else "sled-0"
    for sled in (source, target_sled):
        await hold_reports(client, sled)

    await client.instance_migrate(silo, proj, "vm", to_sled=target_sled)
    moving = await eventually(lambda: _with_target(client, silo, proj), timeout=10)
    target = moving["target_vmm_id"]
    await eventually(lambda: _handed_over(client, source, target_sled), timeout=10)

    body = VmmStuck(
        instance_id=uuid.UUID(moving["id"]),
        generation=(await client.instance("show", silo, proj, "vm"))["generation"],
        vmm_id=uuid.UUID(target),
        state="migrating",
    )
    answer = await eventually(lambda: refused_as_late(stack, body), timeout=15, interval=0.5)
    assert f"sled {target_sled} lists VMM {target} as running" in answer, answer
    await eventually(lambda: _more(counter(client, "recovery", "reconcile.stuck_reports_late"), 0))
    held = await client.instance("show", silo, proj, "vm")
    assert (held["state"], held["target_vmm_id"]) == ("migrating", target), held

    for sled in (source, target_sled):
        await release_reports(client, sled)
    moved = await eventually(lambda: _on(client, silo, proj, target_sled), timeout=15)
    assert moved["active_vmm_id"] == target and moved["auto_restarts"] == 0, moved
    assert "migration failed" not in (moved["last_error"] or ""), moved
    assert await vmms_on(client) == {source: 0, target_sled: 1}
    await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db)


async def test_a_stop_whose_report_is_held_past_the_timeout_is_not_called_stuck(rack: MakeRack) -> None:
    """The sled has stopped the VMM (its inventories no longer list it) but its report is held: the stop
    is not stuck, its report is late. It ends stopped by that report, with no failure recorded."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "vm")
    running = await wait_state(client, silo, proj, "vm", "running")
    await hold_reports(client, "sled-0")
    stopping = await client.instance("stop", silo, proj, "vm")
    assert stopping["state"] == "stopping", stopping
    await eventually(lambda: _runs(client, "sled-0", 0), timeout=10)

    body = VmmStuck(
        instance_id=uuid.UUID(running["id"]),
        generation=stopping["generation"],
        vmm_id=uuid.UUID(running["active_vmm_id"]),
        state="stopping",
    )
    answer = await eventually(lambda: refused_as_late(stack, body), timeout=15, interval=0.5)
    assert f"sled sled-0 no longer lists VMM {running['active_vmm_id']}" in answer, answer
    await release_reports(client, "sled-0")
    stopped = await wait_state(client, silo, proj, "vm", "stopped", timeout=15)
    assert stopped["last_error"] is None and stopped["failed_at"] is None, stopped
    failures = await db.fetchval(
        "SELECT count(*) FROM instance_manager.failures WHERE instance_id = $1", uuid.UUID(running["id"])
    )
    assert failures == 0
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo)
    await assert_invariants(db)


async def test_a_start_its_sled_never_runs_is_still_failed(rack: MakeRack) -> None:
    """The sled takes the ensure and does nothing with it: its inventories, made past the timeout, never
    list the VMM. That is evidence, and the start is failed (auto-restart `never`: it comes to rest
    stopped, with the reason)."""
    _, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    await client.instance_create(
        silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    await client.sim_faults(SimFaults(sled_id="sled-0", drop_commands=True))
    await client.instance("start", silo, proj, "vm")
    stopped = await wait_state(client, silo, proj, "vm", "stopped", timeout=20)
    assert f"starting for over {TIMEOUT}s (sled sled-0 does not list it)" in stopped["last_error"], stopped
    await client.sim_faults(SimFaults(sled_id="sled-0"))
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo)
    await assert_invariants(db)
    async with db.acquire() as conn:  # the failure names the inventory it was judged on, which holds
        assert await checker.no_running_vmm_called_stuck(conn, client.nc.jetstream()) == []
        proof = await conn.fetchrow("SELECT proof_boot_number, proof_seq FROM instance_manager.failures")
    assert proof["proof_boot_number"] == 1 and proof["proof_seq"] is not None, proof


async def test_a_start_whose_order_waits_unread_past_the_timeout_runs(rack: MakeRack) -> None:
    """The sled's command consumer lags: the order to run the VMM waits on its stream past the 3 s timeout
    while its inventories, which do not list the VMM, flow. That is no evidence of anything: the start is
    not failed, and runs on its VMM once the sled takes the order."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj, starting, body = await _start_held(client, hold=12)
    answer = await eventually(lambda: _stale_with(stack, body, "has not taken the order"), timeout=15)
    assert "it has read its commands up to" in answer, answer
    held = await client.instance("show", silo, proj, "vm")
    assert (held["state"], held["failed_at"]) == ("starting", None), held

    await client.sim_faults(SimFaults(sled_id="sled-0"))  # the held order comes again within 12 s
    running = await wait_state(client, silo, proj, "vm", "running", timeout=20)
    assert running["active_vmm_id"] == starting["active_vmm_id"] and running["auto_restarts"] == 0, running
    assert running["last_error"] is None and running["failed_at"] is None, running
    await assert_invariants(db)


@pytest.mark.parametrize("simulator", ["runs on", "restarts"])
async def test_an_order_refused_for_now_holds_back_what_the_sled_says_it_read(
    rack: MakeRack, simulator: str
) -> None:
    """Found by the chaos soak: the sled refuses its first order for now (held), the hold ends, and a
    second order comes; the first comes again only after its delay, so the second is taken first. The
    sled has read its stream only up to before the first, and says so: a stuck order for the first is
    refused as unread, not applied. The same when the simulator restarts with the first in hand: its
    file does not know it, the broker does (its durable's ack floor). Both end running."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1")
    silo, proj = await new_project(client)
    for name in ("first", "second"):
        await client.instance_create(
            silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
        )
    await client.sim_faults(SimFaults(sled_id="sled-0", hold_commands_seconds=12))
    first = await client.instance("start", silo, proj, "first")
    body = await _stuck_body(client, silo, proj, first, "first")
    await eventually(lambda: counter(client, "sled-agent", "sled.fault.command_held"), timeout=10)
    if simulator == "restarts":
        restart_service(stack, "sled_agent")  # its faults go with it
        stack.wait_ready(("sled_agent",))
    else:
        await client.sim_faults(SimFaults(sled_id="sled-0"))  # the first comes again within 12 s
    await client.instance("start", silo, proj, "second")
    await eventually(lambda: _runs(client, "sled-0", 1), timeout=10)  # the second, taken first
    answer = await eventually(lambda: _stale_with(stack, body, "has not taken the order"), timeout=6)
    assert "it has read its commands up to" in answer, answer
    for name in ("first", "second"):
        running = await wait_state(client, silo, proj, name, "running", timeout=40)
        assert running["auto_restarts"] == 0 and running["failed_at"] is None, running
    await assert_invariants(db)


async def test_a_start_its_sled_took_late_has_the_timeout_to_boot(rack: MakeRack) -> None:
    """The order waits unread for 5 s, past the 3 s timeout, then the sled takes it and boots the VMM for
    2.5 s: its inventories list it as starting, but only since the sled took the order, which is what the
    timeout counts from on the sled's evidence. Not stuck; it runs."""
    stack, client, db = await rack(RACKPLANE_SLEDS="1", RACKPLANE_VMM_START_DELAY="2.5")
    silo, proj, _, body = await _start_held(client, hold=5)
    await eventually(lambda: _runs(client, "sled-0", 1), timeout=15)  # taken, and booting
    await client.sim_faults(SimFaults(sled_id="sled-0"))
    answer = await eventually(lambda: _stale_with(stack, body, "as starting only since"), timeout=2.5)
    assert "not 3s" in answer, answer
    running = await wait_state(client, silo, proj, "vm", "running", timeout=20)
    assert running["auto_restarts"] == 0 and running["failed_at"] is None, running
    await assert_invariants(db)


async def _start_held(client: Client, hold: float) -> tuple[str, str, dict[str, Any], VmmStuck]:
    """An instance `vm` (auto-restart `never`) started while sled-0 holds its orders `hold` seconds: its
    project, the start's reply, and the stuck order recovery would send about it."""
    silo, proj = await new_project(client)
    await client.instance_create(
        silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    await client.sim_faults(SimFaults(sled_id="sled-0", hold_commands_seconds=hold))
    starting = await client.instance("start", silo, proj, "vm")
    return silo, proj, starting, await _stuck_body(client, silo, proj, starting)


async def _stuck_body(
    client: Client, silo: str, proj: str, starting: dict[str, Any], name: str = "vm"
) -> VmmStuck:
    vmm = starting["active_vmm_id"]
    assert starting["state"] == "starting" and vmm is not None, starting
    return VmmStuck(
        instance_id=uuid.UUID(starting["id"]),
        generation=(await client.instance("show", silo, proj, name))["generation"],
        vmm_id=uuid.UUID(vmm),
        state="starting",
    )


async def _stale_with(stack: Stack, body: VmmStuck, words: str) -> str | None:
    """The stuck order's answer if it is stale for the reason `words` tell (else None: not yet)."""
    answer = await stuck_order(stack, body)
    assert not answer.startswith("applied"), answer
    return answer if words in answer else None


async def _runs(client: Client, sled: str, n: int) -> bool:
    return (await vmms_on(client)).get(sled) == n


async def _handed_over(client: Client, source: str, target: str) -> bool:
    return await vmms_on(client) == {source: 0, target: 1}


async def _with_target(client: Client, silo: str, proj: str) -> Any:
    v = await client.instance("show", silo, proj, "vm")
    return v if v["state"] == "migrating" and v["target_vmm_id"] else None


async def _on(client: Client, silo: str, proj: str, sled: str) -> Any:
    v = await client.instance("show", silo, proj, "vm")
    return v if v["state"] == "running" and v["sled_id"] == sled else None


async def _more(value: Awaitable[int], than: int) -> bool:
    return await value > than
