"""`rackctl check`: run the invariant checker (rackctl/invariants/) as a command, for scripts and operators.

Exit 0 when every invariant holds, 1 with one line per violation; at rest, what fails while work is still
in flight is looked at again before it counts.
"""

from __future__ import annotations

import argparse
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from rackctl import dead_letters
from rackctl import invariants as checker
from rackctl.commands.args import duration, json_flag
from rackctl.commands.base import Failure, Invocation, command
from rackctl.commands.database import connect, database_url_option
from rackctl.invariants.timings import Timings
from rackctl.settle import settled
from shared.config import dead_letter_alert


def _check_options(p: argparse.ArgumentParser) -> None:
    database_url_option(p)
    p.add_argument(
        "--at-rest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also check what holds only once the system is quiet, the broker's consumers and the sleds' "
        "VMMs included (default); --no-at-rest: only what always holds, from the database alone",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="at rest, while work is in flight (a saga, a message not yet consumed), check again each second "
        "for up to this long before reporting what still fails (default 30; 0: the first look)",
    )
    p.add_argument(
        "--dead-letters-within",
        type=duration,
        default=None,
        metavar="SECONDS",
        help="at rest, report the dead letters younger than this (default $RACKPLANE_DLQ_ALERT, else 3600; "
        "0: never)",
    )


@command(
    "check",
    "check rackplane's invariants against its database (and, at rest, its broker): exit 0 when they all "
    "hold, 1 with one line per violation",
    _check_options,
    json_flag,
    examples=(
        "rackctl check",
        "rackctl check --no-at-rest --json  # from the database alone",
    ),
)
async def check_invariants(ctx: Invocation) -> None:
    a = ctx.args
    conn = await connect(a)
    js: JetStreamContext | None = None
    nc = None
    violations: list[str] = []
    try:
        if a.at_rest:
            try:
                nc = (await ctx.client()).nc
                js = nc.jetstream()
            except ConnectionError as e:
                violations.append(f"broker checks not run: {e}")
        violations += await _settled(conn, a.at_rest, js, nc, a.settle)
    finally:
        await conn.close()
    checks = checker.names(at_rest=a.at_rest, broker=js is not None)
    data: dict[str, Any] = {"ok": False, "at_rest": a.at_rest, "checks": checks, "violations": violations}
    within = dead_letter_alert() if a.dead_letters_within is None else a.dead_letters_within
    if js is not None and within > 0:
        checks.append("no_recent_dead_letters")
        try:
            depth = await dead_letters.depth(js, within)
        except Exception as e:  # a broker that went away, an identity that may not read the DLQ
            violations.append(f"dead letters not read: {type(e).__name__}: {e}")
        else:
            data["dead_letters"] = depth.as_dict()
            violations += checker.recent_dead_letters(depth)
    data["ok"] = not violations

    def human(d: dict[str, Any]) -> None:
        for line in d["violations"]:
            print(line)
        if d["ok"]:
            print(f"ok: {len(d['checks'])} checks, every invariant holds")

    ctx.emit(data, human)
    if violations:
        raise Failure(f"{len(violations)} invariant violation{'' if len(violations) == 1 else 's'}")


async def _settled(conn: asyncpg.Connection, at_rest: bool, js: Any, nc: Any, settle: float) -> list[str]:
    """The checker's findings once they hold still: an at-rest check fails while work is in flight (a
    delete's saga, an event on its way), so what fails is looked at again until it passes or `settle`
    seconds have gone by; a violation that lasts that long is reported. Without --at-rest, one look. The
    service timings the checks judge by are this process's settings, read once."""
    timings = Timings.from_env()
    return await settled(
        lambda: checker.check(conn, at_rest=at_rest, js=js, nc=nc, timings=timings),
        settle if at_rest else 0,
        label="check",
        status=lambda found, left: f"{len(found)} not passing yet, looking again for {left:.0f}s more",
    )
