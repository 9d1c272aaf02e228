"""Applying a batch of provisioning deltas: the generation fence, the quota check and the totals, in one
transaction of a few set-based statements, with exactly the outcomes of applying them one by one.

Invariant: for every project and silo, each total equals the sum of the charges held in instance_charges
for the instances under it (the fleet's totals are the sum of the silos'); a total never goes below zero;
a silo's vCPU, RAM and disk totals never exceed its quotas by an increase. Every change of a silo's or
project's totals appends them, as they are after the batch, to usage_history in the same transaction.

How it holds, whatever the order and number of deliveries:
- a delta states an instance's whole charge at a generation; it is applied only if that generation is
  newer than the one held, and the totals move by the difference, in the same transaction as the fence;
- a delta at the held generation is a repeat: nothing moves, and its recorded outcome is its answer, so
  a retried charge is never refused by a quota check that counts its own earlier charge (the outcome
  message goes out again only once the broker's duplicate window may have forgotten the first: inside it,
  the broker would drop the copy, whose message id is the first's);
- a delta at an older generation is stale: nothing moves;
- the batch's instance rows (inserted first, for instances seen for the first time, in key order as
  well), then its silo rows, are locked in key order before anything is decided, so two batches (two
  partitions, two replicas) touching one instance or one silo serialize, without deadlock (the lock order
  of docs/architecture.md);
- under those locks the deltas are decided in stream order, in memory: each sees the fence and the silo
  totals as the deltas before it in the batch left them, which is what one-by-one application would see.
  Then one statement per table writes what was decided.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import asyncpg

from services.accounting.history import append_history
from shared import telemetry
from shared.config import Settings
from shared.db import enqueue_many, queries
from shared.messages import MAX_TOTAL, Model, Outcome, ProvisionDelta, ProvisionOutcome, Usage, UsageChanged
from shared.topology import subjects

SOURCE = "accounting"
DUPLICATE_WINDOW: float = Settings.model_fields["duplicate_window"].default
"""RACKPLANE_DUPLICATE_WINDOW's default, for callers that do not pass the process's (the tests)."""
Q = queries(Path(__file__).parent / "queries.sql")
GiB = 2**30
AMOUNTS = ("vcpus", "ram_bytes", "disk_bytes")
UNITS = (("vCPU", 1, ""), ("RAM", GiB, " GiB"), ("storage", GiB, " GiB"))
"""How a refusal names each amount: its name, its unit and the unit's suffix."""


class UnknownSilo(Exception):
    """The delta names a silo whose creation has not reached accounting yet."""


class UnknownProject(Exception):
    """The delta names a project whose creation has not reached accounting yet."""


