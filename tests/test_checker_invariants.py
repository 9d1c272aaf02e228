"""The checker sees what an outsider sees (issue 28): each of its invariants `vmms_claimed`,
`intent_honoured` and `newest_inventory_applied` is shown reporting the broken state it is for, built
directly in the database of a real stack (the state each finding of issue 28 leaves behind), and
reporting nothing on a quiet stack. Each test repairs what it broke, so the module's stack stays clean.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl import invariants as checker
from rackctl.client import Client
from tests.conftest import GiB, eventually, make_stack, new_project, wait_state

NEW = ("vmms_claimed", "intent_honoured", "newest_inventory_applied", "no_running_vmm_called_stuck")


@dataclass
class Rack:
    stack: Stack
    client: Client
    db: asyncpg.Pool
    admin: asyncpg.Pool
    """Written on purpose (the checker's role, `db`, is read-only)."""


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    stack = make_stack("checker", RACKPLANE_SLEDS="3")
    try:
        stack.start()
        assert stack.database_url and stack.admin_database_url
        client = await Client.connect(stack.nats_url)
        db = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=2)
        admin = await asyncpg.create_pool(stack.admin_database_url, min_size=1, max_size=2)
        assert db is not None and admin is not None
        try:
            await eventually(lambda: _sleds(client, 3), timeout=20)
            yield Rack(stack, client, db, admin)
        finally:
            await admin.close()
            await db.close()
            await client.close()
    finally:
        stack.stop()
        if os.environ.get("RACKPLANE_KEEP_LOGS") is None:
            shutil.rmtree(stack.dir, ignore_errors=True)


async def _sleds(client: Client, n: int) -> bool:
    return len(await client.sled_list()) >= n


async def found(rack: Rack, *about: str) -> list[str]:
    """What the whole checker (at rest, the broker's checks included) reports about any of `about`."""
    async with rack.db.acquire() as conn:
        lines = await checker.check(conn, at_rest=True, js=rack.client.nc.jetstream())
    return [line for line in lines if any(a in line for a in about)]


async def new_checks_clean(rack: Rack) -> dict[str, list[str]]:
    async with rack.db.acquire() as conn:
        each = await checker.check_each(conn, at_rest=True, js=rack.client.nc.jetstream())
    return {name: each[name] for name in NEW if each[name]}


async def _clean(rack: Rack) -> bool:
    return not await new_checks_clean(rack)


async def running(rack: Rack, silo: str, proj: str, name: str) -> Any:
    await rack.client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await rack.client.instance("start", silo, proj, name)
    return await wait_state(rack.client, silo, proj, name, "running")


