"""Benchmark: how fast accounting drains provisioning deltas, against the broker and against applying them
one per transaction, on the same broker and the same messages, in one run (the machine is noisy: the
ratios are what compare across machines).

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_accounting_bench.py)

The messages: BENCH_DELTA_INSTANCES (2,000) instances x 8 generations, 20% of them again under other
message ids (as a resend after the broker's duplicate window would come: the stack's window is one
second), shuffled in windows of 64, over 4 silos of 2 projects. Measured, each from its first message to
its last:
  (a) a bare pull consumer: fetch 256, ack each, nothing else;
  (b) accounting end to end, one replica: the fence, the totals, an outcome per delta in the outbox (and
      its relay publishing them, until the outbox is empty), acked after commit; (a) and (b) alternate
      BENCH_ROUNDS (5) times and the median of the rounds' ratios is the result, so that a slow second of
      the machine does not decide it;
      then (b) with two replicas (instance-manager, which reads the outcomes, is stopped meanwhile: its
      consumer is not what is measured);
  (c) the same work one delta per transaction: accounting's own ledger given batches of one (the fence,
      the totals, the history, the outcome in the outbox, its relay publishing it), over the first
      BENCH_NAIVE (4,000) messages;
  (c') for scale, a hand-written consumer doing less (lock, fence, totals, the raw message into a table;
      no outcome published, no history), one delta per transaction, over as many.
Beside (a) and (b), the CPU each process spent a message (/proc: this process, the "client", and
nats-server for (a); accounting, PostgreSQL and nats-server for (b), from its first delivery): on a
shared machine the wall-clock ratio moves with its load, and the CPU says what each side costs.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from rackctl.client import Client
from services.accounting.ledger import Charge, apply_batch
from shared.bus import MSG_ID
from shared.db import OutboxRelay, create_pool
from shared.messages import ProvisionDelta, Quota, decode, encode, envelope
from shared.topology import subjects
from tests.bench import UNLIMITED
from tests.bench.processes import cpu_seconds, processes
from tests.conftest import GiB, connect_as, eventually, private_rack, unique

pytestmark = pytest.mark.bench

INSTANCES = int(os.environ.get("BENCH_DELTA_INSTANCES", "2000"))
NAIVE = int(os.environ.get("BENCH_NAIVE", "4000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
GENERATIONS = 8


async def make_deltas(
    client: Client, db: asyncpg.Pool
) -> tuple[list[tuple[str, ProvisionDelta]], dict[str, Any]]:
    """The stream (subject, delta), and each silo's totals once it is applied."""
    places = []
    for _ in range(4):
        silo = unique("bench")
        s = await client.silo_create(silo, quota=Quota(vcpus=10**9, ram_bytes=10**15, disk_bytes=10**16))
        for p in ("a", "b"):
            proj = await client.project_create(silo, p)
            places.append((silo, p, uuid.UUID(s["id"]), uuid.UUID(proj["id"])))

    async def known() -> bool:
        return await db.fetchval("SELECT count(*) FROM accounting.projects") >= len(places)

    await eventually(known, timeout=20)
    rng = random.Random(12)
    out: list[tuple[str, ProvisionDelta]] = []
    want: dict[str, dict[str, int]] = {}
    for _ in range(INSTANCES):
        silo, proj, sid, pid = rng.choice(places)
        iid, vcpus, ram, disk = (
            uuid.uuid4(),
            rng.randint(1, 8),
            rng.randint(1, 16) * GiB,
            rng.randint(1, 50) * GiB,
        )
        for gen in range(1, GENERATIONS + 1):
            on = gen % 2 == 0
            d = ProvisionDelta(
                instance_id=iid, project_id=pid, silo_id=sid, generation=gen,
                vcpus=vcpus if on else 0, ram_bytes=ram if on else 0, disk_bytes=disk,
            )  # fmt: skip
            out.append((subjects.provision_delta(silo, proj, iid), d))
        t = want.setdefault(silo, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0})
        t["vcpus"] += vcpus
        t["ram_bytes"] += ram
        t["disk_bytes"] += disk
    out += rng.sample(out, len(out) // 5)
    windows = [out[i : i + 64] for i in range(0, len(out), 64)]
    for w in windows:
        rng.shuffle(w)
    return [m for w in windows for m in w], want


async def publish(js: Any, stream: list[tuple[str, ProvisionDelta]]) -> None:
    for i in range(0, len(stream), 1000):
        acks = [
            await js.publish_async(subject, encode(envelope(d, "bench")), headers={MSG_ID: str(uuid.uuid4())})
            for subject, d in stream[i : i + 1000]
        ]
        await asyncio.gather(*acks)


async def bare(js: Any, n: int, durable: str) -> float:
    """(a): fetch and ack, nothing else. Seconds from the first message to the last."""
    sub = await js.pull_subscribe("rp.acct.part.>", durable=durable, stream=subjects.PROVISION_STREAM)
    got, t0 = 0, None
    while got < n:
        msgs = await sub.fetch(256, timeout=5)
        t0 = t0 or time.perf_counter()
        for m in msgs:
            await m.ack()
        got += len(msgs)
    await sub.unsubscribe()
    await js.delete_consumer(subjects.PROVISION_STREAM, durable)
    return time.perf_counter() - (t0 or 0)


def cpu_now(stack: Any) -> dict[int, tuple[str, float]]:
    """Each process of the stack (and this one, "client"): its name and the CPU seconds it has used."""
    return {pid: (name, cpu_seconds(pid)) for name, pids in processes(stack).items() for pid in pids}


def cpu_per_message(stack: Any, before: dict[int, tuple[str, float]], n: int, names: tuple[str, ...]) -> str:
    """Microseconds of CPU a message, by process, since `before` (a process started since counts from 0)."""
    used: dict[str, float] = {}
    for pid, (name, now) in cpu_now(stack).items():
        used[name] = used.get(name, 0.0) + now - before.get(pid, (name, 0.0))[1]
    return ", ".join(f"{k} {used.get(k, 0.0) / n * 1e6:.0f}" for k in names) + " µs of CPU a message"


async def drained(js: Any, admin: asyncpg.Connection, first: Callable[[], None] | None = None) -> float:
    """(b): seconds from the first delivery to accounting's durables until they hold nothing unacked and
    its outbox is empty (every outcome published); `first` is called at the first delivery."""
    names = [subjects.delta_durable(p) for p in range(subjects.DELTA_PARTITIONS)]
    t0 = None
    while True:
        try:
            infos = [await js.consumer_info(subjects.PROVISION_STREAM, n) for n in names]
        except nats.js.errors.NotFoundError:  # accounting has not put its durables back yet
            await asyncio.sleep(0.02)
            continue
        if t0 is None and any(i.delivered.stream_seq for i in infos):
            t0 = time.perf_counter()
            if first is not None:
                first()
        if (
            t0 is not None
            and all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)
            and await admin.fetchval("SELECT count(*) FROM accounting.outbox") == 0
        ):
            return time.perf_counter() - t0
        await asyncio.sleep(0.02)


