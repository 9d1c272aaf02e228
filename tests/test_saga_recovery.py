"""Sagas are durable: an instance-manager killed between two start-saga steps resumes the saga when it
comes back, and leaves no leaked charge, reservation or VMM."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from deploy.stack import Stack
from shared.bus import CommandError
from shared.messages import Quota
from tests.conftest import GiB, Rack, assert_invariants, eventually, private_rack, usage_is, wait_state

STEPS = ["charge", "place", "create_vmm", "ensure_on_sled"]


@pytest.fixture(scope="module")
async def crashy() -> AsyncIterator[Rack]:
    async with private_rack("crash", RACKPLANE_ACK_WAIT="2") as rack:  # unacked messages come back fast
        yield rack


@pytest.mark.parametrize("step", STEPS)
async def test_a_start_saga_resumes_after_a_crash_before_each_step(crashy: Rack, step: str) -> None:
    stack, client, db = crashy
    silo, proj, name = f"crash-{step.replace('_', '-')}", "p", "vm"
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    await client.instance_create(silo, proj, name, vcpus=2, ram_bytes=GiB, disk_bytes=GiB)

    im = stack.services["instance_manager"]
    im.stop()
    stack.env["RACKPLANE_CRASH_AT"] = f"saga:instance-start/{step}"
    stack.start_service("instance_manager")
    stack.wait_ready(("instance_manager",))
    client.timeout = 2.0
    try:
        await client.instance("start", silo, proj, name)
    except CommandError:
        pass  # the process died under the request
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack), timeout=15)

    del stack.env["RACKPLANE_CRASH_AT"]
    stack.start_service("instance_manager")
    stack.wait_ready(("instance_manager",))
    await wait_state(client, silo, proj, name, "running", timeout=20)
    await assert_invariants(db)


async def _dead(stack: Stack, service: str = "instance_manager") -> bool:
    return not stack.services[service].alive


async def test_an_unwinding_saga_finishes_unwinding_after_a_crash(
    crashy: Rack,
) -> None:
    stack, client, db = crashy
    silo, proj, name = "crash-unwind", "p", "vm"
    await client.silo_create(silo, Quota(vcpus=1))
    await client.project_create(silo, proj)
    await client.instance_create(silo, proj, name, vcpus=2, ram_bytes=GiB, disk_bytes=GiB)

    stack.services["instance_manager"].stop()
    stack.env["RACKPLANE_CRASH_AT"] = "saga:instance-start/undo:interlock"
    stack.start_service("instance_manager")
    stack.wait_ready(("instance_manager",))
    client.timeout = 2.0
    try:
        await client.instance("start", silo, proj, name)  # refused by the quota: the saga unwinds
    except CommandError:
        pass
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack), timeout=15)

    del stack.env["RACKPLANE_CRASH_AT"]
    stack.start_service("instance_manager")
    stack.wait_ready(("instance_manager",))
    stopped = await wait_state(client, silo, proj, name, "stopped", timeout=20)
    assert "vCPU quota exceeded" in stopped["last_error"]
    await assert_invariants(db)


async def test_accounting_killed_between_commit_and_ack_counts_the_charge_once(
    crashy: Rack,
) -> None:
    """The charge commits, the process dies before acking it: JetStream redelivers it to the next
    process, whose generation fence recognises it as a repeat. Charged once; the start completes."""
    stack, client, db = crashy
    silo, proj, name = "crash-acct", "p", "vm"
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    await client.instance_create(silo, proj, name, vcpus=3, ram_bytes=GiB, disk_bytes=GiB)

    stack.services["accounting"].stop()
    stack.env["RACKPLANE_CRASH_AT"] = "after-commit:accounting-deltas"
    stack.start_service("accounting")
    stack.wait_ready(("accounting",))
    client.timeout = 2.0
    try:
        await client.instance("start", silo, proj, name)
    except CommandError:
        pass  # the reply waits for the charge, which waits for accounting to come back
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack, "accounting"), timeout=15)

    del stack.env["RACKPLANE_CRASH_AT"]
    stack.start_service("accounting")
    stack.wait_ready(("accounting",))
    await wait_state(client, silo, proj, name, "running", timeout=20)

    async def redelivered_and_recognised() -> bool:
        return (await client.stats("accounting"))["counters"].get("deltas.duplicate", 0) >= 1

    await eventually(redelivered_and_recognised, timeout=15)
    await usage_is(client, {"vcpus": 3, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db)