class Forged(Exception):
    """The delta contradicts its subject or what accounting knows: it is never applied."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Charge:
    """One delivered delta, with the silo and project names its subject gave."""

    silo: str
    project: str
    delta: ProvisionDelta


@dataclass(frozen=True)
class Decided:
    """A charge the ledger decided: applied, refused (over a quota) or stale (an older generation), or a
    repeat of one decided before, whose outcome is given again."""

    outcome: Outcome
    reason: str
    repeat: bool = False
    told: bool = False
    """A repeat whose outcome was decided (and queued) less than half the broker's duplicate window ago:
    the broker still knows its message id and would drop a copy, so none is queued."""


Result = Decided | UnknownSilo | UnknownProject | Forged


async def apply_batch(
    conn: asyncpg.Connection, charges: list[Charge], window: float = DUPLICATE_WINDOW
) -> list[Result]:
    """Apply `charges` (in stream order) inside the caller's transaction; queue every outcome, and the new
    usage of each project that moved, as events. One result per charge, in order: a `Decided`, or the
    reason it was not applied (nothing of it moved). `window` is the broker's duplicate window
    (RACKPLANE_DUPLICATE_WINDOW: accounting's main passes its setting; the default is the setting's)."""
    results: list[Result | None] = [None] * len(charges)
    silos = {r["id"]: r for r in await conn.fetch(Q["silos_of"], list({c.delta.silo_id for c in charges}))}
    projects = {
        r["id"]: r for r in await conn.fetch(Q["projects_of"], list({c.delta.project_id for c in charges}))
    }
    valid: list[int] = []
    for i, c in enumerate(charges):
        if (error := owner_error(c, silos, projects)) is not None:
            results[i] = error
        else:
            valid.append(i)

    held = await lock_charges(conn, [charges[i].delta for i in valid], window)
    ledger = Ledger(
        held,
        {
            r["id"]: r
            for r in await conn.fetch(Q["silos_lock"], sorted({charges[i].delta.silo_id for i in valid}))
        },
    )
    for i in valid:
        results[i] = ledger.decide(charges[i].delta)

    await conn.execute(
        Q["charges_set"],
        *columns(ledger.changed_charges(), ("instance_id", "generation", *AMOUNTS, "outcome", "reason")),
    )
    await conn.execute(Q["silos_set"], *columns(ledger.changed_silos(), ("id", *AMOUNTS)))
    moved = await conn.fetch(Q["projects_add"], *columns(ledger.project_moves(), ("id", *AMOUNTS)))
    await append_history(
        conn,
        [("silo", s["id"], s["id"], *(s[a] for a in AMOUNTS)) for s in ledger.changed_silos()]
        + [("project", p["id"], p["silo_id"], *(p[a] for a in AMOUNTS)) for p in moved],
    )
    await enqueue_many(conn, events(charges, results, moved, ledger), source=SOURCE)
    tally = Counter("duplicate" if r.repeat else r.outcome.value for r in results if isinstance(r, Decided))
    for name, n in tally.items():
        telemetry.count(f"deltas.{name}", n)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def owner_error(
    c: Charge, silos: dict[Any, asyncpg.Record], projects: dict[Any, asyncpg.Record]
) -> Result | None:
    """The subject's silo and project are the delta's, and the project is the silo's: the names in a
    subject decide who may publish it (the broker's permissions), the ids decide what is charged, so the
    two must agree. Unknown silos and projects are those whose creation has not arrived yet."""
    d = c.delta
    silo = silos.get(d.silo_id)
    if silo is None:
        return UnknownSilo(str(d.silo_id))
    if silo["name"] != c.silo:
        return Forged(f"subject names silo {c.silo}, but silo {d.silo_id} is {silo['name']}")
    p = projects.get(d.project_id)
    if p is None:
        return UnknownProject(str(d.project_id))
    if p["silo_id"] != d.silo_id:
        return Forged(f"project {d.project_id} belongs to silo {p['silo_name']}, not to {c.silo}")
    if p["name"] is not None and p["name"] != c.project:
        return Forged(f"subject names project {c.project}, but project {d.project_id} is {p['name']}")
    return None


async def lock_charges(
    conn: asyncpg.Connection, deltas: list[ProvisionDelta], window: float
) -> dict[uuid.UUID, asyncpg.Record]:
    """Each instance's charge row, created at zero for an instance seen for the first time (owned by the
    project of its first delta), and locked, in key order. The rows are inserted in key order too: an
    inserted row is held until commit, so two batches inserting new instances' rows in stream order (x
    then y, and y then x) would deadlock. A repeat told less than half the duplicate `window` ago is not
    told again."""
    first: dict[uuid.UUID, ProvisionDelta] = {}
    for d in deltas:
        first.setdefault(d.instance_id, d)
    ids = in_key_order(first)
    await conn.execute(
        Q["charges_ensure"], ids, [first[i].project_id for i in ids], [first[i].silo_id for i in ids]
    )
    rows = await conn.fetch(Q["charges_lock"], ids, window / 2)
    return {r["instance_id"]: r for r in rows}


APPLIED = Decided(Outcome.applied, "")
"""The result of every applied delta: results are immutable, so one serves them all."""


class Ledger:
    """The fence and the silo totals as the batch's deltas, decided one after another, leave them.

    A batch decides a thousand deltas in memory, one Python call each, under its silos' locks: the rows
    it reads are not copied, a changed charge is written as a new row, and an applied delta shares one
    result (docs/benchmarks.md)."""

    def __init__(
        self, charges: Mapping[uuid.UUID, Mapping[str, Any]], silos: Mapping[Any, Mapping[str, Any]]
    ) -> None:
        self.charges = charges
        """Each instance's charge row as locked (lock_charges): read, never written."""
        self.decided: dict[uuid.UUID, dict[str, Any]] = {}
        """The charge rows this batch changed, as it left them."""
        self.silos = {sid: {**r, "moved": False} for sid, r in silos.items()}
        self.projects: dict[Any, list[int]] = {}
        """project -> how far this batch moved its totals."""

    def decide(self, d: ProvisionDelta) -> Result:
        held = self.decided.get(d.instance_id) or self.charges[d.instance_id]
        if held["project_id"] != d.project_id or held["silo_id"] != d.silo_id:
            return Forged(
                f"instance {d.instance_id} is charged to project {held['project_id']} of silo "
                f"{held['silo_id']}, not to project {d.project_id} of silo {d.silo_id}"
            )
        if d.generation == held["generation"]:
            return Decided(Outcome(held["outcome"]), held["reason"], repeat=True, told=held["told"])
        if d.generation < held["generation"]:
            return Decided(Outcome.stale, f"generation {d.generation} is older than {held['generation']}")
        diff = [d.vcpus - held["vcpus"], d.ram_bytes - held["ram_bytes"], d.disk_bytes - held["disk_bytes"]]
        silo = self.silos[d.silo_id]
        row = {
            "project_id": d.project_id,
            "silo_id": d.silo_id,
            "generation": d.generation,
            "told": True,  # its outcome goes out with this batch
        }
        if (diff[0] > 0 or diff[1] > 0 or diff[2] > 0) and (reason := quota_refusal(silo, diff)):
            self.decided[d.instance_id] = {
                **row,
                "vcpus": held["vcpus"],
                "ram_bytes": held["ram_bytes"],
                "disk_bytes": held["disk_bytes"],
                "outcome": Outcome.refused.value,
                "reason": reason,
            }
            return Decided(Outcome.refused, reason)
        self.decided[d.instance_id] = {
            **row,
            "vcpus": d.vcpus,
            "ram_bytes": d.ram_bytes,
            "disk_bytes": d.disk_bytes,
            "outcome": Outcome.applied.value,
            "reason": "",
        }
        if diff[0] or diff[1] or diff[2]:
            silo["vcpus"] += diff[0]
            silo["ram_bytes"] += diff[1]
            silo["disk_bytes"] += diff[2]
            silo["moved"] = True
            if (moves := self.projects.get(d.project_id)) is None:
                self.projects[d.project_id] = diff
            else:
                moves[0] += diff[0]
                moves[1] += diff[1]
                moves[2] += diff[2]
        return APPLIED

    def changed_charges(self) -> list[dict[str, Any]]:
        return [{"instance_id": i, **self.decided[i]} for i in in_key_order(self.decided)]

    def changed_silos(self) -> list[dict[str, Any]]:
        return [self.silos[s] for s in sorted(self.silos) if self.silos[s]["moved"]]

    def project_moves(self) -> list[dict[str, Any]]:
        return [
            {"id": p, **dict(zip(AMOUNTS, m, strict=True))}
            for p, m in sorted(self.projects.items())
            if any(m)
        ]