NAIVE_SCHEMA = """
DROP SCHEMA IF EXISTS bench_naive CASCADE;
CREATE SCHEMA bench_naive;
CREATE TABLE bench_naive.silos (id uuid PRIMARY KEY, quota bigint, vcpus bigint NOT NULL DEFAULT 0,
    ram_bytes bigint NOT NULL DEFAULT 0, disk_bytes bigint NOT NULL DEFAULT 0);
CREATE TABLE bench_naive.projects (id uuid PRIMARY KEY, vcpus bigint NOT NULL DEFAULT 0,
    ram_bytes bigint NOT NULL DEFAULT 0, disk_bytes bigint NOT NULL DEFAULT 0);
CREATE TABLE bench_naive.charges (instance_id uuid PRIMARY KEY, generation bigint NOT NULL DEFAULT 0,
    vcpus bigint NOT NULL DEFAULT 0, ram_bytes bigint NOT NULL DEFAULT 0,
    disk_bytes bigint NOT NULL DEFAULT 0,
    outcome text NOT NULL DEFAULT 'applied');
CREATE TABLE bench_naive.outbox (seq bigserial PRIMARY KEY, payload bytea NOT NULL);
INSERT INTO bench_naive.silos (id, quota) SELECT id, quota_vcpus FROM accounting.silos;
INSERT INTO bench_naive.projects (id) SELECT id FROM accounting.projects;
"""


