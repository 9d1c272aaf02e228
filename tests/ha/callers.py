"""What the measurements of the HA stack share: callers that start and stop instances through
`rackctl.client.Client` (so the client's own resends count), a recorder of every call they make, and what
is read from it: the longest time across a loss in which no call of a kind succeeded (the gap), and which
calls failed: in flight at the loss, or sent after it.

A caller cycles one instance of its own: `start`, `show` until it runs, `stop`, `show` until it is
stopped. A command that fails is sent again, as an operator would (start and stop are idempotent), until
it succeeds or the caller's deadline passes; a command counts as failed only when the client gave up on
an attempt, and as lost only when no attempt ever succeeded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from deploy.stack import Stack
from rackctl.client import Client
from shared.bus import CommandError
from tests.conftest import GiB, Rack

KINDS = ("show", "start")
"""The calls whose gap is measured: the API's cheapest read and the command that runs a saga."""


@dataclass(frozen=True)
class Call:
    kind: str
    sent: float
    ended: float
    ok: bool
    code: str


@dataclass
class Recorder:
    """Every call every caller made (monotonic times), and every command given up on."""

    calls: list[Call] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)
    """(caller's instance, verb) of commands no attempt of which succeeded before the deadline."""
    commands: int = 0
    """Commands that succeeded (after however many attempts)."""

    async def timed(self, kind: str, call: Awaitable[Any]) -> Any:
        """The call's reply (True for an empty one), or None if it failed: either way recorded."""
        sent = time.monotonic()
        try:
            out = await call
        except (CommandError, nats.errors.Error) as e:
            self.calls.append(Call(kind, sent, time.monotonic(), False, getattr(e, "code", type(e).__name__)))
            return None
        self.calls.append(Call(kind, sent, time.monotonic(), True, ""))
        return out if out is not None else True

    def gap(self, kind: str, start: float, end: float) -> float:
        """The longest time, over the window [start, end], in which no call of `kind` succeeded: from the
        last success before `start` (the gap that spans the loss counts whole) to the first after `end`."""
        oks = sorted(c.ended for c in self.calls if c.kind == kind and c.ok)
        before = [t for t in oks if t <= start][-1:]
        inside = [t for t in oks if start < t <= end]
        after = [t for t in oks if t > end][:1]
        points = before + inside + after
        if not points:
            return end - start
        return max((b - a for a, b in itertools.pairwise(points)), default=0.0)

    def failures(self, at: float, end: float) -> tuple[int, int]:
        """Attempts that failed around a loss at `at`: (in flight at it: sent before, ended after; sent
        after it, up to `end`)."""
        bad = [c for c in self.calls if not c.ok]
        return (
            sum(1 for c in bad if c.sent < at <= c.ended),
            sum(1 for c in bad if at <= c.sent <= end),
        )

    def codes(self, start: float = 0.0, end: float = float("inf")) -> dict[str, int]:
        """Failed attempts by kind and error code (those that ended inside the window)."""
        out: dict[str, int] = {}
        for c in self.calls:
            if not c.ok and start <= c.ended <= end:
                out[f"{c.kind}:{c.code}"] = out.get(f"{c.kind}:{c.code}", 0) + 1
        return out


@dataclass
class Loss:
    """One loss measured: what was lost, when, and what the callers saw until `end`."""

    what: str
    at: float
    end: float
    gaps: dict[str, float]
    in_flight: int
    after: int
    codes: dict[str, int]

    def line(self) -> str:
        gaps = ", ".join(f"{k} {v:.2f}s" for k, v in self.gaps.items())
        return (
            f"  {self.what}: gap {gaps}; failed in flight {self.in_flight}, sent after {self.after} "
            f"{self.codes or ''}"
        )


def measure(rec: Recorder, what: str, at: float, end: float) -> Loss:
    gaps = {k: rec.gap(k, at, end) for k in KINDS}
    return Loss(what, at, end, gaps, *rec.failures(at, end), rec.codes(at, end))


def summary(title: str, losses: list[Loss], baseline: dict[str, float]) -> str:
    """p50 and max of each gap over the losses, beside the same gap in a window with no loss."""
    out = [f"{title}: {len(losses)} losses"]
    for k in KINDS:
        gaps = [loss.gaps[k] for loss in losses]
        p50 = statistics.median(gaps)
        base = baseline.get(k, 0.0)
        ratio = f" ({p50 / base:.1f}x)" if base > 0 else ""
        out.append(f"  {k} gap p50 {p50:.2f}s{ratio} max {max(gaps):.2f}s, baseline (no loss) {base:.2f}s")
    out.append(
        f"  failed attempts: in flight {sum(x.in_flight for x in losses)}, "
        f"sent after the loss {sum(x.after for x in losses)}"
    )
    out.extend(loss.line() for loss in losses)
    return "\n".join(out)


GIVE_UP = 120.0
"""Seconds a command is sent again before the caller gives up on it: longer than any loss measured."""


async def until_ok(rec: Recorder, kind: str, call: Callable[[], Awaitable[Any]], deadline: float) -> Any:
    """One command, sent again after each failure until it succeeds (None: it did not within GIVE_UP
    seconds, or before the caller's deadline)."""
    deadline = min(deadline, time.monotonic() + GIVE_UP)
    while time.monotonic() < deadline:
        out = await rec.timed(kind, call())
        if out is not None:
            rec.commands += 1
            return out
        await asyncio.sleep(0.2)
    return None


async def cycle(
    client: Client, silo: str, proj: str, name: str, rec: Recorder, done: asyncio.Event, limit: float
) -> None:
    """Start, show until running, stop, show until stopped, again, until `done` (or `limit` seconds)."""
    deadline = time.monotonic() + limit
    for verb, state in itertools.cycle((("start", "running"), ("stop", "stopped"))):
        if done.is_set() or time.monotonic() > deadline:
            return
        if await until_ok(rec, verb, lambda v=verb: client.instance(v, silo, proj, name), deadline) is None:
            rec.lost.append((name, verb))
            return
        while time.monotonic() < deadline:
            shown = await rec.timed("show", client.instance("show", silo, proj, name))
            if isinstance(shown, dict) and shown["state"] == state:
                break
            await asyncio.sleep(0.05)


@asynccontextmanager
async def callers(
    rack: Rack, n: int, timeout: float, limit: float = 900.0
) -> AsyncIterator[tuple[Recorder, str]]:
    """`n` callers, each with its own client (its own connection, to any node) and instance, cycling
    until the block ends; yields the recorder and the silo."""
    stack, client, _ = rack
    silo, proj = f"ha-{time.monotonic_ns()}", "p"
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    names = [f"vm-{i}" for i in range(n)]
    for name in names:
        await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    assert stack.nats_url
    clients = [await Client.connect(stack.nats_url, timeout=timeout) for _ in names]
    rec, done = Recorder(), asyncio.Event()
    running = asyncio.gather(
        *(cycle(c, silo, proj, m, rec, done, limit) for c, m in zip(clients, names, strict=True))
    )
    try:
        yield rec, silo
    finally:
        done.set()
        await running
        for c in clients:
            await c.close()


def manifest(stack: Stack) -> dict[str, Any]:
    return dict(json.loads((stack.dir / "stack.json").read_text()))
