"""Sagas are durable: an instance-manager killed between two start-saga (or migrate-saga) steps resumes
the saga when it comes back, and leaves no leaked charge, reservation or VMM. Killed after a remote step's
action and before its progress was committed, it finds the effect there on its retry and goes on: one
running VMM, one charge, and an instance that stops when asked."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import Quota
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

STEPS = ["charge", "place", "create_vmm", "ensure_on_sled", "after:charge", "after:ensure_on_sled"]


@pytest.fixture(scope="module")
async def crashy() -> AsyncIterator[Rack]:
    # Unacked messages come back fast. A crash and restart can outlast the usual transition timeout on a
    # loaded machine, and recovery would then rightly call a resumed migration off as stuck.
    async with private_rack("crash", RACKPLANE_ACK_WAIT="2", RACKPLANE_TRANSITION_TIMEOUT="30") as rack:
        yield rack


async def new_instance(client: Client, silo: str) -> tuple[str, str, str]:
    """A stopped 2-vCPU instance `vm` in project `p` of a new silo."""
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    await client.instance_create(silo, "p", "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    return silo, "p", "vm"


async def start_and_let_it_crash(
    stack: Stack, client: Client, silo: str, proj: str, name: str, service: str
) -> None:
    """Ask for a start; the armed service dies on the way, so the reply may never come."""
    client.timeout = 2.0
    try:
        await client.instance("start", silo, proj, name)
    except CommandError:
        pass
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack, service), timeout=15)


@pytest.mark.parametrize("step", STEPS)
async def test_a_start_saga_resumes_after_a_crash_before_each_step(crashy: Rack, step: str) -> None:
    stack, client, db = crashy
    silo, proj, name = await new_instance(client, f"crash-{step.replace('_', '-').replace(':', '-')}")

    restart_service(stack, "instance_manager", crash_at=f"saga:instance-start/{step}")
    await start_and_let_it_crash(stack, client, silo, proj, name, "instance_manager")
    restart_service(stack, "instance_manager")
    await wait_state(client, silo, proj, name, "running", timeout=20)
    await one_running_vmm_one_charge_and_stoppable(client, db, silo, proj, name)


async def one_running_vmm_one_charge_and_stoppable(
    client: Client, db: asyncpg.Pool, silo: str, proj: str, name: str
) -> None:
    v = await client.instance("show", silo, proj, name)
    async with db.acquire() as conn:
        live = await conn.fetch(
            "SELECT id FROM instance_manager.vmms WHERE instance_id = $1 AND ended_at IS NULL",
            uuid.UUID(v["id"]),
        )
    assert [r["id"] for r in live] == [uuid.UUID(v["active_vmm_id"])]
    await usage_is(client, {"vcpus": 2, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db)
    await client.instance("stop", silo, proj, name)
    await wait_state(client, silo, proj, name, "stopped")
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo)
    await assert_invariants(db)


async def test_a_create_saga_goes_on_after_a_crash_once_its_disk_is_charged(crashy: Rack) -> None:
    stack, client, db = crashy
    silo = "crash-after-disk"
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    restart_service(stack, "instance_manager", crash_at="saga:instance-create/after:charge_disk")
    client.timeout = 2.0
    try:
        await client.instance_create(silo, "p", "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    except CommandError:
        pass
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack), timeout=15)
    restart_service(stack, "instance_manager")
    await wait_state(client, silo, "p", "vm", "stopped", timeout=20)
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo)
    await client.instance("start", silo, "p", "vm")
    await wait_state(client, silo, "p", "vm", "running")
    await one_running_vmm_one_charge_and_stoppable(client, db, silo, "p", "vm")


MIGRATE_STEPS = [
    "place",
    "create_vmm",
    "ensure_target",
    "migrate_source",
    "after:ensure_target",
    "after:migrate_source",
]


@pytest.mark.parametrize("step", MIGRATE_STEPS)
async def test_a_migrate_saga_resumes_after_a_crash_before_each_step(crashy: Rack, step: str) -> None:
    stack, client, db = crashy
    silo, proj, name = await new_instance(client, f"crash-move-{step.replace('_', '-').replace(':', '-')}")
    await client.instance("start", silo, proj, name)
    before = await wait_state(client, silo, proj, name, "running")

    restart_service(stack, "instance_manager", crash_at=f"saga:instance-migrate/{step}")
    client.timeout = 2.0
    try:
        await client.instance_migrate(silo, proj, name)
    except CommandError:
        pass
    finally:
        client.timeout = 15.0
    await eventually(lambda: _dead(stack), timeout=15)
    restart_service(stack, "instance_manager")

    async def moved() -> bool:
        v = await client.instance("show", silo, proj, name)
        return v["state"] == "running" and v["sled_id"] != before["sled_id"]

    await eventually(moved, timeout=20)
    await one_running_vmm_one_charge_and_stoppable(client, db, silo, proj, name)


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

    restart_service(stack, "instance_manager", crash_at="saga:instance-start/undo:interlock")
    # refused by the quota: the saga unwinds, and dies on the way
    await start_and_let_it_crash(stack, client, silo, proj, name, "instance_manager")
    restart_service(stack, "instance_manager")
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

    restart_service(stack, "accounting", crash_at="after-commit:accounting-deltas-*")
    # the reply waits for the charge, which waits for accounting to come back
    await start_and_let_it_crash(stack, client, silo, proj, name, "accounting")
    restart_service(stack, "accounting")
    await wait_state(client, silo, proj, name, "running", timeout=20)

    async def redelivered_and_recognised() -> bool:
        return (await client.stats("accounting"))["counters"].get("deltas.duplicate", 0) >= 1

    await eventually(redelivered_and_recognised, timeout=15)
    await usage_is(client, {"vcpus": 3, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db)


async def _saga_of(db: asyncpg.Pool, silo: str) -> asyncpg.Record:
    """The start saga of the silo's one instance (read in the database: instance-manager may be down):
    its cursor, the steps its log calls done, and the charges it has pending."""
    instance_id = await db.fetchval(
        "SELECT i.id FROM instance_manager.instances i JOIN instance_manager.projects p"
        " ON p.id = i.project_id JOIN instance_manager.silos s ON s.id = p.silo_id WHERE s.name = $1",
        silo,
    )
    return await db.fetchrow(
        "SELECT s.id, s.cursor, array(SELECT e.step FROM instance_manager.saga_events e"
        "  WHERE e.saga_id = s.id AND e.event = 'done' ORDER BY e.seq) AS done,"
        " (SELECT count(*) FROM instance_manager.pending_charges c WHERE c.instance_id = $1) AS pending"
        " FROM instance_manager.sagas s WHERE s.kind = 'instance-start' AND s.params->>'instance_id' = $2",
        instance_id,
        str(instance_id),
    )


async def test_a_starts_charge_is_sent_in_its_interlocks_transaction(crashy: Rack) -> None:
    """Killed before its charge step ever ran, the start has sent its charge all the same: the interlock's
    commit wrote it (one transaction fewer a start), and the step only awaits its outcome."""
    stack, client, db = crashy
    silo, proj, name = await new_instance(client, "crash-charge-sent")
    restart_service(stack, "instance_manager", crash_at="saga:instance-start/charge")
    await start_and_let_it_crash(stack, client, silo, proj, name, "instance_manager")
    saga = await _saga_of(db, silo)
    assert (saga["cursor"], saga["done"], saga["pending"]) == (1, ["interlock"], 1)
    restart_service(stack, "instance_manager")
    await wait_state(client, silo, proj, name, "running", timeout=20)
    await one_running_vmm_one_charge_and_stoppable(client, db, silo, proj, name)


async def test_local_steps_that_follow_each_other_commit_together(crashy: Rack) -> None:
    """`place` and `create_vmm` share one transaction: killed before `create_vmm`, the process leaves
    neither done (no reservation without its VMM record), and the next one runs both."""
    stack, client, db = crashy
    silo, proj, name = await new_instance(client, "crash-together")
    restart_service(stack, "instance_manager", crash_at="saga:instance-start/create_vmm")
    await start_and_let_it_crash(stack, client, silo, proj, name, "instance_manager")
    saga = await _saga_of(db, silo)
    assert (saga["cursor"], saga["done"]) == (2, ["interlock", "charge"])
    restart_service(stack, "instance_manager")
    await wait_state(client, silo, proj, name, "running", timeout=20)
    saga = await _saga_of(db, silo)
    assert saga["done"] == ["interlock", "charge", "place", "create_vmm", "ensure_on_sled"]
    await one_running_vmm_one_charge_and_stoppable(client, db, silo, proj, name)
