"""One lock order, written down (docs/architecture.md, "One lock order") and followed: the three
deadlocks the code's comments said could not happen, each run against the real PostgreSQL through the
services' own functions and SQL, in transactions rolled back (the shared stack keeps nothing of them).

- accounting: two batches whose deltas are the first of the same instances, in opposite orders
  (ledger.lock_charges inserted the instances' rows in stream order);
- instance-manager: an expunge against a report that ends one of the sled's VMMs (the expunge locked the
  sled, then the VMMs; a report locks the VMMs, then the sled);
- instance-manager: giving back many sleds' room (sleds_unreserve, vmms_end) against an inventory batch,
  which locks its sleds in id order (an UPDATE ... FROM over a set locks in the order its plan meets the
  rows).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from deploy.migrations import migrations_dir
from deploy.stack import Stack
from rackctl.client import Client
from services.accounting.ledger import Charge, apply_batch
from services.instance_manager import lifecycle
from services.instance_manager.app import App
from services.instance_manager.base import Q
from shared.db import create_pool, migrate
from shared.messages import ProvisionDelta
from tests.conftest import GiB, unique


async def rolled_back(pool: asyncpg.Pool, work: object) -> None:
    """Run `work(conn)` in a transaction that is always rolled back."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            await work(conn)  # type: ignore[operator]
        finally:
            await tx.rollback()


# --- accounting ----------------------------------------------------------------------------------------

INSTANCES = 400
ROUNDS = 8


async def test_batches_charging_new_instances_in_opposite_orders_do_not_deadlock(stack: Stack) -> None:
    pool = await create_pool(stack.service_database_urls["accounting"], "accounting", min_size=2, max_size=2)
    try:
        silo_id, project_id, silo = uuid.uuid4(), uuid.uuid4(), unique("locks")
        await pool.execute(Q_ACCT_SILO, silo_id, silo)
        await pool.execute(
            "INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, 'p')", project_id, silo_id
        )
        for _ in range(ROUNDS):
            charges = [
                Charge(
                    silo,
                    "p",
                    ProvisionDelta(
                        instance_id=uuid.uuid4(),
                        project_id=project_id,
                        silo_id=silo_id,
                        generation=1,
                        vcpus=0,
                        ram_bytes=0,
                        disk_bytes=GiB,
                    ),
                )
                for _ in range(INSTANCES)
            ]

            async def apply(batch: list[Charge]) -> None:
                async def work(conn: asyncpg.Connection) -> None:
                    await apply_batch(conn, batch)

                await rolled_back(pool, work)

            await asyncio.gather(apply(charges), apply(charges[::-1]))  # DeadlockDetectedError, before
    finally:
        await pool.close()


Q_ACCT_SILO = "INSERT INTO silos (id, name) VALUES ($1, $2)"


# --- instance-manager, on a schema of its own ------------------------------------------------------------


@pytest.fixture
async def im(stack: Stack) -> AsyncIterator[asyncpg.Pool]:
    """instance-manager's schema, migrated afresh under another name: its sleds, VMMs and instances are
    this test's alone (the stack's instance-manager never sees them)."""
    schema = unique("lockorder").replace("-", "_")
    pool = await create_pool(stack.admin_database_url, schema, min_size=3, max_size=6)
    try:
        await migrate(pool, schema, migrations_dir("instance_manager"))
        yield pool
    finally:
        async with pool.acquire() as conn:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await pool.close()


async def a_running_instance(conn: asyncpg.Connection, sled: str) -> tuple[uuid.UUID, uuid.UUID]:
    """An instance running on a VMM on `sled` (which holds its room): (instance, VMM)."""
    silo, project, instance, vmm = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    await conn.execute("INSERT INTO silos (id, name) VALUES ($1, $2)", silo, unique("s"))
    await conn.execute("INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, 'p')", project, silo)
    await conn.execute(
        "INSERT INTO instances (id, project_id, name, vcpus, ram_bytes, disk_bytes, auto_restart, state, "
        "active_vmm_id, intended_state) VALUES ($1, $2, 'vm', 2, $3, $3, 'never', 'running', $4, 'running')",
        instance,
        project,
        2 * GiB,
        vmm,
    )
    await conn.execute(
        "UPDATE sleds SET reserved_vcpus = reserved_vcpus + 2, reserved_ram_bytes = reserved_ram_bytes + $2 "
        "WHERE id = $1",
        sled,
        2 * GiB,
    )
    await conn.execute(
        "INSERT INTO vmms (id, instance_id, sled_id, vcpus, ram_bytes, boot_number, state, generation) "
        "VALUES ($1, $2, $3, 2, $4, 1, 'running', 3)",
        vmm,
        instance,
        sled,
        2 * GiB,
    )
    return instance, vmm


