"""Benchmark: what a round trip to PostgreSQL costs in CPU at both ends (the backend, and this process's
asyncpg), against the statement it carries: the price a control plane pays per statement it sends rather
than per row it writes. Measured over loopback TCP and over the cluster's Unix socket (what the
one-machine stack's services use), on one connection, one statement at a time:

    .venv/bin/pytest -m bench -s tests/bench/test_round_trip_bench.py

- `SELECT 1` (the baseline: a round trip and nothing else);
- one `UPDATE` by primary key, alone (autocommit);
- the same in a transaction (`BEGIN`, the update, `COMMIT`: three round trips, as asyncpg sends them);
- five updates in a transaction (seven round trips);
- the same five updates in one call of a PL/pgSQL function (one round trip).

Each line gives microseconds a call: wall, the backend's CPU, this process's CPU; the last column is
the CPU of both ends against `SELECT 1`'s over TCP, measured in the same run. BENCH_ROUND_TRIPS (5,000)
sets the calls per line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from tests.bench.processes import cpu_seconds
from tests.conftest import Rack, private_rack
from tests.test_db_roles import over_tcp

pytestmark = pytest.mark.bench

CALLS = int(os.environ.get("BENCH_ROUND_TRIPS", "5000"))
ROWS = 1000
FIVE = f"""
CREATE FUNCTION bench_five(i int) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    FOR k IN 0..4 LOOP
        UPDATE bench_rows SET v = v + 1 WHERE id = (i * 5 + k) % {ROWS} + 1;
    END LOOP;
END $$
"""


def _mine() -> float:
    t = os.times()
    return t.user + t.system


async def _measure(conn: asyncpg.Connection) -> dict[str, tuple[float, float, float]]:
    """Microseconds a call (wall, backend CPU, client CPU) of each shape, on `conn`."""
    backend = await conn.fetchval("SELECT pg_backend_pid()")
    one = await conn.prepare("SELECT 1")
    update = await conn.prepare("UPDATE bench_rows SET v = v + 1 WHERE id = $1")
    five = await conn.prepare("SELECT bench_five($1)")

    async def in_transaction(i: int) -> None:
        async with conn.transaction():
            await update.fetchval(i % ROWS + 1)

    async def five_in_transaction(i: int) -> None:
        async with conn.transaction():
            for k in range(5):
                await update.fetchval((i * 5 + k) % ROWS + 1)

    shapes: dict[str, Callable[[int], Awaitable[object]]] = {
        "SELECT 1": lambda i: one.fetchval(),
        "one UPDATE, autocommit": lambda i: update.fetchval(i % ROWS + 1),
        "BEGIN; one UPDATE; COMMIT": in_transaction,
        "BEGIN; five UPDATEs; COMMIT": five_in_transaction,
        "five UPDATEs in one function call": lambda i: five.fetchval(i),
    }
    out = {}
    for name, call in shapes.items():
        for i in range(CALLS // 10):  # warm: plans cached, pages in memory
            await call(i)
        pg0, me0, t0 = cpu_seconds(backend), _mine(), time.perf_counter()
        for i in range(CALLS):
            await call(i)
        wall = time.perf_counter() - t0
        out[name] = (wall, cpu_seconds(backend) - pg0, _mine() - me0)
    return {k: tuple(v / CALLS * 1e6 for v in vs) for k, vs in out.items()}  # type: ignore[misc]


@pytest.fixture
async def rack() -> Rack:
    async with private_rack("roundtrip", RACKPLANE_SLEDS="1") as made:
        yield made


async def test_a_round_trip_costs_more_than_the_statement_it_carries(rack: Rack) -> None:
    stack, _, _ = rack
    assert stack.admin_database_url is not None and stack.postgres is not None
    for svc in stack.services.values():  # the machine to this bench alone
        if svc.proc:
            svc.proc.terminate()
    setup = await asyncpg.connect(stack.admin_database_url)
    await setup.execute("CREATE TABLE bench_rows (id int PRIMARY KEY, v bigint NOT NULL)")
    await setup.execute(f"INSERT INTO bench_rows SELECT g, 0 FROM generate_series(1, {ROWS}) g")
    await setup.execute(FIVE)
    await setup.close()
    if stack.postgres.socket_dir is None:
        pytest.skip(f"{stack.postgres.dir}: no Unix socket there (too long a path, or not plain enough)")
    results = {}
    for how, url in (
        ("TCP", over_tcp(stack, stack.admin_database_url)),
        ("Unix socket", stack.admin_database_url),
    ):
        conn = await asyncpg.connect(url)
        try:
            results[how] = await _measure(conn)
        finally:
            await conn.close()
    base = sum(results["TCP"]["SELECT 1"][1:])
    print(f"\nRESULT {CALLS} calls each, one connection; microseconds a call: wall, PostgreSQL, client")
    for how, shapes in results.items():
        for name, (wall, pg, me) in shapes.items():
            print(f"  {how:<12} {name:<36} {wall:6.0f} {pg:6.0f} {me:6.0f}   {(pg + me) / base:4.1f}x")
    tcp, unix = results["TCP"], results["Unix socket"]
    five_sent = sum(tcp["BEGIN; five UPDATEs; COMMIT"][1:])
    five_called = sum(tcp["five UPDATEs in one function call"][1:])
    print(
        f"  five statements sent one by one in a transaction / in one function call: "
        f"{five_sent / five_called:.1f}x the CPU\n"
        f"  Unix socket / TCP, SELECT 1: {sum(unix['SELECT 1'][1:]) / base:.2f} of the CPU"
    )
    assert five_called < five_sent
