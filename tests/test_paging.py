"""Lists page: every list command takes a limit and a cursor, in a stable order, and rackctl pages through
them, streaming its table; no reply comes near the broker's max payload, and one that cannot be sent is
answered with an error at once."""

from __future__ import annotations

import asyncpg
import pytest

from rackctl.client import Client
from shared import bus
from shared.messages import InstanceList, SledList
from tests.conftest import eventually, private_rack, sleds_known, unique
from tests.test_cli import assert_ok, rackctl

COUNT = 20_000


async def test_rackctl_lists_twenty_thousand_instances_complete_and_in_order() -> None:
    async with private_rack("paging", RACKPLANE_SLEDS="1") as (stack, client, _db):
        silo = unique("silo")
        await client.silo_create(silo)
        project = await client.project_create(silo, "p")
        names = [f"vm-{i:05d}" for i in range(COUNT)]
        assert stack.admin_database_url is not None
        conn = await asyncpg.connect(stack.admin_database_url)  # written directly: 20,000 sagas take minutes
        try:
            await conn.execute(
                """
                INSERT INTO instance_manager.instances
                    (id, project_id, name, vcpus, ram_bytes, disk_bytes, auto_restart, state, intended_state)
                SELECT gen_random_uuid(), $1::uuid, n, 1, 2 ^ 30, 2 ^ 30, 'never', 'stopped', 'stopped'
                FROM unnest($2::text[]) AS n
                """,
                project["id"],
                names,
            )
        finally:
            await conn.close()

        r = await rackctl(stack, "instance", "list", "--silo", silo, "--timeout", "60")
        assert_ok(r)
        lines = r.out.splitlines()
        assert lines[0].split()[:2] == ["INSTANCE", "STATE"]
        assert [line.split()[0] for line in lines[1:]] == [f"{silo}/p/{n}" for n in names]

        r = await rackctl(stack, "instance", "list", "--silo", silo, "--json", "--timeout", "60")
        assert_ok(r)
        assert [v["name"] for v in r.json()] == names

        page = await client.send(InstanceList(silo=silo, limit=500))
        assert len(page["items"]) == 500 and page["next"] == f"{silo}/p/{names[499]}"
        rest = await client.send(InstanceList(silo=silo, limit=500, after=page["next"]))
        assert rest["items"][0]["name"] == names[500]


async def test_a_list_takes_a_limit_and_refuses_a_foreign_cursor(client: Client) -> None:
    await eventually(lambda: sleds_known(client, 8))
    first = await client.send(SledList(limit=3))
    assert len(first["items"]) == 3 and first["next"] == first["items"][-1]["id"]
    with pytest.raises(bus.CommandError) as e:
        await client.send(InstanceList(after="not-a-cursor"))
    assert e.value.code == "invalid" and "not a cursor of this list" in e.value.message
    with pytest.raises(bus.CommandError) as e:
        await client.send(InstanceList.model_construct(silo=None, project=None, limit=10_000, after=None))
    assert e.value.code == "invalid" and "limit" in e.value.message
