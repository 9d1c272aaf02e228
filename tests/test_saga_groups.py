"""Group commit of saga steps (services/instance_manager/sagas/together.py): the local steps of sagas that
fall due together commit in one transaction, and a saga whose step fails in a group fails alone, as it
would have on its own, while the others of its group go on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.bus import CommandError
from shared.messages import Quota
from tests.conftest import GiB, Rack, assert_invariants, counter, private_rack, wait_state

SMALL, BIG = 40, 8


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    async with private_rack("groups", RACKPLANE_SLEDS="4", RACKPLANE_SLED_VCPUS="16") as made:
        yield made


async def test_a_saga_that_fails_in_a_group_fails_alone_and_the_group_goes_on(rack: Rack) -> None:
    """Starts at once, some of instances no sled can hold (32 vCPUs, sleds of 16): their placement
    fails, in whatever group it fell, and only theirs; every other start of those groups runs."""
    _, client, db = rack
    await client.silo_create("g", Quota(vcpus=10**4, ram_bytes=10**14, disk_bytes=10**15))
    await client.project_create("g", "p")
    names = [f"s{i}" for i in range(SMALL)] + [f"b{i}" for i in range(BIG)]
    for name in names:
        vcpus = 32 if name.startswith("b") else 1
        await client.instance_create("g", "p", name, vcpus=vcpus, ram_bytes=GiB, disk_bytes=GiB)
    grouped = await counter(client, "instance-manager", "saga.steps_grouped")

    async def start(name: str) -> str | None:
        try:
            await client.instance("start", "g", "p", name)
        except CommandError as e:
            return e.message
        return None

    refused = dict(zip(names, await asyncio.gather(*(start(n) for n in names)), strict=True))
    assert {n for n, why in refused.items() if why} == {n for n in names if n.startswith("b")}
    for name in names:
        if name.startswith("b"):
            assert "no active sled that answers has" in str(refused[name])
            stopped = await wait_state(client, "g", "p", name, "stopped")
            assert "no active sled that answers has" in stopped["last_error"]
        else:
            await wait_state(client, "g", "p", name, "running")
    assert await counter(client, "instance-manager", "saga.steps_grouped") > grouped
    await assert_invariants(db)


async def test_the_remote_steps_of_sagas_done_together_are_recorded_in_one_statement(rack: Rack) -> None:
    """A remote step done (a charge's outcome in, a sled asked) is recorded in a group, with other
    sagas' steps: of many starts at once, some of their `charge` and `ensure_on_sled` records share
    a transaction (a row's xmin) with another saga's, and every start runs."""
    _, client, db = rack
    await client.silo_create("r", Quota(vcpus=10**4, ram_bytes=10**14, disk_bytes=10**15))
    await client.project_create("r", "p")
    names = [f"r{i}" for i in range(16)]  # room beside the first test's: 4 sleds of 16 vCPUs
    ids = [
        (await client.instance_create("r", "p", n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB))["id"]
        for n in names
    ]
    await asyncio.gather(*(client.instance("start", "r", "p", n) for n in names))
    recorded = await db.fetch(
        "SELECT e.saga_id, e.xmin::text AS tx FROM instance_manager.saga_events e"
        " JOIN instance_manager.sagas s ON s.id = e.saga_id"
        " WHERE s.kind = 'instance-start' AND s.params->>'instance_id' = ANY($1::text[])"
        " AND e.step IN ('charge', 'ensure_on_sled') AND e.event = 'done'",
        ids,
    )
    sagas_of: dict[str, set[object]] = {}
    for r in recorded:
        sagas_of.setdefault(r["tx"], set()).add(r["saga_id"])
    assert len({r["saga_id"] for r in recorded}) == len(names)
    assert any(len(sagas) > 1 for sagas in sagas_of.values()), "each remote step recorded on its own"
    for name in names:
        await wait_state(client, "r", "p", name, "running")
    await assert_invariants(db)
