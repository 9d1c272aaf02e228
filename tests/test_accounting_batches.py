"""Accounting applies deltas in batches (issue 12, acceptance 1 and 2).

- Property: any stream of deltas (repeats, stale generations, reordering, quota edges, several silos),
  cut into batches of any sizes, gives exactly the outcomes and totals of applying its deltas one by one,
  and those of a plain model of the rules.
- Two replicas on the partitioned stream, under duplicated and reordered delivery, one of them dying
  between a commit and its acks: the totals are those of clean delivery; nothing lost, nothing doubled.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.stack import Stack
from services.accounting.ledger import Charge, Decided, Ledger, apply_batch, events
from shared import bus
from shared.db import create_pool
from shared.messages import ProvisionDelta
from shared.topology import subjects
from tests.conftest import GiB, assert_invariants, connect_as, counter, eventually, private_rack, unique
from tests.test_accounting_fence import lifecycle_deltas, silo_ids

# --- the property --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """A stream in the abstract: silos (with quotas), instances (each in a project of a silo), deltas."""

    quotas: list[tuple[int | None, int | None, int | None]]
    instances: list[tuple[int, int]]
    """(silo, project within it) of each instance."""
    deltas: list[tuple[int, int, int, int, int]]
    """(instance, generation, vCPUs, RAM GiB, disk GiB)."""
    batches: list[int]
    """Sizes to cut the stream into (the rest is one batch)."""


@st.composite
def worlds(draw: Any) -> World:
    silos = draw(st.integers(1, 3))
    small = st.one_of(st.none(), st.integers(0, 12))
    quotas = [(draw(small), draw(small), draw(small)) for _ in range(silos)]
    instances = draw(
        st.lists(st.tuples(st.integers(0, silos - 1), st.integers(0, 1)), min_size=1, max_size=10)
    )
    delta = st.tuples(
        st.integers(0, len(instances) - 1),
        st.integers(1, 6),
        st.integers(0, 4),
        st.integers(0, 4),
        st.integers(0, 4),
    )
    deltas = draw(st.lists(delta, min_size=1, max_size=50))
    return World(quotas, instances, deltas, draw(st.lists(st.integers(1, 16), max_size=8)))


class Copy:
    """One concrete copy of a world in accounting's tables, under fresh ids and names."""

    def __init__(self, w: World) -> None:
        self.silos = [(uuid.uuid4(), unique("prop")) for _ in w.quotas]
        self.projects = {(s, p): (uuid.uuid4(), f"p{p}") for s in range(len(w.quotas)) for p in (0, 1)}
        self.instances = [uuid.uuid4() for _ in w.instances]
        self.world = w

    async def create(self, conn: asyncpg.Connection) -> None:
        for (sid, name), (v, r, k) in zip(self.silos, self.world.quotas, strict=True):
            await conn.execute(
                "INSERT INTO silos (id, name, quota_vcpus, quota_ram_bytes, quota_disk_bytes) "
                "VALUES ($1, $2, $3, $4, $5)",
                sid, name, v, None if r is None else r * GiB, None if k is None else k * GiB,
            )  # fmt: skip
        for (s, _), (pid, pname) in self.projects.items():
            await conn.execute(
                "INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, $3)", pid, self.silos[s][0], pname
            )

    def charges(self) -> list[Charge]:
        out = []
        for i, gen, v, r, k in self.world.deltas:
            s, p = self.world.instances[i]
            pid, pname = self.projects[(s, p)]
            sid, sname = self.silos[s]
            d = ProvisionDelta(
                instance_id=self.instances[i], project_id=pid, silo_id=sid, generation=gen,
                vcpus=v, ram_bytes=r * GiB, disk_bytes=k * GiB,
            )  # fmt: skip
            out.append(Charge(sname, pname, d))
        return out

    async def totals(self, conn: asyncpg.Connection) -> dict[str, Any]:
        """Every total and charge, by the world's own indexes (so two copies compare)."""
        silo = {r["id"]: tuple(r)[1:] for r in await conn.fetch(
            "SELECT id, vcpus, ram_bytes, disk_bytes FROM silos WHERE id = ANY($1::uuid[])",
            [s for s, _ in self.silos],
        )}  # fmt: skip
        project = {r["id"]: tuple(r)[1:] for r in await conn.fetch(
            "SELECT id, vcpus, ram_bytes, disk_bytes FROM projects WHERE id = ANY($1::uuid[])",
            [p for p, _ in self.projects.values()],
        )}  # fmt: skip
        charge = {r["instance_id"]: tuple(r)[1:] for r in await conn.fetch(
            "SELECT instance_id, generation, vcpus, ram_bytes, disk_bytes, outcome, reason "
            "FROM instance_charges WHERE instance_id = ANY($1::uuid[])", self.instances,
        )}  # fmt: skip
        return {
            "silos": [silo[s] for s, _ in self.silos],
            "projects": {k: project[p] for k, (p, _) in self.projects.items()},
            "charges": [charge.get(i) for i in self.instances],
        }


