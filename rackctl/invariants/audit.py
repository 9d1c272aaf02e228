"""The usage audit: what accounting holds, recomputed from what it is made of, and where the two differ.

Two rules, each held here once (`rackctl usage audit` and `rackctl check` both use them):
- every total is the sum of the per-instance charges under it: a project's and a silo's total rows, and
  the fleet's, which is the sum of the silo rows, against the sum of all charges;
- at rest, each instance is charged its vCPUs and RAM while it has a live VMM (a charged state), and its
  disk while it exists (until destroyed). A start whose charge is not applied yet looks drifted for a
  moment, so callers look again before they report an instance drift (see rackctl/settle.py).

It reads accounting's and instance-manager's tables (read-only) and never writes: a drift is for an
operator to look into, not for the auditor to paper over. Its SQL is audit.sql.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import asyncpg

from shared.db import queries
from shared.messages import CHARGED_STATES

Level = Literal["project", "silo", "fleet", "instance"]
Q = queries(Path(__file__).with_suffix(".sql"))
_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def exact_size(n: int) -> str:
    """`n` bytes in the largest binary unit that divides it exactly: an audit must not round a drift of a
    few bytes away (`4 GiB`, but `4294967297 B`)."""
    for unit, scale in _UNITS:
        if n and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Resources:
    vcpus: int
    ram_bytes: int
    disk_bytes: int

    def __str__(self) -> str:
        return f"vcpus={self.vcpus} ram={exact_size(self.ram_bytes)} disk={exact_size(self.disk_bytes)}"


@dataclass(frozen=True)
class Drift:
    """One place where accounting holds something other than what it should: a total that is not the sum
    of its charges, or an instance's charge that does not follow its state."""

    level: Level
    id: str | None
    """The project's, silo's or instance's id; None for the fleet."""
    name: str
    """`silo/project` for a project, the silo's name, `fleet`, or the instance's name."""
    held: Resources
    """What accounting holds: the total row (for the fleet, the sum of the silo rows), or the charge."""
    expected: Resources
    """What it should be: the sum of the charges under it, or what the instance's state calls for."""
    state: str | None = None
    """Instance drifts only: its state."""
    silo: str | None = None
    project: str | None = None
    """Instance drifts only: where the instance is."""

    def line(self) -> str:
        if self.level == "instance":
            where = f" in {self.silo}/{self.project}" if self.silo and self.project else ""
            return (
                f"instance {self.name} ({self.id}){where} is {self.state}: charged {self.held}, "
                f"should be {self.expected}"
            )
        if self.level == "fleet":
            return f"fleet: sum of silo totals ({self.held}) != sum of all charges ({self.expected})"
        return f"{self.level} {self.name}: totals ({self.held}) != sum of its charges ({self.expected})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class UnknownScope(LookupError):
    """The silo or project to audit does not exist."""


@dataclass(frozen=True)
class Scope:
    """What to audit: the fleet (no silo), one silo, or one project of a silo; ids once resolved."""

    silo: str | None = None
    project: str | None = None
    silo_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None

    def __str__(self) -> str:
        return "fleet" if self.silo is None else "/".join(p for p in (self.silo, self.project) if p)


FLEET = Scope()


async def resolve(conn: asyncpg.Connection, silo: str | None, project: str | None = None) -> Scope:
    """The scope of `silo` (and `project` in it), by instance-manager's names; UnknownScope if either
    does not exist."""
    if silo is None:
        return FLEET
    silo_id = await conn.fetchval(Q["live_silo_id"], silo)  # a deleted silo's name may be another's now
    if silo_id is None:
        raise UnknownScope(f"no silo {silo!r}")
    if project is None:
        return Scope(silo, None, silo_id)
    project_id = await conn.fetchval(Q["live_project_id"], silo_id, project)
    if project_id is None:
        raise UnknownScope(f"no project {project!r} in silo {silo!r}")
    return Scope(silo, project, silo_id, project_id)


async def drifts(conn: asyncpg.Connection, scope: Scope = FLEET) -> list[Drift]:
    """Every drift in `scope`: totals first, then instances."""
    return await total_drifts(conn, scope) + await charge_drifts(conn, scope)


# --- (a) totals against the per-instance charges ----------------------------------------------------------


async def total_drifts(conn: asyncpg.Connection, scope: Scope = FLEET) -> list[Drift]:
    """Each project, silo and (for the fleet scope) fleet total that is not the sum of its charges."""
    rows: list[tuple[Level, Any]] = [
        ("project", r) for r in await conn.fetch(Q["project_totals"], scope.silo_id, scope.project_id)
    ]
    if scope.project_id is None:
        rows += [("silo", r) for r in await conn.fetch(Q["silo_totals"], scope.silo_id)]
    if scope.silo_id is None:
        rows.append(("fleet", await conn.fetchrow(Q["fleet_totals"])))
    out = []
    for level, r in rows:
        held = Resources(r["vcpus"], r["ram_bytes"], r["disk_bytes"])
        expected = Resources(r["c_vcpus"], r["c_ram"], r["c_disk"])
        if held != expected:
            name = "fleet" if level == "fleet" else r["name"]
            out.append(Drift(level, None if level == "fleet" else str(r["id"]), name, held, expected))
    return out


# --- (b) per-instance charges against instance-manager's states -------------------------------------------


def charge_due(state: str, shape: Resources) -> Resources:
    """What an instance in `state` is charged: vCPUs and RAM while it has a live VMM, disk until it is
    destroyed."""
    live = state in CHARGED_STATES
    return Resources(
        shape.vcpus if live else 0,
        shape.ram_bytes if live else 0,
        0 if state == "destroyed" else shape.disk_bytes,
    )


async def charge_drifts(conn: asyncpg.Connection, scope: Scope = FLEET) -> list[Drift]:
    """At rest: each instance whose charge is not what its state calls for."""
    out = []
    for r in await conn.fetch(Q["instance_charges"], scope.silo_id, scope.project_id):
        held = Resources(r["c_vcpus"], r["c_ram"], r["c_disk"])
        expected = charge_due(r["state"], Resources(r["vcpus"], r["ram_bytes"], r["disk_bytes"]))
        if held != expected:
            out.append(
                Drift(
                    "instance", str(r["id"]), r["name"], held, expected, r["state"], r["silo"], r["project"]
                )
            )
    return out