async def one_at_a_time(
    js: Any, durable: str, n: int, apply: Callable[[Msg, ProvisionDelta], Awaitable[None]]
) -> float:
    """Fetch 256 at a time; `apply` each of the first `n` messages (in a transaction of its own), then ack
    it. Seconds from the first message to the last."""
    sub = await js.pull_subscribe("rp.acct.part.>", durable=durable, stream=subjects.PROVISION_STREAM)
    got, t0 = 0, None
    try:
        while got < n:
            msgs = await sub.fetch(min(256, n - got), timeout=5)
            t0 = t0 or time.perf_counter()
            for m in msgs:
                _, d = decode(m.data, ProvisionDelta)
                assert isinstance(d, ProvisionDelta)
                await apply(m, d)
                await m.ack()
            got += len(msgs)
        return time.perf_counter() - (t0 or 0)
    finally:
        await sub.unsubscribe()


async def one_by_one(js: Any, pool: asyncpg.Pool, nc: Any, n: int) -> float:
    """(c): accounting's ledger, one delta per transaction, its outcomes relayed as they commit."""
    relay = OutboxRelay(pool, nc, nc.jetstream())
    relaying = asyncio.create_task(relay.run())

    async def apply(m: Msg, d: ProvisionDelta) -> None:
        _, _, _, _, silo, project, _ = m.subject.split(".")
        async with pool.acquire() as conn, conn.transaction():
            await apply_batch(conn, [Charge(silo, project, d)])
        relay.kick()

    try:
        return await one_at_a_time(js, "bench-one", n, apply)
    finally:
        relaying.cancel()


async def naive(js: Any, admin: asyncpg.Connection, n: int) -> float:
    """(c'): less work, one delta per transaction, the way the rules read."""
    await admin.execute(NAIVE_SCHEMA)

    async def apply(m: Msg, d: ProvisionDelta) -> None:
        async with admin.transaction():
            await admin.execute(
                "INSERT INTO bench_naive.charges (instance_id) VALUES ($1) ON CONFLICT DO NOTHING",
                d.instance_id,
            )
            held = await admin.fetchrow(
                "SELECT * FROM bench_naive.charges WHERE instance_id = $1 FOR UPDATE", d.instance_id
            )
            outcome = "stale" if d.generation <= held["generation"] else "applied"
            if outcome == "applied":
                dv, dr, dd = (
                    d.vcpus - held["vcpus"],
                    d.ram_bytes - held["ram_bytes"],
                    d.disk_bytes - held["disk_bytes"],
                )
                ok = await admin.fetchval(
                    "UPDATE bench_naive.silos SET vcpus = vcpus + $2, ram_bytes = ram_bytes + $3, "
                    "disk_bytes = disk_bytes + $4 WHERE id = $1 AND ($2 <= 0 OR vcpus + $2 <= quota) "
                    "RETURNING 1",
                    d.silo_id, dv, dr, dd,
                )  # fmt: skip
                if ok:
                    await admin.execute(
                        "UPDATE bench_naive.projects SET vcpus = vcpus + $2, ram_bytes = ram_bytes + $3, "
                        "disk_bytes = disk_bytes + $4 WHERE id = $1",
                        d.project_id, dv, dr, dd,
                    )  # fmt: skip
                await admin.execute(
                    "UPDATE bench_naive.charges SET generation = $2, vcpus = $3, ram_bytes = $4, "
                    "disk_bytes = $5, "
                    "outcome = $6 WHERE instance_id = $1",
                    d.instance_id, d.generation, d.vcpus, d.ram_bytes, d.disk_bytes,
                    "applied" if ok else "refused",
                )  # fmt: skip
            await admin.execute("INSERT INTO bench_naive.outbox (payload) VALUES ($1)", m.data)

    return await one_at_a_time(js, "bench-naive", n, apply)


async def totals(client: Client, want: dict[str, Any]) -> bool:
    for silo, t in want.items():
        if (await client.usage(silo))["usage"] != t:
            return False
    return True


async def reset_accounting(stack: Any, js: Any, admin: asyncpg.Connection) -> None:
    """Stop accounting, forget what it applied and where its durables were: the same messages again."""
    for key in [k for k in stack.services if k.startswith("accounting")]:
        stack.services.pop(key).stop()
    for p in range(subjects.DELTA_PARTITIONS):
        await js.delete_consumer(subjects.PROVISION_STREAM, subjects.delta_durable(p))
    await admin.execute(
        "DELETE FROM accounting.instance_charges; DELETE FROM accounting.outbox; "
        "UPDATE accounting.silos SET vcpus = 0, ram_bytes = 0, disk_bytes = 0; "
        "UPDATE accounting.projects SET vcpus = 0, ram_bytes = 0, disk_bytes = 0;"
    )


