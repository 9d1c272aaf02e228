"""Chaos runs: a short fixed-seed run in every `make test`, and the long soak behind `make chaos`
(SEED=, DURATION=). A failing run prints its seed and the log of operations that replays it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rackctl import check as checker
from tests import release
from tests.chaos.scenario import CHAOS_ENV, Scenario
from tests.conftest import private_rack


async def run(seed: int, duration: float, old_recovery: Path | None = None) -> None:
    """One chaos run; with `old_recovery` (the source tree of an earlier release), a recovery replica of
    that release runs beside today's the whole time, killed and restarted like any other process."""
    async with private_rack("chaos", timeout=5, **CHAOS_ENV) as (stack, client, db):
        if old_recovery is not None:
            stack.start_service("recovery", replica="recovery-old", root=old_recovery)
            stack.wait_ready(("recovery",))
        started = time.monotonic()
        report = await Scenario(stack, client, db, seed, duration).run()
        print(f"\n{report.summary()}\n  wall time: {time.monotonic() - started:.1f}s")
        if report.violations:
            replay = f"make chaos SEED={seed} DURATION={duration:g}"
            log = "\n".join(report.log)
            pytest.fail(f"{len(report.violations)} violations; replay: {replay}\n{report.summary()}\n{log}")
        assert sum(report.faults.values()) > 0, "a chaos run that injected no fault proves nothing"
        assert set(checker.names()) <= set(report.invariants), "an invariant was not checked"


async def test_a_short_fixed_seed_chaos_run_keeps_every_invariant() -> None:
    await run(seed=20261202, duration=40)


async def test_a_short_chaos_run_with_recovery_at_the_release_before_v2_beside_todays() -> None:
    """A rolling upgrade under chaos: one recovery replica reads `rp.evt.instance.changed` v1 alone (the
    release before v2), one reads v1 and v2; instance-manager sends both. Every invariant holds."""
    with release.checkout() as old:
        await run(seed=20261204, duration=45, old_recovery=old)


@pytest.mark.chaos
async def test_chaos_soak() -> None:
    await run(
        seed=int(os.environ.get("SEED", str(int(time.time())))),
        duration=float(os.environ.get("DURATION", "600")),
    )