async def add_sleds(conn: asyncpg.Connection, ids: list[str]) -> None:
    """Sleds, inserted in the order given (a table scan meets them in that order)."""
    for sled in ids:
        await conn.execute(
            "INSERT INTO sleds (id, vcpus, ram_bytes, boot_number, inventory_seq, last_seen_at) "
            "VALUES ($1, 64, $2, 1, 0, now())",
            sled,
            256 * GiB,
        )


async def test_an_expunge_and_a_report_ending_a_vmm_of_its_sled_do_not_deadlock(
    im: asyncpg.Pool, client: Client
) -> None:
    app = App(im, client.nc, client.nc.jetstream(), "", im)  # its outbox is rolled back: it sends nothing
    async with im.acquire() as conn:
        await add_sleds(conn, ["sled-x"])
        _, vmm = await a_running_instance(conn, "sled-x")

    for _ in range(3):
        await report_against_expunge(im, app, vmm)


async def report_against_expunge(im: asyncpg.Pool, app: App, vmm: uuid.UUID) -> None:
    """A report ending the VMM holds its record; an expunge of its sled begins; the report goes on to give
    back the sled's room. Both roll back."""
    locked_vmm, unreserve = asyncio.Event(), asyncio.Event()

    async def report(conn: asyncpg.Connection) -> None:
        # lifecycle.apply_vmm_reports' order: the VMM record (the fence), then its sled's room.
        reports = ([vmm], ["failed"], [4], [True], ["sled-x"], [1])
        assert len(await conn.fetch(Q["vmms_apply_reports"], *reports)) == 1
        locked_vmm.set()
        await unreserve.wait()
        await conn.execute(Q["sleds_unreserve"], ["sled-x"], [2], [2 * GiB])

    async def expunge(conn: asyncpg.Connection) -> None:
        await locked_vmm.wait()
        assert await lifecycle.expunge(app, conn, "sled-x") in (0, 1)

    reporting = asyncio.create_task(rolled_back(im, report))
    expunging = asyncio.create_task(rolled_back(im, expunge))
    await locked_vmm.wait()
    await asyncio.sleep(0.3)  # the expunge is under way, waiting for the report's VMM
    unreserve.set()
    await asyncio.gather(reporting, expunging)  # DeadlockDetectedError in one of them, before


SLEDS = 60


async def test_giving_back_many_sleds_room_and_an_inventory_batch_do_not_deadlock(im: asyncpg.Pool) -> None:
    sleds = [f"sled-{i:03d}" for i in range(SLEDS)]
    async with im.acquire() as conn:
        await add_sleds(conn, sleds[::-1])  # a scan meets them in the reverse of id order
        vmms = [(await a_running_instance(conn, s))[1] for s in sleds[::-1]]  # (updated in that order)

    async def inventories(conn: asyncpg.Connection) -> None:
        await conn.fetch(Q["sleds_lock"], sleds)  # sleds.apply_inventories: in id order

    async def unreserve(conn: asyncpg.Connection) -> None:
        await conn.execute(Q["sleds_unreserve"], sleds[::-1], [2] * SLEDS, [2 * GiB] * SLEDS)

    async def end(conn: asyncpg.Connection) -> None:
        assert len(await conn.fetch(Q["vmms_end"], vmms[::-1], "destroyed")) == SLEDS

    for _ in range(3):
        for other in (unreserve, end):
            await both_meet_in_the_middle(im, sleds[SLEDS // 2], inventories, other)


async def both_meet_in_the_middle(im: asyncpg.Pool, middle: str, first: object, second: object) -> None:
    """A third transaction holds the middle sled while `first` and then `second` begin, so that each has
    locked what it locks before the middle one when it is let go (the race, every time). Locking in id
    order, `second` holds nothing then; in any other order, the two hold what the other waits for."""
    held, go = asyncio.Event(), asyncio.Event()

    async def hold(conn: asyncpg.Connection) -> None:
        await conn.fetch("SELECT id FROM sleds WHERE id = $1 FOR UPDATE", middle)
        held.set()
        await go.wait()

    holding = asyncio.create_task(rolled_back(im, hold))
    await held.wait()
    one = asyncio.create_task(rolled_back(im, first))
    await asyncio.sleep(0.1)
    two = asyncio.create_task(rolled_back(im, second))
    await asyncio.sleep(0.2)
    go.set()
    await asyncio.gather(holding, one, two)  # DeadlockDetectedError in one of them, before
