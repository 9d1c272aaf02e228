"""Tenant command rate limits: a token bucket per silo and per (identity, silo), in memory, per replica.

Every tenant command (request/reply on `rp.cmd.<silo>.<resource>.<verb>`) takes one token from its
silo's bucket and one from its sender's; when either is empty it is answered at once, before any work,
with `limited: retry after N ms` (rackctl's client waits that long, with jitter, and sends it again).

Who sent a command: the silo is the subject's token, which the broker enforces (an identity may publish
only its own silo's subjects), so the silo's bucket is the boundary. The identity is read from the reply
subject's prefix (`_INBOX_<identity>.`), which the broker does *not* check on publish (a publisher may name
any reply subject, and only loses the reply), so the identity's bucket is keyed by (identity, silo) and
is checked together with the silo's: naming another identity's inbox spends that identity's budget in
the forger's own silo only, and never gets a command past its silo's bucket. Nothing is exempted by
what a reply subject claims: recovery's orders are exempt by their subject, which only recovery may
publish on (`exempt`). The check comes before the command is decoded (bus.serve's `admit`), so that a
refused flood costs the service little.

Each replica keeps its own buckets (a rack of N replicas admits up to N times the rate when the broker's
queue group spreads one silo over all of them); no state is shared, so a command costs a few dictionary
lookups and no I/O. Per-silo rates set by the fleet operator are read into `rates` at start, after each
`silo limits` on this replica, and every RATES_REFRESH seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg

from shared import bus
from shared.config import Settings
from shared.topology import subjects

RATES_REFRESH = 5.0
"""Seconds between two reads of the silos' own command rates (another replica's `silo limits`)."""
MAX_BUCKETS = 50_000
"""Buckets kept before the full (idle) ones are dropped: bounds the memory a flood of new keys can take."""


@dataclass(slots=True)
class Bucket:
    tokens: float
    stamp: float


@dataclass
class Limiter:
    identity_rate: float
    """Commands a second one identity may send to one silo (RACKPLANE_IDENTITY_COMMAND_RATE), or the
    silo's own rate if the fleet operator gave it a higher one."""
    silo_rate: float
    """Commands a second a silo may receive, unless the fleet operator set its own (silos.command_rate)."""
    burst: float
    """Seconds' worth of commands a bucket holds when full (RACKPLANE_COMMAND_BURST)."""
    clock: Callable[[], float] = time.monotonic
    rates: dict[str, float] = field(default_factory=dict)
    """Silo name -> its own command rate, for the silos that have one."""
    _buckets: dict[tuple[str, str], Bucket] = field(default_factory=dict)

    def admit(self, subject: str, reply: str | None) -> int:
        """0 if the command on `subject` may go on (its tokens are taken), else the milliseconds after
        which a token will be there for it (nothing is taken)."""
        silo = subjects.silo_of(subject)
        now = self.clock()
        own = self.rates.get(silo)
        silo_rate = self.silo_rate if own is None else own
        # a rate the fleet operator gave the silo is one identity's to use too (a bench, an automation)
        identity_rate = self.identity_rate if own is None else max(own, self.identity_rate)
        sb = self._refill(("", silo), silo_rate, now)
        ib = self._refill((identity_of(reply), silo), identity_rate, now)
        if sb.tokens >= 1 and ib.tokens >= 1:
            sb.tokens -= 1
            ib.tokens -= 1
            return 0
        wait = max((1 - sb.tokens) / silo_rate, (1 - ib.tokens) / identity_rate)
        return max(1, math.ceil(wait * 1000))

    def _refill(self, key: tuple[str, str], rate: float, now: float) -> Bucket:
        capacity = max(1.0, rate * self.burst)
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_idle(now)
            b = self._buckets[key] = Bucket(capacity, now)
        else:
            b.tokens = min(capacity, b.tokens + (now - b.stamp) * rate)
            b.stamp = now
        return b

    def _forget_idle(self, now: float) -> None:
        """Drop the buckets idle long enough to be full again: forgetting them changes no answer. Called
        once per MAX_BUCKETS new keys at most, so its cost is O(1) per command on average."""
        self._buckets = {k: b for k, b in self._buckets.items() if now - b.stamp < self.burst}


def identity_of(reply: str | None) -> str:
    """The identity a reply subject names (`_INBOX_<identity>.…`), else its first two tokens (a client
    with nats-py's default inbox, `_INBOX.<per connection>.…`, has a bucket per connection)."""
    if not reply:
        return ""
    head, _, rest = reply.partition(".")
    if (identity := subjects.inbox_identity(head)) is not None:
        return identity
    return f"{head}.{rest.partition('.')[0]}"


def exempt(subject: str) -> bool:
    """Recovery's orders (`rp.cmd.<silo>.vmm.*`, `instance.restart`, `instance.settle`): internal
    traffic, and only recovery may publish them (deploy/identities.py RECOVERY_ORDERS, enforced by the
    broker), so no tenant's limit may hold them up."""
    try:
        _, resource, verb = subjects.parse_command(subject)
    except ValueError:  # not a command's subject: no exemption (the command itself is refused later)
        return False
    return resource == "vmm" or (resource == "instance" and verb in ("restart", "settle"))


def limited(ms: int, subject: str) -> str:
    """The one-line answer to a limited command (rackctl's client reads `retry after N ms`)."""
    return f"limited: retry after {ms} ms (silo {subjects.silo_of(subject)} sends commands too fast)"


# --- counts: what a silo may hold ---

COLUMNS = {
    "projects": "max_projects",
    "instances": "max_instances",
    "pool_members": "max_pool_members",
    "command_rate": "command_rate",
}
"""A silo's tenant limits, as replies name them, and their columns (NULL: the rack's default)."""


def in_force(silo: asyncpg.Record, rack: Settings) -> dict[str, int]:
    """The silo's limits in force: its own, else the rack's defaults (`App.settings`)."""
    defaults = {
        "projects": rack.silo_max_projects,
        "instances": rack.silo_max_instances,
        "pool_members": rack.silo_max_pool_members,
        "command_rate": rack.silo_command_rate,
    }
    return {k: defaults[k] if silo[c] is None else silo[c] for k, c in COLUMNS.items()}


def over(silo: str, most: int, what: str, detail: str = "") -> bus.CommandError:
    """The one-line refusal of a create past a silo's limit."""
    more = f" ({detail})" if detail else ""
    return bus.CommandError(
        "limit",
        f"silo {silo} may hold at most {most} {what}{more}: the fleet operator may raise it "
        f"(rackctl silo limits {silo})",
    )
