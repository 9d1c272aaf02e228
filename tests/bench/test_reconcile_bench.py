"""Benchmark: one reconcile pass over a rack of 5,000 sleds and 150,000 running instances, at steady state
(nothing to repair: every VMM where it should be, every boot as expected), beside a baseline measured in
the same run: reading every one of those instance rows once.

The rack is written straight into recovery's tables (its picture of the rack, as events and inventories
would have built it): starting 150,000 instances would measure the start path, not the pass.

    make bench        (or: .venv/bin/pytest -m bench -s tests/bench/test_reconcile_bench.py)
Environment: BENCH_SLEDS (5000), BENCH_INSTANCES (150000), BENCH_RUNS (3).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

import asyncpg
import pytest

from services.recovery.reconcile import Reconciler
from shared import db as shared_db
from tests.bench import UNLIMITED
from tests.conftest import private_rack

pytestmark = pytest.mark.bench

SLEDS = int(os.environ.get("BENCH_SLEDS", "5000"))
INSTANCES = int(os.environ.get("BENCH_INSTANCES", "150000"))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))


async def write_rack(conn: asyncpg.Connection) -> None:
    per_sled = -(-INSTANCES // SLEDS)
    instances, sleds = [], []
    for s in range(SLEDS):
        sled_id, vmms = f"bench-{s}", []
        for _ in range(per_sled):
            if len(instances) == INSTANCES:
                break
            iid, vid = uuid.uuid4(), uuid.uuid4()
            instances.append((iid, vid, sled_id))
            vmms.append({"vmm_id": str(vid), "instance_id": str(iid), "state": "running", "generation": 3})
        sleds.append((sled_id, uuid.uuid4(), json.dumps(vmms)))
    await conn.execute(
        """
        INSERT INTO recovery.sleds (id, boot_id, boot_number, inventory_seq, vmms, state)
        SELECT id, boot, 1, 1, vmms::jsonb, 'active'
        FROM unnest($1::text[], $2::uuid[], $3::text[]) AS t (id, boot, vmms)
        """,
        [s[0] for s in sleds],
        [s[1] for s in sleds],
        [s[2] for s in sleds],
    )
    await conn.execute(
        """
        INSERT INTO recovery.instances (id, silo, project, name, state, generation, auto_restart,
                                        intended_state, active_vmm_id, sled_id, vmm_boot_number)
        SELECT id, 'bench', 'p', 'vm-' || n, 'running', 5, 'best_effort', 'running', vmm, sled, 1
        FROM unnest($1::uuid[], $2::uuid[], $3::text[]) WITH ORDINALITY AS t (id, vmm, sled, n)
        """,
        [i[0] for i in instances],
        [i[1] for i in instances],
        [i[2] for i in instances],
    )
    await conn.execute("ANALYZE recovery.instances; ANALYZE recovery.sleds")


async def test_a_reconcile_pass_over_a_rack_at_scale() -> None:
    async with private_rack(
        "reconcile", RACKPLANE_SLEDS="1", RACKPLANE_RECONCILE_INTERVAL="3600", **UNLIMITED
    ) as (
        stack,
        client,
        _db,
    ):
        url = stack.service_database_urls.get("recovery", stack.database_url)
        assert url is not None and stack.admin_database_url is not None
        started = time.monotonic()
        admin = await asyncpg.connect(stack.admin_database_url)  # ANALYZE is the tables' owner's
        try:
            await write_rack(admin)
        finally:
            await admin.close()
        pool = await shared_db.create_pool(url, "recovery", max_size=4)
        print(
            f"\nreconcile bench: wrote {SLEDS} sleds and {INSTANCES} instances "
            f"in {time.monotonic() - started:.1f}s"
        )
        reconciler = Reconciler(pool, client.nc, url)
        passes, baselines = [], []
        try:
            for _ in range(RUNS):
                t = time.monotonic()
                async with pool.acquire() as conn:
                    await conn.fetch("SELECT * FROM instances")
                baselines.append(time.monotonic() - t)
                t = time.monotonic()
                done = {
                    **(await reconciler.run_pass("runs_where", reconciler.runs_where) or {}),
                    **(await reconciler.run_pass("bring_back", reconciler.bring_back) or {}),
                }
                passes.append(time.monotonic() - t)
                assert not any(done[k] for k in ("lost", "stuck", "zombies", "restart")), done
        finally:
            await pool.close()
        p, b = statistics.median(passes), statistics.median(baselines)
        print(
            f"reconcile bench: {SLEDS} sleds, {INSTANCES} instances, {RUNS} runs: pass p50 {p:.2f}s "
            f"(max {max(passes):.2f}s); baseline (read every instance row once) p50 {b:.2f}s; "
            f"ratio {p / b:.1f}x"
        )
        assert p <= 5.0, f"a steady-state pass took {p:.2f}s (target: 5 s)"
