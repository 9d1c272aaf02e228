"""Chaos runs: a short fixed-seed run in every `make test`, and the long soak behind `make chaos`
(SEED=, DURATION=; HA=1 runs it on the stack of `make run HA=1`, losing one machine at a time). A failing
run prints its seed and the log of operations that replays it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rackctl import invariants as checker
from shared.topology import subjects
from tests import release
from tests.chaos.scenario import CHAOS_ENV, HA_ENV, SELF_HARM, WEIGHTS, Scenario, ha_weights
from tests.conftest import instance_changes, private_rack

CLIENT_TIMEOUT = 15.0
"""The workers' client's timeout, within which it sends again a command whose reply was lost (as
rackctl's does within its 60 s): an operation the soak counts as timed out is one an operator would have
waited on for a long time. A database failover refuses writes for about 20 s, longer than this: commands
sent early in it still fail, as `unavailable`, and are counted."""


async def run(
    seed: int, duration: float, old: Path | None = None, beside: tuple[str, ...] = (), ha: bool = False
) -> None:
    """One chaos run; with `old` (the source tree of an earlier release), a replica of each service in
    `beside` at that release runs beside today's the whole time, killed and restarted like any other, and
    the simulated sleds are of that release (they roll last: docs/operations.md, "Upgrades"). The
    weather of a rack harming itself, which that release does not survive, is left out then; and so are
    its failures of stuck starts on a clock alone, which today's never makes (`earlier_stuck_failure`);
    and as its instance-manager records no commands, a refusal may follow a copy that ran there
    (`Scenario.records_commands`).
    With `ha`, on the stack of `make run HA=1`, under its weather (scenario.py, `ha_weights`)."""
    env = CHAOS_ENV | (HA_ENV if ha else {})
    async with private_rack("chaos-ha" if ha else "chaos", timeout=CLIENT_TIMEOUT, **env) as (
        stack,
        client,
        db,
    ):
        if old is not None:  # the sleds roll after every reader of their inventories: they are old yet
            stack.services.pop("sled_agent").stop()
            stack.start_service("sled_agent", replica="sled_agent-old", root=old)
            stack.wait_ready(("sled_agent",))
        started = time.monotonic()
        weights = {op: w for op, w in WEIGHTS.items() if not (old and op in SELF_HARM)}
        weights = ha_weights(weights) if ha else weights
        scenario = Scenario(stack, client, db, seed, duration, weights=weights)
        await scenario.setup()  # first: an earlier instance-manager cannot create silos on today's schema
        for name in beside:
            assert old is not None
            stack.start_service(name, replica=f"{name}-old", root=old)
        stack.wait_ready(beside)
        if old:
            scenario.excused = earlier_stuck_failure
        if old and "instance_manager" in beside:
            scenario.records_commands = False
        report = await scenario.run(setup=False)
        print(f"\n{report.summary()}\n  wall time: {time.monotonic() - started:.1f}s")
        if os.environ.get("CHAOS_LOG"):  # the operations, as a failing run prints them
            print("\n".join(report.log))
        if report.violations:
            replay = f"make chaos SEED={seed} DURATION={duration:g}{' HA=1' if ha else ''}"
            log = "\n".join(report.log)
            pytest.fail(f"{len(report.violations)} violations; replay: {replay}\n{report.summary()}\n{log}")
        assert sum(report.faults.values()) > 0, "a chaos run that injected no fault proves nothing"
        assert set(checker.names(sent=True)) <= set(report.invariants), "an invariant was not checked"
        if "instance_manager" in beside:  # the old producer took part: changes it sent went out as v1 alone
            v1 = await instance_changes(client, subjects.event("*", "instance", "changed"))
            v2 = await instance_changes(client, subjects.event("*", "instance", "changed", version=2))
            alone = v1.keys() - v2.keys()
            print(f"  instance changes: {len(v1)} as v1, {len(v2)} as v2, {len(alone)} as v1 alone")
            assert alone, "the instance-manager of the earlier release sent nothing"


def earlier_stuck_failure(line: str) -> bool:
    """A start failed as stuck with no inventory as evidence: only an instance-manager of a release from
    before stuck was judged on the sled's evidence makes one (today's records the inventory it judged on),
    and such a replica takes part in a rolling upgrade's run. Nor, there, one judged while its order
    waited unread: the sleds of that release do not say how far they have read their orders, and an
    instance-manager of today judges as before on their word."""
    return line.endswith(("as evidence: on a clock alone", "an order waiting unread, not a stuck VMM"))


async def test_a_short_fixed_seed_chaos_run_keeps_every_invariant() -> None:
    await run(seed=20261202, duration=30)


async def test_a_short_chaos_run_with_services_of_the_release_before_v2_beside_todays() -> None:
    """A rolling upgrade under chaos, mid-way: beside today's instance-manager (sending v1 and v2) and
    recovery (reading both), one of each at the release before v2: an instance-manager that sends v1
    alone, a recovery that reads v1 alone. Every invariant holds."""
    with release.checkout() as old:
        await run(seed=20261204, duration=35, old=old, beside=("instance_manager", "recovery"))


@pytest.mark.chaos
async def test_chaos_soak() -> None:
    await run(
        seed=int(os.environ.get("SEED") or int(time.time())),  # make passes SEED= and DURATION= empty
        duration=float(os.environ.get("DURATION") or 600),
        ha=os.environ.get("RACKPLANE_HA", "") not in ("", "0"),  # make chaos HA=1
    )