async def test_a_quiet_stack_keeps_the_new_invariants(rack: Rack) -> None:
    """Instances running, stopped, a warm pool kept, a pool shrunk: none of the three reports anything,
    and `rackctl check` runs them all."""
    assert set(NEW) <= set(checker.names())
    silo, proj = await new_project(rack.client)
    await running(rack, silo, proj, "up")
    await running(rack, silo, proj, "down")
    await rack.client.instance("stop", silo, proj, "down")
    await rack.client.pool_create(silo, proj, "warm", size=2, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def kept() -> bool:
        return (await rack.client.pool("show", silo, proj, "warm"))["idle"] == 2

    await eventually(kept, timeout=30)
    await rack.client.pool("resize", silo, proj, "warm", size=1)
    await wait_state(rack.client, silo, proj, "down", "stopped")
    try:
        await eventually(lambda: _clean(rack), timeout=30, interval=1)
    except AssertionError:
        raise AssertionError(f"a quiet stack breaks: {await new_checks_clean(rack)}") from None


async def test_a_live_vmm_no_instance_claims_is_reported(rack: Rack) -> None:
    """Finding 2 leaves an instance stopped (uncharged, no active VMM) while its VMM keeps its live record
    and runs: `vmms_claimed` names that VMM."""
    silo, proj = await new_project(rack.client)
    v = await running(rack, silo, proj, "orphaned")
    vmm = v["active_vmm_id"]
    assert not await found(rack, vmm)
    orphan = "UPDATE instance_manager.instances SET state = $2, active_vmm_id = $3 WHERE id = $1"
    await rack.admin.execute(orphan, uuid.UUID(v["id"]), "stopped", None)
    try:
        lines = [line for line in await found(rack, vmm) if "no instance claims" in line]
    finally:
        await rack.admin.execute(orphan, uuid.UUID(v["id"]), "running", uuid.UUID(vmm))
    assert lines == [
        f"VMM {vmm} on {v['sled_id']} (running) has a live record no instance claims "
        f"(its instance orphaned ({v['id']}) is stopped)"
    ], lines
    await eventually(lambda: _clean(rack), timeout=20, interval=1)


async def test_a_retired_pool_member_left_running_is_reported(rack: Rack) -> None:
    """Finding 3: a pool deleted while its member was starting leaves the member meant to be stopped, and
    nothing ever stops it once it runs (charged, counted by no pool). `intent_honoured` names it once it
    has been so for longer than a reconcile pass; repaired (meant to run again), the keeper retires it."""
    silo, proj = await new_project(rack.client)
    await rack.client.pool_create(silo, proj, "leaky", size=1, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def member() -> Any:
        return await rack.admin.fetchrow(
            "SELECT i.id, i.name FROM instance_manager.instances i "
            "JOIN instance_manager.pools p ON p.id = i.pool_id "
            "WHERE p.name = 'leaky' AND p.project_id = (SELECT id FROM instance_manager.projects "
            "WHERE name = $1) AND i.state = 'running'",
            proj,
        )

    m = await eventually(member, timeout=30)
    async with rack.admin.acquire() as conn, conn.transaction():  # what the racing keeper leaves behind
        await conn.execute(
            "UPDATE instance_manager.pools SET state = 'deleted' WHERE name = 'leaky' AND project_id = "
            "(SELECT id FROM instance_manager.projects WHERE name = $1)",
            proj,
        )
        await conn.execute(
            "UPDATE instance_manager.instances SET intended_state = 'stopped', "
            "updated_at = now() - interval '1 hour' WHERE id = $1",
            m["id"],
        )
    try:
        lines = await found(rack, str(m["id"]))
    finally:
        await rack.admin.execute(
            "UPDATE instance_manager.instances SET intended_state = 'running' WHERE id = $1", m["id"]
        )
    assert len(lines) == 1 and lines[0].startswith(
        f"instance {m['name']} ({m['id']}) has been running for "
    ), lines
    assert "while meant to be stopped" in lines[0]
    await wait_state(rack.client, silo, proj, m["name"], "stopped", timeout=20)  # the keeper retires it
    await eventually(lambda: _clean(rack), timeout=20, interval=1)


async def test_an_overdue_automatic_restart_is_reported(rack: Rack) -> None:
    """A failed instance meant to run with auto-restart best_effort whose restart is overdue by more than
    a reconcile pass (recovery never heard of the failure here: no event was sent) is named."""
    silo, proj = await new_project(rack.client)
    v = await rack.client.instance_create(silo, proj, "forgotten", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    fail = (
        "UPDATE instance_manager.instances SET state = $2, intended_state = $3, "
        "auto_restart = 'best_effort', failed_at = now() - interval '1 hour' WHERE id = $1"
    )
    await rack.admin.execute(fail, uuid.UUID(v["id"]), "failed", "running")
    try:
        lines = await found(rack, v["id"])
    finally:
        await rack.admin.execute(fail, uuid.UUID(v["id"]), "stopped", "stopped")
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"instance forgotten ({v['id']}) is failed and meant to run (best_effort), "
    ), lines
    await eventually(lambda: _clean(rack), timeout=20, interval=1)


async def test_a_vmm_failed_as_stuck_though_its_sled_said_it_ran_is_reported(rack: Rack) -> None:
    """Finding 1: a start failed as stuck on a clock alone, while the sled's report that it ran was late,
    destroys a running VM. `no_running_vmm_called_stuck` names a stuck failure that has no inventory of
    its sled as evidence, one whose evidence comes after the sled's own report that the VMM ran in the
    same boot, and one whose evidence comes before the sled took the order to run it (issue 33: an order
    waiting unread); not one judged on a later boot's inventory (the VMM was gone with the boot it ran in)."""
    silo, proj = await new_project(rack.client)
    v = await running(rack, silo, proj, "late")
    vmm, sled, boot = uuid.UUID(v["active_vmm_id"]), v["sled_id"], v["vmm_boot_number"]
    record = (
        "INSERT INTO instance_manager.failures (instance_id, vmm_id, sled_id, kind, reason, vmm_boot_number, "
        "proof_boot_number, proof_seq) VALUES ($1, $2, $3, 'stuck', 'starting for over 4s', $4, $5, $6)"
    )
    for proof_boot, proof_seq, said in (
        (boot, None, "as evidence: on a clock alone"),
        (boot, 2**40, "a late report, not a stuck VMM"),
        (boot, 1, "an order waiting unread, not a stuck VMM"),
        (boot + 1, 1, None),
    ):
        await rack.admin.execute(record, uuid.UUID(v["id"]), vmm, sled, boot, proof_boot, proof_seq)
        try:
            lines = await found(rack, str(vmm))
        finally:
            await rack.admin.execute("DELETE FROM instance_manager.failures WHERE vmm_id = $1", vmm)
        if said is None:
            assert not lines, lines
            continue
        assert len(lines) == 1 and lines[0].startswith(f"VMM {vmm} of instance {v['id']} was failed at"), (
            lines
        )
        assert lines[0].endswith(said), lines
    assert not await found(rack, str(vmm))


@pytest.mark.parametrize("service", ["instance-manager", "recovery"])
async def test_a_sled_whose_newest_inventory_is_not_applied_is_reported(rack: Rack, service: str) -> None:
    """Finding 4 leaves a service holding a sled's inventory from before its capacity shrank, every later
    one dead-lettered. Here the sled falls silent (partitioned: its last inventory stays the newest) and
    the service's row is set back to the inventory before it: once the newest is older than an inventory
    in flight, `newest_inventory_applied` names the sled and the service; the sled back, it heals."""
    sled = "sled-2"
    table, applied = {
        "instance-manager": ("instance_manager.sleds", "last_seen_at"),
        "recovery": ("recovery.sleds", "last_inventory_at"),
    }[service]
    await rack.client.sim_sled("partition", sled)
    try:
        await asyncio.sleep(1.5)  # an inventory sent before the partition is applied by now
        await rack.admin.execute(
            f"UPDATE {table} SET inventory_seq = inventory_seq - 1, {applied} = now() - interval '1 hour' "
            "WHERE id = $1",
            sled,
        )

        async def named() -> list[str]:
            return [line for line in await found(rack, f"sled {sled}: its newest") if "not applied" in line]

        lines = await eventually(named, timeout=30, interval=1)  # once older than an inventory in flight
    finally:
        await rack.client.sim_sled("heal", sled)
    assert len(lines) == 1 and f"is not applied by {service}, which holds (boot " in lines[0], lines
    await eventually(lambda: _clean(rack), timeout=20, interval=1)
