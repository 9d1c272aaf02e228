"""Live migration: a running instance moves to another sled without stopping; its charge never moves;
it holds room on both sleds until the move ends; a move that cannot finish leaves it where it was."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import AutoRestart
from tests.conftest import (
    GiB,
    Rack,
    assert_invariants,
    eventually,
    private_rack,
    unique,
    usage_is,
    wait_state,
)

MakeRack = Callable[..., Awaitable[Rack]]


@pytest.fixture
async def rack() -> AsyncIterator[MakeRack]:
    async with contextlib.AsyncExitStack() as racks:

        async def make(**env: str) -> Rack:
            return await racks.enter_async_context(private_rack("migrate", **env))

        yield make


async def running(client: Client, vcpus: int = 2, **create: Any) -> tuple[str, str, str, dict[str, Any]]:
    silo, proj, name = unique("silo"), "p", "vm"
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    await client.instance_create(silo, proj, name, vcpus=vcpus, ram_bytes=GiB, disk_bytes=GiB, **create)
    await client.instance("start", silo, proj, name)
    return silo, proj, name, await wait_state(client, silo, proj, name, "running")


async def reserved(client: Client) -> dict[str, int]:
    return {s["id"]: s["reserved_vcpus"] for s in await client.sled_list()}


async def settled(client: Client, silo: str, proj: str, name: str, timeout: float = 30) -> dict[str, Any]:
    """The instance once its move is over (running, on whichever VMM)."""

    async def done() -> Any:
        v = await client.instance("show", silo, proj, name)
        return v if v["state"] != "migrating" else None

    return await eventually(done, timeout)


async def test_a_running_instance_moves_and_its_charge_does_not(client: Client, db: asyncpg.Pool) -> None:
    silo, proj, name, before = await running(client, vcpus=3)
    charge = {"vcpus": 3, "ram_bytes": GiB, "disk_bytes": GiB}
    await usage_is(client, charge, silo)

    moving = await client.instance_migrate(silo, proj, name)
    m = moving["migration"]
    assert m["source_sled_id"] == before["sled_id"] and m["source_vmm_id"] == before["active_vmm_id"]
    assert m["target_sled_id"] not in (None, before["sled_id"])
    after = await wait_state(client, silo, proj, name, "running")
    if after["active_vmm_id"] != m["target_vmm_id"]:  # the reply came before the move ended
        after = await eventually(lambda: _on(client, silo, proj, name, m["target_vmm_id"]))
    assert after["sled_id"] == m["target_sled_id"] and after["target_vmm_id"] is None
    assert after["generation"] > before["generation"] and after["last_error"] is None
    assert (await client.usage(silo))["usage"] == charge  # charged once, wherever it runs

    # Where it goes, it can go again: back to the sled it came from, by name.
    back = await client.instance_migrate(silo, proj, name, to_sled=before["sled_id"])
    assert back["migration"]["target_sled_id"] == before["sled_id"]
    await eventually(lambda: _on(client, silo, proj, name, back["migration"]["target_vmm_id"]))
    await usage_is(client, charge, silo)
    await assert_invariants(db)


async def _on(client: Client, silo: str, proj: str, name: str, vmm_id: str) -> Any:
    v = await client.instance("show", silo, proj, name)
    return v if v["state"] == "running" and v["active_vmm_id"] == vmm_id else None


async def test_a_migration_that_cannot_begin_says_why(client: Client, db: asyncpg.Pool) -> None:
    silo, proj, name, v = await running(client)
    here = v["sled_id"]
    reservations = await reserved(client)

    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, name, to_sled=here)
    assert e.value.code == "conflict" and f"already runs on {here}" in e.value.message
    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, name, to_sled="sled-999")
    assert e.value.code == "not_found" and "no sled sled-999" in e.value.message
    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, "nope")
    assert e.value.code == "not_found"

    await client.instance("stop", silo, proj, name)
    await wait_state(client, silo, proj, name, "stopped")
    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, name)
    assert e.value.code == "conflict" and "only a running instance can be migrated" in e.value.message
    assert (await reserved(client))[here] == reservations[here] - 2
    await assert_invariants(db)


async def test_of_two_concurrent_migrations_one_wins(client: Client, db: asyncpg.Pool) -> None:
    silo, proj, name, _ = await running(client)
    results = await asyncio.gather(
        *(client.instance_migrate(silo, proj, name) for _ in range(5)), return_exceptions=True
    )
    won = [r for r in results if isinstance(r, dict)]
    lost = [r for r in results if isinstance(r, CommandError)]
    assert len(won) == 1 and len(lost) == 4, results
    assert all(e.code == "conflict" and "migrating already" in e.message for e in lost)
    target = won[0]["migration"]["target_vmm_id"]
    await eventually(lambda: _on(client, silo, proj, name, target))
    await assert_invariants(db)


async def test_a_stop_waits_for_the_move_to_end(client: Client, db: asyncpg.Pool) -> None:
    silo, proj, name, _ = await running(client)
    moving = await client.instance_migrate(silo, proj, name)
    if moving["state"] == "migrating":
        with pytest.raises(CommandError) as e:
            await client.instance("stop", silo, proj, name)
        assert e.value.code == "conflict" and "migrating" in e.value.message
    await settled(client, silo, proj, name)
    await client.instance("stop", silo, proj, name)
    await wait_state(client, silo, proj, name, "stopped")
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo)
    await assert_invariants(db)


async def test_a_move_with_no_room_anywhere_unwinds_and_leaves_nothing_reserved(rack: MakeRack) -> None:
    _, client, db = await rack(RACKPLANE_SLEDS="2", RACKPLANE_SLED_SHAPES="8:32")
    silo, proj, name, v = await running(client, vcpus=6)
    await client.instance_create(silo, proj, "other", vcpus=6, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "other")
    other = await wait_state(client, silo, proj, "other", "running")
    assert other["sled_id"] != v["sled_id"]  # least loaded first: one on each sled
    before = await reserved(client)

    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, name)
    assert e.value.code == "refused"
    assert "no other active sled that answers has room for 6 vCPUs and 1 GiB of RAM" in e.value.message
    with pytest.raises(CommandError) as e:
        await client.instance_migrate(silo, proj, name, to_sled=other["sled_id"])
    assert f"sled {other['sled_id']} is not active, does not answer, or has no room" in e.value.message
    stayed = await client.instance("show", silo, proj, name)
    assert stayed["state"] == "running" and stayed["active_vmm_id"] == v["active_vmm_id"]
    assert stayed["last_error"].startswith("migration failed: ")
    assert await reserved(client) == before
    await assert_invariants(db)


# --- a sled lost in the middle of a move (private racks: they reboot sleds) --------------------------------

SLOW_MOVE = {"RACKPLANE_SLEDS": "3", "RACKPLANE_MIGRATE_DELAY": "4"}
"""The source hands over 4 s after it is asked: time enough to reboot a sled in the middle."""


async def begin_slow_move(client: Client) -> tuple[str, str, str, dict[str, Any], dict[str, Any]]:
    silo, proj, name, before = await running(client, auto_restart=AutoRestart.best_effort)
    moving = await client.instance_migrate(silo, proj, name)
    assert moving["state"] == "migrating"
    return silo, proj, name, before, moving["migration"]


async def test_a_target_sled_that_reboots_mid_move_leaves_the_instance_where_it_was(rack: MakeRack) -> None:
    _, client, db = await rack(**SLOW_MOVE)
    silo, proj, name, before, m = await begin_slow_move(client)
    await client.sim_sled("reboot", m["target_sled_id"])

    v = await settled(client, silo, proj, name)
    assert v["state"] == "running" and v["active_vmm_id"] == before["active_vmm_id"]
    assert v["sled_id"] == before["sled_id"]
    assert f"migration failed: sled {m['target_sled_id']} rebooted" in v["last_error"]
    await usage_is(client, {"vcpus": 2, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db, timeout=30)


async def test_a_source_sled_that_reboots_mid_move_fails_the_instance_and_policy_restarts_it(
    rack: MakeRack,
) -> None:
    _, client, db = await rack(**SLOW_MOVE)
    silo, proj, name, before, m = await begin_slow_move(client)
    await client.sim_sled("reboot", m["source_sled_id"])

    async def restarted() -> Any:
        v = await client.instance("show", silo, proj, name)
        fresh = v["active_vmm_id"] not in (None, before["active_vmm_id"], m["target_vmm_id"])
        return v if v["state"] == "running" and fresh else None

    v = await eventually(restarted, timeout=40)
    assert v["auto_restarts"] >= 1 and v["target_vmm_id"] is None
    await usage_is(client, {"vcpus": 2, "ram_bytes": GiB, "disk_bytes": GiB}, silo)
    await assert_invariants(db, timeout=30)
