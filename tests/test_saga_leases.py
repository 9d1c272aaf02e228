"""A saga runs in one process at a time, under a lease kept in its row (services/instance_manager/sagas/),
not under a lock that a connection holds: instance-manager replicas whose database connections are all
killed mid-saga keep their sagas, none is run by two processes at once, and all finish. A process whose
lease was taken commits nothing more of that saga. The checker's no_saga_run_twice sees a saga that two
processes ran."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.invariants import no_saga_run_twice
from services.instance_manager.sagas import Context, Executor, Output, Saga, Step
from services.instance_manager.sagas.definition import LeaseLost, Status
from services.instance_manager.sagas.progress import SQL
from shared.bus import CommandError
from shared.db import create_pool
from shared.messages import DelayFault, ServiceFaults
from tests.conftest import GiB, assert_invariants, eventually, private_rack, unique, wait_state
from tests.test_observability import fetch

# --- the fence, on sagas of a scratch schema (the stack's instance-manager never sees them) ---------------


@dataclass
class App:
    saga_pool: asyncpg.Pool


@pytest.fixture
async def scratch(stack: Stack) -> AsyncIterator[asyncpg.Pool]:
    """A pool on a schema of its own holding empty `sagas` and `saga_events` tables like
    instance-manager's, dropped afterwards."""
    schema = unique("leases").replace("-", "_")
    admin = await asyncpg.connect(stack.admin_database_url)
    try:
        await admin.execute(
            f"""
            CREATE SCHEMA {schema};
            CREATE TABLE {schema}.sagas (LIKE instance_manager.sagas INCLUDING ALL);
            CREATE TABLE {schema}.saga_events (LIKE instance_manager.saga_events INCLUDING ALL);
            """
        )
        pool = await create_pool(stack.admin_database_url, schema, max_size=4)
        try:
            yield pool
        finally:
            await pool.close()
    finally:
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


async def test_a_process_whose_lease_was_taken_commits_no_step_of_that_saga(
    scratch: asyncpg.Pool,
) -> None:
    gate, ran = asyncio.Event(), []

    async def first(ctx: Context) -> None:
        return None

    class By(Output):
        by: str

    async def second(ctx: Context) -> By:
        if not ran:
            ran.append("a")
            await gate.wait()  # process a stalls here, past its lease
        else:
            ran.append("b")
        return By(by=ran[-1])

    async def third(ctx: Context) -> None:
        return None

    # The second step is remote: it holds no transaction (nor the saga row) while a stalls in it.
    steps = [Step("first", first), Step("second", second, local=False), Step("third", third)]
    kind = Saga("lease-test", steps)
    a, b = Executor(App(scratch), ""), Executor(App(scratch), "")
    a.register(kind)
    b.register(kind)
    async with scratch.acquire() as conn, conn.transaction():
        saga_id = await a.begin(conn, kind, {})
    running_a = a.launch(saga_id, waited_for=True)
    try:
        await eventually(lambda: asyncio.sleep(0, ran), timeout=5)

        assert await b.launch(saga_id, waited_for=True) == "busy"  # a holds the lease
        await scratch.execute(
            "UPDATE sagas SET lease_until = now() - interval '1 second' WHERE id = $1", saga_id
        )
        assert await b.launch(saga_id, waited_for=True) == "done"  # expired: b takes it, runs the rest
        gate.set()
        assert await running_a == "lost"  # a's step of the same saga is not committed: a stops
    finally:
        gate.set()
        running_a.cancel()

    events = await scratch.fetch(
        "SELECT step, owner FROM saga_events WHERE saga_id = $1 ORDER BY seq", saga_id
    )
    assert [(e["step"], e["owner"]) for e in events] == [
        ("first", a.owner),
        ("second", b.owner),
        ("third", b.owner),
    ]
    saga = await scratch.fetchrow("SELECT status, data, lease_owner FROM sagas WHERE id = $1", saga_id)
    assert (saga["status"], saga["data"], saga["lease_owner"]) == ("done", {"by": "b"}, b.owner)


async def test_remote_steps_recorded_together_stand_or_fail_each_on_its_own(scratch: asyncpg.Pool) -> None:
    """The records of remote steps done at once go in one statement (sagas/together.py), and each one's
    outcome is its own: one whose saga moved on meanwhile is told so, one whose lease another process
    took is told that, and the third stands, recorded once."""

    async def step(ctx: Context) -> None:
        return None

    kind = Saga("records-test", [Step("first", step), Step("second", step, local=False), Step("third", step)])
    a = Executor(App(scratch), "")
    a.register(kind)
    async with scratch.acquire() as conn, conn.transaction():
        ids = [await a.begin(conn, kind, {}) for _ in range(3)]
    rows = [await scratch.fetchrow(SQL["load"], saga_id) for saga_id in ids]
    await scratch.execute("UPDATE sagas SET cursor = cursor + 1 WHERE id = $1", ids[1])
    await scratch.execute("UPDATE sagas SET lease_owner = 'another' WHERE id = $1", ids[2])
    moves = [(row, ["second"], dict(row["data"]), Status.running, 1) for row in rows]
    done = await asyncio.gather(*(a._together.record(kind, m) for m in moves), return_exceptions=True)
    assert not isinstance(done[0], BaseException) and done[0]["cursor"] == 2, done
    assert isinstance(done[1], RuntimeError) and "moved under us" in str(done[1]), done
    assert isinstance(done[2], LeaseLost), done
    recorded = await scratch.fetch("SELECT saga_id FROM saga_events WHERE step = 'second'")
    assert [r["saga_id"] for r in recorded] == [ids[0]]