def outcome_of(r: object) -> tuple[str, str, bool]:
    assert isinstance(r, Decided), r
    return (r.outcome.value, r.reason, r.repeat)


def model(w: World) -> tuple[list[str], list[tuple[int, int, int]]]:
    """The rules, plainly, one delta after another: each outcome, and each silo's final totals."""
    held: dict[int, tuple[int, tuple[int, int, int], str]] = {}
    totals = [[0, 0, 0] for _ in w.quotas]
    outcomes = []
    for i, gen, *amounts in w.deltas:
        s = w.instances[i][0]
        g, have, last = held.get(i, (0, (0, 0, 0), "applied"))
        if gen == g:
            outcomes.append(last)
            continue
        if gen < g:
            outcomes.append("stale")
            continue
        diff = [a - h for a, h in zip(amounts, have, strict=True)]
        over = any(
            x > 0 and q is not None and t + x > q
            for x, q, t in zip(diff, w.quotas[s], totals[s], strict=True)
        )
        if over:
            held[i] = (gen, have, "refused")
            outcomes.append("refused")
        else:
            held[i] = (gen, tuple(amounts), "applied")  # type: ignore[assignment]
            totals[s] = [t + x for t, x in zip(totals[s], diff, strict=True)]
            outcomes.append("applied")
    return outcomes, [(v, r * GiB, k * GiB) for v, r, k in totals]


async def batched_and_one_by_one(dsn: str, w: World) -> None:
    pool = await create_pool(dsn, "accounting", min_size=1, max_size=1)
    conn = await pool.acquire()
    try:
        batched, single = Copy(w), Copy(w)
        await batched.create(conn)
        await single.create(conn)

        charges, got = batched.charges(), []
        sizes = [*w.batches, len(charges)]
        while charges:
            size, sizes = sizes[0], sizes[1:]
            async with conn.transaction():
                got += await apply_batch(conn, charges[:size])
            charges = charges[size:]
        want = []
        for c in single.charges():
            async with conn.transaction():
                want += await apply_batch(conn, [c])

        assert [outcome_of(r) for r in got] == [outcome_of(r) for r in want]
        a, b = await batched.totals(conn), await single.totals(conn)
        assert a == b
        outcomes, silo_totals = model(w)
        assert [r.outcome.value for r in got] == outcomes  # type: ignore[union-attr]
        assert a["silos"] == silo_totals
    finally:
        await pool.release(conn)
        await pool.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=worlds())
def test_batches_give_the_outcomes_and_totals_of_one_by_one(stack: Stack, w: World) -> None:
    asyncio.run(batched_and_one_by_one(stack.service_database_urls["accounting"], w))


