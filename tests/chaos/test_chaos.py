"""Chaos runs: a short fixed-seed run in every `make test`, and the long soak behind `make chaos`
(SEED=, DURATION=). A failing run prints its seed and the log of operations that replays it."""

from __future__ import annotations

import os
import shutil
import time

import asyncpg
import pytest

from rackctl.client import Client
from tests.chaos.scenario import CHAOS_ENV, Scenario
from tests.conftest import eventually, make_stack


async def run(seed: int, duration: float) -> None:
    stack = make_stack("chaos", **CHAOS_ENV)
    stack.start()
    client = await Client.connect(stack.nats_url, timeout=5)
    db = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=4)
    try:
        await eventually(lambda: _sleds(client), timeout=20)
        started = time.monotonic()
        report = await Scenario(stack, client, db, seed, duration).run()
        print(f"\n{report.summary()}\n  wall time: {time.monotonic() - started:.1f}s")
        if report.violations:
            replay = f"make chaos SEED={seed} DURATION={duration:g}"
            log = "\n".join(report.log)
            pytest.fail(
                f"{len(report.violations)} violations; replay with: {replay}\n{report.summary()}\n{log}"
            )
        assert sum(report.faults.values()) > 0, "a chaos run that injected no fault proves nothing"
    finally:
        await db.close()
        await client.close()
        stack.stop()
        if not os.environ.get("RACKPLANE_KEEP_LOGS"):
            shutil.rmtree(stack.dir, ignore_errors=True)


async def _sleds(client: Client) -> bool:
    return len(await client.sled_list()) >= int(CHAOS_ENV["RACKPLANE_SLEDS"])


async def test_a_short_fixed_seed_chaos_run_keeps_every_invariant() -> None:
    await run(seed=20261202, duration=40)


@pytest.mark.chaos
async def test_chaos_soak() -> None:
    await run(
        seed=int(os.environ.get("SEED", str(int(time.time())))),
        duration=float(os.environ.get("DURATION", "600")),
    )