async def test_leases_are_renewed_while_their_process_runs_and_released_when_it_stops(
    scratch: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.instance_manager.sagas import engine

    monkeypatch.setattr(engine, "RENEW", 0.05)

    async def first(ctx: Context) -> None:
        return None

    kind = Saga("lease-test", [Step("first", first), Step("second", first)])
    a = Executor(App(scratch), "")
    async with scratch.acquire() as conn, conn.transaction():
        saga_id = await a.begin(conn, kind, {})  # not launched: its lease is a's all the same
    await scratch.execute("UPDATE sagas SET lease_until = now() + interval '1 second' WHERE id = $1", saga_id)
    renewing = asyncio.create_task(a.renew_forever())
    try:
        await eventually(
            lambda: scratch.fetchval(
                "SELECT lease_until > now() + interval '5 seconds' FROM sagas WHERE id = $1", saga_id
            ),
            timeout=5,
        )
    finally:
        renewing.cancel()
    await a.release()
    assert await scratch.fetchval("SELECT lease_owner FROM sagas WHERE id = $1", saga_id) is None


# --- the checker --------------------------------------------------------------------------------------------


async def test_the_checker_reports_a_saga_two_processes_ran_at_once(stack: Stack) -> None:
    """Built in a transaction that is rolled back: the shared stack's checks never see it."""
    conn = await asyncpg.connect(stack.admin_database_url)
    try:
        async with conn.transaction():
            interleaved, twice, handed_over = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
            for saga_id in (interleaved, twice, handed_over):
                await conn.execute(
                    "INSERT INTO instance_manager.sagas (id, kind, params, status, cursor) "
                    "VALUES ($1, 'instance-start', '{}', 'done', 5)",
                    saga_id,
                )
            events = [
                (interleaved, "interlock", "done", "a"),
                (interleaved, "charge", "done", "b"),
                (interleaved, "place", "done", "a"),
                (twice, "interlock", "done", "a"),
                (twice, "charge", "done", "a"),
                (twice, "charge", "done", "b"),
                (handed_over, "interlock", "done", "a"),  # a died; b resumed it: no violation
                (handed_over, "charge", "done", "b"),
                (handed_over, "place", "done", "b"),
            ]
            for saga_id, step, event, owner in events:
                await conn.execute(
                    "INSERT INTO instance_manager.saga_events (saga_id, step, event, owner) "
                    "VALUES ($1, $2, $3, $4)",
                    saga_id,
                    step,
                    event,
                    owner,
                )
            found = await no_saga_run_twice(conn)
            raise _Rollback
    except _Rollback:
        pass
    finally:
        await conn.close()
    assert sorted(found) == sorted(
        [
            f"saga instance-start {interleaved} was run by two processes at once: a ran place (done) after "
            "b had taken over from it",
            f"saga instance-start {twice} was run by two processes at once: charge (done) recorded by "
            "a and b",
        ]
    )


class _Rollback(Exception):
    pass


# --- end to end: two replicas lose every database connection mid-saga ---------------------------------------

REPLICAS = ("instance_manager", "instance-manager-2")
STARTS = 12


async def kill_backends(stack: Stack) -> int:
    """Terminate every database session of instance-manager's login (both replicas): its pools, its
    listener, and (before leases) the connection that held every saga's advisory lock."""
    admin = await asyncpg.connect(stack.admin_database_url)
    try:
        return len(
            await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE usename = 'instance_manager' AND pid <> pg_backend_pid()"
            )
        )
    finally:
        await admin.close()


async def test_sagas_keep_their_process_when_the_database_connections_are_killed() -> None:
    async with private_rack("leases", RACKPLANE_SLEDS="4", RACKPLANE_SAGA_RESUME_INTERVAL="0.3") as (
        stack,
        client,
        db,
    ):
        stack.start_service("instance_manager", replica="instance-manager-2")

        async def second_ready() -> bool:
            try:
                status, _ = await fetch(stack, "instance-manager-2", "/readyz")
            except OSError:
                return False
            return status == 200

        await eventually(second_ready, timeout=30)
        silo, proj = unique("silo"), unique("proj")
        await client.silo_create(silo)
        await client.project_create(silo, proj)
        names = [f"vm-{i}" for i in range(STARTS)]
        for name in names:
            await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        # Charges are answered 2 s late: every start saga waits in its charge step when the connections go.
        await client.faults("accounting", ServiceFaults(delay=DelayFault(min_seconds=2, max_seconds=2)))

        async def start(name: str) -> None:
            try:
                await client.instance("start", silo, proj, name)
            except CommandError:  # its replica lost its connections while it answered: the saga goes on
                pass

        starts = [asyncio.create_task(start(name)) for name in names]
        await asyncio.sleep(0.8)
        for _ in range(3):  # several times, while the sagas wait and as they go on
            assert await kill_backends(stack) > 0
            await asyncio.sleep(0.7)
        await asyncio.gather(*starts)
        await client.clear_faults()
        for name in names:
            await wait_state(client, silo, proj, name, "running", timeout=30)

        for key in REPLICAS:  # a saga moves under a process only if another one runs it too
            assert "moved under us" not in (stack.dir / f"{key}.log").read_text(), stack.logs(key)
        async with db.acquire() as conn:
            assert await no_saga_run_twice(conn) == []
            owners = await conn.fetch(
                "SELECT saga_id, count(DISTINCT owner) AS n, count(*) FILTER (WHERE owner IS NULL) AS none "
                "FROM instance_manager.saga_events GROUP BY saga_id"
            )
        assert owners and all((r["n"], r["none"]) == (1, 0) for r in owners), owners  # nobody took over
        await assert_invariants(db)