async def test_a_repeat_inside_the_duplicate_window_is_not_told_again(stack: Stack) -> None:
    """A repeat's outcome message would carry the first one's id: inside the broker's duplicate window the
    broker would drop it, so it is not queued at all; once the window may have passed, it is sent again."""
    w = World(quotas=[(None, None, None)], instances=[(0, 0)], deltas=[(0, 1, 1, 1, 1)], batches=[])
    pool = await create_pool(stack.service_database_urls["accounting"], "accounting", min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            copy = Copy(w)
            await copy.create(conn)
            (c,) = copy.charges()
            async with conn.transaction():
                first, again = await apply_batch(conn, [c, c])  # a repeat inside its own batch
            async with conn.transaction():
                (later,) = await apply_batch(conn, [c])  # a repeat inside the window
            await conn.execute(
                "UPDATE instance_charges SET updated_at = now() - interval '1 day' WHERE instance_id = $1",
                copy.instances[0],
            )
            async with conn.transaction():
                (late,) = await apply_batch(conn, [c])  # a repeat once the window may have passed
        results = [first, again, later, late]
        assert all(isinstance(r, Decided) for r in results)
        assert [(r.repeat, r.told) for r in results] == [  # type: ignore[union-attr]
            (False, False),
            (True, True),
            (True, True),
            (True, False),
        ]
        ledger = Ledger({}, {})
        outcomes = [e for e in events([c] * 4, list(results), [], ledger) if "outcome" in e[0]]
        assert len(outcomes) == 2  # the first and the late one
    finally:
        await pool.close()


# --- replicas ---------------------------------------------------------------------------------------------


def expected(deltas: list[ProvisionDelta]) -> dict[str, int]:
    """With no quota, each instance ends charged as its newest generation says."""
    newest: dict[uuid.UUID, ProvisionDelta] = {}
    for d in deltas:
        if d.instance_id not in newest or d.generation > newest[d.instance_id].generation:
            newest[d.instance_id] = d
    return {a: sum(getattr(d, a) for d in newest.values()) for a in ("vcpus", "ram_bytes", "disk_bytes")}


async def test_two_replicas_under_duplicates_and_a_crash_give_the_totals_of_clean_delivery() -> None:
    async with private_rack("replicas", RACKPLANE_ACK_WAIT="2") as (stack, client, db):
        stack.env["RACKPLANE_CRASH_AT"] = "after-commit:accounting-deltas-*"  # dies after its first commit
        stack.start_service("accounting", replica="accounting-2")
        stack.env.pop("RACKPLANE_CRASH_AT")
        stack.wait_ready(("accounting",))

        rng = random.Random(12)
        clean_silo, clean_proj, clean_sid, clean_pid = await silo_ids(client, db)
        rough_silo, rough_proj, rough_sid, rough_pid = await silo_ids(client, db)
        clean: list[ProvisionDelta] = []
        rough: list[ProvisionDelta] = []
        for _ in range(300):
            seed = rng.random()
            clean += lifecycle_deltas(uuid.uuid4(), clean_pid, clean_sid, random.Random(seed))
            rough += lifecycle_deltas(uuid.uuid4(), rough_pid, rough_sid, random.Random(seed))
        shuffled = rough + rng.sample(rough, len(rough) // 2)  # half again, under other message ids
        rng.shuffle(shuffled)

        im = await connect_as(stack, "instance-manager")  # the only identity that may send deltas
        try:
            ims = im.jetstream()
            for d in shuffled:
                await bus.publish(
                    ims, subjects.provision_delta(rough_silo, rough_proj, d.instance_id), d, source="t"
                )
            for d in clean:
                await bus.publish(
                    ims, subjects.provision_delta(clean_silo, clean_proj, d.instance_id), d, source="t"
                )
        finally:
            await im.close()

        async def crashed() -> bool:
            return stack.services["accounting-2"].proc.poll() is not None

        await eventually(crashed, timeout=20)  # it committed a batch and died before acking it
        want = expected(clean)
        assert want == expected(rough)

        async def both_done() -> bool:
            return (await client.usage(clean_silo))["usage"] == want and (await client.usage(rough_silo))[
                "usage"
            ] == want

        await eventually(both_done, timeout=60)
        await asyncio.sleep(1)
        assert (await client.usage(rough_silo))["usage"] == want
        assert await counter(client, "accounting", "deltas.duplicate") > 0
        await assert_invariants(db, at_rest=False)