async def test_accounting_drains_deltas_at_the_speed_of_the_broker() -> None:
    env = {
        "RACKPLANE_LOG": "WARNING",
        "RACKPLANE_TRACES": "none",
        "RACKPLANE_SLEDS": "1",
        # the copies stand for resends after the broker's duplicate window: with a window of a second,
        # they come after it, and accounting sends their outcomes again, as it would then
        "RACKPLANE_DUPLICATE_WINDOW": "1",
    }
    async with private_rack("acct-bench", timeout=60, **UNLIMITED, **env) as (stack, client, db):
        stream, want = await make_deltas(client, db)
        n = len(stream)
        admin = await asyncpg.connect(stack.admin_database_url)
        ledger_pool = await create_pool(stack.admin_database_url or "", "accounting", min_size=1, max_size=2)
        im = await connect_as(stack, "instance-manager")
        acct = await connect_as(stack, "accounting")
        tester = await connect_as(stack, "test")
        try:
            js = tester.jetstream()
            stack.services.pop("accounting").stop()  # the deltas wait in the stream, for everyone alike
            # instance-manager would take the 19,200 outcomes one transaction each, on the same two cores:
            # that is its own consumer's speed, not accounting's.
            stack.services.pop("instance_manager").stop()
            t = time.perf_counter()
            await publish(im.jetstream(), stream)
            print(f"\npublished {n} deltas in {time.perf_counter() - t:.1f}s")

            async def accounting(replicas: int) -> float:
                """(b): accounting's rate, from a clean state and durables, with `replicas` processes."""
                await reset_accounting(stack, js, admin)
                stack.start_service("accounting")
                if replicas == 2:
                    stack.start_service("accounting", replica="accounting-2")
                since: list[dict[int, tuple[str, float]]] = []
                b = await drained(js, admin, lambda: since.append(cpu_now(stack)))
                ours = ("accounting", "accounting-2")[:replicas]
                spent = cpu_per_message(stack, since[0], n, (*ours, "postgres", "nats-server"))
                await eventually(lambda: totals(client, want), timeout=30)
                counters = (await client.stats("accounting"))["counters"]
                batches = sum(v for k, v in counters.items() if k.endswith(".batches"))
                print(
                    f"(b) accounting, {replicas} replica(s): {n / b:8.0f} msg/s (totals exact; "
                    f"{n / max(batches, 1):.0f} deltas a batch in the replica answering)\n    {spent}"
                )
                return n / b

            rounds = []
            for r in range(ROUNDS):
                before = cpu_now(stack)
                a = n / await bare(js, n, f"bench-bare-{r}")
                spent = cpu_per_message(stack, before, n, ("client", "nats-server"))
                print(f"(a) bare fetch+ack:         {a:8.0f} msg/s\n    {spent}")
                rounds.append((a, await accounting(1)))
            a = statistics.median(x for x, _ in rounds)
            ratio = statistics.median(y / x for x, y in rounds)
            b2 = await accounting(2)

            await reset_accounting(stack, js, admin)
            first = min(NAIVE, n)
            c = first / await one_by_one(js, ledger_pool, acct, first)
            print(f"(c) ledger, one per transaction: {c:8.0f} msg/s ({first} messages)")
            c_lean = first / await naive(js, admin, first)
            print(f"(c') less work, one per transaction: {c_lean:8.0f} msg/s ({first} messages)")
            b = statistics.median(y for _, y in rounds)
            print(
                f"(b)/(a) = {ratio:.2f} (median of {ROUNDS} rounds: "
                + ", ".join(f"{y / x:.2f}" for x, y in rounds)
                + f")   (b)/(c) = {b / c:.1f}   (b)/(c') = {b / c_lean:.1f}"
            )
            print(f"two replicas: (b2)/(a) = {b2 / a:.2f}   (b2)/(b) = {b2 / b:.2f}")
            await admin.execute("DROP SCHEMA bench_naive CASCADE")
        finally:
            await tester.close()
            await acct.close()
            await im.close()
            await ledger_pool.close()
            await admin.close()
