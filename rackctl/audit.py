"""The usage audit: what accounting holds, recomputed from what it is made of, and where the two differ.

Two rules, each held here once (`rackctl usage audit` and `rackctl check` both use them):
- every total is the sum of the per-instance charges under it: a project's and a silo's total rows, and
  the fleet's, which is the sum of the silo rows, against the sum of all charges;
- at rest, each instance is charged its vCPUs and RAM while it has a live VMM (a charged state), and its
  disk while it exists (until destroyed). A start whose charge is not applied yet looks drifted for a
  moment, so callers look again before they report an instance drift (see rackctl/settle.py).

It reads accounting's and instance-manager's tables (read-only) and never writes: a drift is for an
operator to look into, not for the auditor to paper over.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal

import asyncpg

from shared.messages import CHARGED_STATES

Level = Literal["project", "silo", "fleet", "instance"]
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
    silo_id = await conn.fetchval(  # a deleted silo's name may be another's now
        "SELECT id FROM instance_manager.silos WHERE name = $1 AND deleted_at IS NULL", silo
    )
    if silo_id is None:
        raise UnknownScope(f"no silo {silo!r}")
    if project is None:
        return Scope(silo, None, silo_id)
    project_id = await conn.fetchval(
        "SELECT id FROM instance_manager.projects WHERE silo_id = $1 AND name = $2 AND deleted_at IS NULL",
        silo_id,
        project,
    )
    if project_id is None:
        raise UnknownScope(f"no project {project!r} in silo {silo!r}")
    return Scope(silo, project, silo_id, project_id)


async def drifts(conn: asyncpg.Connection, scope: Scope = FLEET) -> list[Drift]:
    """Every drift in `scope`: totals first, then instances."""
    return await total_drifts(conn, scope) + await charge_drifts(conn, scope)


# --- (a) totals against the per-instance charges ----------------------------------------------------------

_SUMS = """
    SELECT {key} AS id, sum(vcpus)::bigint AS vcpus, sum(ram_bytes)::bigint AS ram_bytes,
           sum(disk_bytes)::bigint AS disk_bytes
    FROM accounting.instance_charges GROUP BY {key}
"""

_PROJECTS = f"""
    WITH sums AS ({_SUMS.format(key="project_id")})
    SELECT t.id, coalesce(s.name, a.name, t.silo_id::text) || '/' || coalesce(p.name, t.name, t.id::text)
               AS name,
           t.vcpus, t.ram_bytes, t.disk_bytes,
           coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
           coalesce(c.disk_bytes, 0) AS c_disk
    FROM accounting.projects t
    JOIN accounting.silos a ON a.id = t.silo_id
    LEFT JOIN sums c ON c.id = t.id
    LEFT JOIN instance_manager.projects p ON p.id = t.id
    LEFT JOIN instance_manager.silos s ON s.id = t.silo_id
    WHERE ($1::uuid IS NULL OR t.silo_id = $1) AND ($2::uuid IS NULL OR t.id = $2)
    ORDER BY 2
"""

_SILOS = f"""
    WITH sums AS ({_SUMS.format(key="silo_id")})
    SELECT t.id, coalesce(s.name, t.name) AS name, t.vcpus, t.ram_bytes, t.disk_bytes,
           coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
           coalesce(c.disk_bytes, 0) AS c_disk
    FROM accounting.silos t
    LEFT JOIN sums c ON c.id = t.id
    LEFT JOIN instance_manager.silos s ON s.id = t.id
    WHERE $1::uuid IS NULL OR t.id = $1
    ORDER BY 2
"""

_FLEET = """
    SELECT (SELECT coalesce(sum(vcpus), 0)::bigint FROM accounting.silos) AS vcpus,
           (SELECT coalesce(sum(ram_bytes), 0)::bigint FROM accounting.silos) AS ram_bytes,
           (SELECT coalesce(sum(disk_bytes), 0)::bigint FROM accounting.silos) AS disk_bytes,
           (SELECT coalesce(sum(vcpus), 0)::bigint FROM accounting.instance_charges) AS c_vcpus,
           (SELECT coalesce(sum(ram_bytes), 0)::bigint FROM accounting.instance_charges) AS c_ram,
           (SELECT coalesce(sum(disk_bytes), 0)::bigint FROM accounting.instance_charges) AS c_disk
"""
"""The fleet's totals are the sum of the silo rows (accounting keeps no fleet row of its own)."""


async def total_drifts(conn: asyncpg.Connection, scope: Scope = FLEET) -> list[Drift]:
    """Each project, silo and (for the fleet scope) fleet total that is not the sum of its charges."""
    rows: list[tuple[Level, Any]] = [
        ("project", r) for r in await conn.fetch(_PROJECTS, scope.silo_id, scope.project_id)
    ]
    if scope.project_id is None:
        rows += [("silo", r) for r in await conn.fetch(_SILOS, scope.silo_id)]
    if scope.silo_id is None:
        rows.append(("fleet", await conn.fetchrow(_FLEET)))
    out = []
    for level, r in rows:
        held = Resources(r["vcpus"], r["ram_bytes"], r["disk_bytes"])
        expected = Resources(r["c_vcpus"], r["c_ram"], r["c_disk"])
        if held != expected:
            name = "fleet" if level == "fleet" else r["name"]
            out.append(Drift(level, None if level == "fleet" else str(r["id"]), name, held, expected))
    return out


# --- (b) per-instance charges against instance-manager's states -------------------------------------------

_INSTANCES = """
    SELECT i.id, i.name, i.state, i.vcpus, i.ram_bytes, i.disk_bytes, s.name AS silo, p.name AS project,
           coalesce(c.vcpus, 0) AS c_vcpus, coalesce(c.ram_bytes, 0) AS c_ram,
           coalesce(c.disk_bytes, 0) AS c_disk
    FROM instance_manager.instances i
    JOIN instance_manager.projects p ON p.id = i.project_id
    JOIN instance_manager.silos s ON s.id = p.silo_id
    LEFT JOIN accounting.instance_charges c ON c.instance_id = i.id
    WHERE i.state <> 'creating'
      AND ($1::uuid IS NULL OR p.silo_id = $1) AND ($2::uuid IS NULL OR p.id = $2)
    ORDER BY s.name, p.name, i.name, i.id
"""
"""Instances being created are left out: their create saga charges the disk as it goes."""


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
    for r in await conn.fetch(_INSTANCES, scope.silo_id, scope.project_id):
        held = Resources(r["c_vcpus"], r["c_ram"], r["c_disk"])
        expected = charge_due(r["state"], Resources(r["vcpus"], r["ram_bytes"], r["disk_bytes"]))
        if held != expected:
            out.append(
                Drift(
                    "instance", str(r["id"]), r["name"], held, expected, r["state"], r["silo"], r["project"]
                )
            )
    return out