def in_key_order(ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """`ids` in PostgreSQL's uuid order (their bytes, that is their integers), sorted on the integers:
    `UUID.__lt__` is a Python call per comparison, a tenth of a batch's time for a thousand of them."""
    return sorted(ids, key=attrgetter("int"))


def quota_refusal(silo: dict[str, Any], diff: list[int]) -> str:
    """Why the silo cannot take the change `diff` (vCPUs, RAM, disk), or "" if it can: only increases are
    checked, reaching a quota exactly is allowed, and no silo total may pass MAX_TOTAL (so that no sum of
    them overflows, and neither does a project's, which is at most its silo's)."""
    for (name, unit, suffix), a, asked in zip(UNITS, AMOUNTS, diff, strict=True):
        used, quota = silo[a], silo[f"quota_{a}"]
        if asked > 0 and quota is not None and used + asked > quota:
            return (
                f"{name} quota exceeded: {used / unit:g}{suffix} of {quota / unit:g}{suffix} used, "
                f"{asked / unit:g}{suffix} asked"
            )
    for (name, _, _), a, asked in zip(UNITS, AMOUNTS, diff, strict=True):
        if asked > 0 and silo[a] + asked > MAX_TOTAL:
            return f"{name} total of silo {silo['name']} would pass its limit ({MAX_TOTAL})"
    return ""


def columns(rows: list[dict[str, Any]], names: tuple[str, ...]) -> list[list[Any]]:
    """Rows as one array per column, for a statement over `unnest`."""
    return [[r[n] for r in rows] for n in names]


def events(
    charges: list[Charge],
    results: list[Result | None],
    moved: list[asyncpg.Record],
    ledger: Ledger,
) -> list[tuple[str, Model, str | None]]:
    """The usage of every project that moved (with its silo's), then every delta's outcome, in order (but a
    repeat's whose outcome was told inside the duplicate window)."""
    out: list[tuple[str, Model, str | None]] = []
    for p in moved:
        silo = ledger.silos[p["silo_id"]]
        out.append(
            (
                subjects.event(silo["name"], "usage", "changed"),
                UsageChanged(
                    silo_id=p["silo_id"],
                    project_id=p["id"],
                    silo=Usage(**{a: silo[a] for a in AMOUNTS}),
                    project=Usage(**{a: p[a] for a in AMOUNTS}),
                ),
                None,
            )
        )
    subject: dict[str, str] = {}
    for c, r in zip(charges, results, strict=True):
        if isinstance(r, Decided) and not r.told:
            d = c.delta
            if (to := subject.get(c.silo)) is None:
                to = subject[c.silo] = subjects.event(c.silo, "provision", "outcome")
            out.append(
                (
                    to,
                    ProvisionOutcome(
                        instance_id=d.instance_id, generation=d.generation, outcome=r.outcome, reason=r.reason
                    ),
                    f"outcome:{d.instance_id}:{d.generation}",
                )
            )
    return out
