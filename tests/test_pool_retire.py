"""The pool keeper (issue 28, findings 3 and 7): a member retired while stopped but meant to run (what a
refused start leaves) is never left running and charged; a member meant to be stopped that runs is
stopped by a later pass, however it came to run; and refused creates back off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from deploy.stack import Stack
from shared.messages import Quota
from tests.conftest import GiB, assert_invariants, eventually, private_rack, unique, usage_is, wait_state

MEMBERS = """
SELECT i.id, i.state, i.intended_state, i.last_error, i.generation FROM instance_manager.instances i
JOIN instance_manager.pools p ON p.id = i.pool_id
WHERE p.name = $1 AND i.has_customer_data_at IS NULL AND i.state <> 'destroyed'
"""
DESTROYED = """
SELECT count(*) FROM instance_manager.instances i JOIN instance_manager.pools p ON p.id = i.pool_id
WHERE p.name = $1 AND i.state = 'destroyed'
"""


@asynccontextmanager
async def keeper_held(stack: Stack) -> AsyncIterator[None]:
    """No keeper pass runs meanwhile: the test holds the keeper's pass lock (shared/db/locks.py PassLock)."""
    assert stack.admin_database_url is not None
    conn = await asyncpg.connect(stack.admin_database_url)
    try:
        await conn.execute("SELECT pg_advisory_lock(hashtext('pool-keeper'))")
        yield
    finally:
        await conn.close()  # the lock goes with the connection


async def test_a_pool_deleted_while_a_refused_member_waits_leaves_nothing_running() -> None:
    """The trigger of finding 3: the keeper's pass finds a member stopped but meant to run (its start
    was refused: no vCPU quota), while the pool is deleted and the quota has room again. The member is
    retired and deleted, never left running and charged, counted by no pool."""
    async with private_rack("pool-retire", RACKPLANE_SLEDS="2") as (stack, client, db):
        silo, proj, pool = unique("silo"), unique("proj"), unique("warm")
        await client.silo_create(silo, Quota(vcpus=1))
        await client.project_create(silo, proj)
        await client.instance_create(silo, proj, "hog", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", silo, proj, "hog")
        await wait_state(client, silo, proj, "hog", "running")
        await client.pool_create(silo, proj, pool, size=1, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

        async def refused() -> Any:
            rows = await db.fetch(MEMBERS, pool)
            return rows if rows and all("quota" in (r["last_error"] or "") for r in rows) else None

        await eventually(refused, timeout=20)
        async with keeper_held(stack):

            async def at_rest() -> Any:
                rows = await db.fetch(MEMBERS, pool)
                return (
                    rows
                    if [(r["state"], r["intended_state"]) for r in rows] == [("stopped", "running")]
                    else None
                )

            await eventually(at_rest)
            await client.instance("stop", silo, proj, "hog")  # the quota has room again...
            await wait_state(client, silo, proj, "hog", "stopped")
            await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 2 * GiB}, silo, proj)
            await client.pool("delete", silo, proj, pool)  # ...as the pool goes

        async def gone() -> bool:
            return not await db.fetch(MEMBERS, pool)

        await eventually(gone, timeout=20)
        await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo, proj)  # the hog's disk
        await assert_invariants(db)


async def test_a_member_meant_to_be_stopped_that_runs_is_stopped_by_a_later_pass() -> None:
    """Level-triggered: an idle member whose intent became `stopped` while it was starting (what the
    keeper's retire left before) is stopped and deleted by the keeper's next passes."""
    async with private_rack("pool-level", RACKPLANE_SLEDS="2") as (stack, client, db):
        silo, proj, pool = unique("silo"), unique("proj"), unique("warm")
        await client.silo_create(silo)
        await client.project_create(silo, proj)
        await client.pool_create(silo, proj, pool, size=1, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

        async def running() -> Any:
            rows = await db.fetch(MEMBERS, pool)
            return rows if [r["state"] for r in rows] == ["running"] else None

        (member,) = await eventually(running, timeout=20)
        async with keeper_held(stack):
            await client.pool("resize", silo, proj, pool, size=0)
            assert stack.admin_database_url is not None
            admin = await asyncpg.connect(stack.admin_database_url)
            try:  # on purpose: the state the old retire of a starting member ended in
                await admin.execute(
                    "UPDATE instance_manager.instances SET intended_state = 'stopped' WHERE id = $1",
                    member["id"],
                )
            finally:
                await admin.close()

        async def gone() -> bool:
            return not await db.fetch(MEMBERS, pool)

        await eventually(gone, timeout=20)
        await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}, silo, proj)
        await assert_invariants(db)


async def test_a_pool_that_does_not_fit_its_quota_backs_off() -> None:
    """Finding 7: every create of this pool is refused (its disks do not fit the quota). The keeper backs
    off, doubling its wait: a handful of destroyed instances in eight seconds, not dozens."""
    async with private_rack("pool-backoff", RACKPLANE_SLEDS="2") as (_, client, db):
        silo, proj, pool = unique("silo"), unique("proj"), unique("warm")
        await client.silo_create(silo, Quota(disk_bytes=GiB))
        await client.project_create(silo, proj)
        await client.pool_create(silo, proj, pool, size=3, vcpus=1, ram_bytes=GiB, disk_bytes=2 * GiB)
        await asyncio.sleep(8)
        tries = await db.fetchval(DESTROYED, pool)
        # The first pass's three, then one try after 1 s, 2 s and 4 s more (old: three every pass).
        assert 4 <= tries <= 8, tries
        await client.pool("delete", silo, proj, pool)
        await assert_invariants(db)
