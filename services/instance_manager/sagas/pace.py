"""Backpressure for sagas: how many a replica finishes a second (`Pace`), and when a new one is refused
at once rather than left to time out (`busy`; docs/architecture.md, "Backpressure instead of timeouts")."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from shared import bus, telemetry

BUSY_PRIOR_RATE = 25.0
"""Sagas a second a replica is taken to finish until it has measured more (the bench measures 40 to 96 on
two shared cores): a replica that has just started, or was idle, takes this times RACKPLANE_SAGA_BACKLOG
sagas in hand before it has a rate of its own to judge by."""
BUSY_RETRY_LEAST = 0.02
"""The shortest wait a `busy` answer asks for, in seconds."""


@dataclass
class Pace:
    """Sagas finished a second, counted in one-second buckets over the last WINDOW seconds: what the
    backpressure divides the backlog by. A few integer operations a saga and a command, no I/O."""

    WINDOW = 5
    counts: list[int] = field(default_factory=lambda: [0] * Pace.WINDOW)
    seconds: list[int] = field(default_factory=lambda: [-1] * Pace.WINDOW)

    def tick(self, now: float) -> None:
        s = int(now)
        i = s % self.WINDOW
        if self.seconds[i] != s:
            self.seconds[i], self.counts[i] = s, 0
        self.counts[i] += 1

    def rate(self, now: float) -> float:
        """Finished a second since the oldest bucket still in the window began (at least one second):
        a burst's first seconds are measured over what they took, not over the whole window."""
        s = int(now)
        live = [
            (sec, c) for sec, c in zip(self.seconds, self.counts, strict=True) if 0 <= s - sec < self.WINDOW
        ]
        if not live:
            return 0.0
        return sum(c for _, c in live) / max(1.0, now - min(sec for sec, _ in live))


def busy(
    pace: Pace, promised: list[float], in_hand: int, backlog: float, now: float
) -> tuple[int, int, float] | None:
    """None while `in_hand` sagas are fewer than this replica finishes in `backlog` seconds at its
    measured rate; else (milliseconds until they would be, sagas in hand, rate). `promised` (sorted) is
    when the callers told `busy` before were told to come back: this one's wait is added to it."""
    rate = max(pace.rate(now), BUSY_PRIOR_RATE)
    excess = in_hand - rate * backlog
    if excess < 0:
        return None
    # Callers told to come back before this one are ahead of it: each is told its place in that line
    # (the excess and those ahead drained at the rate), so that they come back spread out, in turn,
    # instead of all at once to be refused again.
    del promised[: bisect.bisect_right(promised, now)]
    ahead = len(promised)
    wait = min(max((excess + ahead + 1) / rate, BUSY_RETRY_LEAST), backlog)
    bisect.insort(promised, now + wait)
    return math.ceil(wait * 1000), in_hand, rate


def refusal(ms: int, in_hand: int, rate: float) -> bus.CommandError:
    """The answer to a command `busy` refused (a start, create or migrate; a restart order), counted."""
    telemetry.count("commands.busy")
    return bus.CommandError(
        "busy", f"busy: retry after {ms} ms ({in_hand} sagas in hand, {rate:.0f} finished a second)"
    )
