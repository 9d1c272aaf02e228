"""Applying one provisioning delta: the generation fence, the quota check and the totals, in one
transaction.

Invariant: for every project, silo and the fleet, each total equals the sum of the charges held in
instance_charges for the instances under it; a total never goes below zero; a silo's vCPU, RAM and disk
totals never exceed its quotas by an increase. Every change of a silo's or project's totals appends
them, as they are after it, to usage_history in the same transaction.

How it holds, whatever the order and number of deliveries:
- a delta states an instance's whole charge at a generation; it is applied only if that generation is
  newer than the one held, and the totals move by the difference, in the same transaction as the fence;
- a delta at the held generation is a repeat: nothing moves, and its recorded outcome is sent again,
  so a retried charge is never refused by a quota check that counts its own earlier charge;
- a delta at an older generation is stale: nothing moves;
- the instance's row is locked first, so two deliveries of deltas for one instance serialize.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import asyncpg

from services.accounting.history import append_history
from shared import subjects, telemetry
from shared.db import enqueue, queries
from shared.messages import MAX_TOTAL, Outcome, ProvisionDelta, ProvisionOutcome, Usage, UsageChanged

SOURCE = "accounting"
Q = queries(Path(__file__).parent / "queries.sql")
GiB = 2**30


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
class Applied:
    outcome: Outcome
    reason: str
    repeat: bool = False


async def apply_delta(conn: asyncpg.Connection, silo: str, project: str, d: ProvisionDelta) -> Applied:
    """Apply `d` inside the caller's transaction and queue its outcome (and the new usage) as events."""
    await check_owner(conn, silo, project, d)
    await conn.execute(Q["charge_row_ensure"], d.instance_id, d.project_id, d.silo_id)
    held = await conn.fetchrow(Q["charge_row_lock"], d.instance_id)
    if (held["project_id"], held["silo_id"]) != (d.project_id, d.silo_id):
        raise Forged(
            f"instance {d.instance_id} is charged to project {held['project_id']} of silo {held['silo_id']}, "
            f"not to project {d.project_id} of silo {d.silo_id}"
        )

    if d.generation == held["generation"]:
        telemetry.count("deltas.duplicate")
        result = Applied(Outcome(held["outcome"]), held["reason"], repeat=True)
    elif d.generation < held["generation"]:
        telemetry.count("deltas.stale")
        result = Applied(Outcome.stale, f"generation {d.generation} is older than {held['generation']}")
    else:
        dv = d.vcpus - held["vcpus"]
        dr = d.ram_bytes - held["ram_bytes"]
        dd = d.disk_bytes - held["disk_bytes"]
        totals = await conn.fetchrow(Q["apply_totals"], d.silo_id, dv, dr, dd, d.project_id, MAX_TOTAL)
        if totals is None:
            telemetry.count("deltas.refused")
            reason = await refusal(conn, d.silo_id, dv, dr, dd)
            await conn.execute(
                Q["charge_row_set"],
                d.instance_id,
                d.generation,
                held["vcpus"],
                held["ram_bytes"],
                held["disk_bytes"],
                Outcome.refused.value,
                reason,
            )
            result = Applied(Outcome.refused, reason)
        else:
            telemetry.count("deltas.applied")
            await conn.execute(
                Q["charge_row_set"],
                d.instance_id,
                d.generation,
                d.vcpus,
                d.ram_bytes,
                d.disk_bytes,
                Outcome.applied.value,
                "",
            )
            if dv or dr or dd:
                await append_history(
                    conn,
                    [
                        ("silo", d.silo_id, d.silo_id, *_totals(totals, "silo")),
                        ("project", d.project_id, d.silo_id, *_totals(totals, "project")),
                    ],
                )
                await enqueue(
                    conn,
                    subjects.event(silo, "usage", "changed"),
                    UsageChanged(
                        silo_id=d.silo_id,
                        project_id=d.project_id,
                        silo=_usage(totals, "silo"),
                        project=_usage(totals, "project"),
                    ),
                    source=SOURCE,
                )
            result = Applied(Outcome.applied, "")

    await enqueue(
        conn,
        subjects.event(silo, "provision", "outcome"),
        ProvisionOutcome(
            instance_id=d.instance_id, generation=d.generation, outcome=result.outcome, reason=result.reason
        ),
        source=SOURCE,
        key=f"outcome:{d.instance_id}:{d.generation}",
    )
    return result


async def check_owner(conn: asyncpg.Connection, silo: str, project: str, d: ProvisionDelta) -> None:
    """The subject's silo and project are the delta's, and the project is the silo's: the names in a
    subject decide who may publish it (the broker's permissions), the ids decide what is charged, so the
    two must agree. Raises UnknownSilo / UnknownProject while their creation has not arrived."""
    silo_name = await conn.fetchval(Q["silo_name"], d.silo_id)
    if silo_name is None:
        raise UnknownSilo(str(d.silo_id))
    if silo_name != silo:
        raise Forged(f"subject names silo {silo}, but silo {d.silo_id} is {silo_name}")
    p = await conn.fetchrow(Q["project_owner"], d.project_id)
    if p is None:
        raise UnknownProject(str(d.project_id))
    if p["silo_id"] != d.silo_id:
        raise Forged(f"project {d.project_id} belongs to silo {p['silo_name']}, not to {silo}")
    if p["name"] is not None and p["name"] != project:
        raise Forged(f"subject names project {project}, but project {d.project_id} is {p['name']}")


def _totals(row: asyncpg.Record, prefix: str) -> tuple[int, int, int]:
    return row[f"{prefix}_vcpus"], row[f"{prefix}_ram_bytes"], row[f"{prefix}_disk_bytes"]


def _usage(row: asyncpg.Record, prefix: str) -> Usage:
    return Usage(
        vcpus=row[f"{prefix}_vcpus"],
        ram_bytes=row[f"{prefix}_ram_bytes"],
        disk_bytes=row[f"{prefix}_disk_bytes"],
    )


async def refusal(conn: asyncpg.Connection, silo_id: object, dv: int, dr: int, dd: int) -> str:
    """Name the quota that refused the charge, with what is used and what was asked."""
    s = await conn.fetchrow(Q["silo_get"], silo_id)
    checks = [
        ("vCPU", dv, s["vcpus"], s["quota_vcpus"], 1, ""),
        ("RAM", dr, s["ram_bytes"], s["quota_ram_bytes"], GiB, " GiB"),
        ("storage", dd, s["disk_bytes"], s["quota_disk_bytes"], GiB, " GiB"),
    ]
    for name, asked, used, quota, unit, suffix in checks:
        if asked > 0 and quota is not None and used + asked > quota:
            return (
                f"{name} quota exceeded: {used / unit:g}{suffix} of {quota / unit:g}{suffix} used, "
                f"{asked / unit:g}{suffix} asked"
            )
    fleet = await conn.fetchrow(Q["fleet_get"])
    for name, asked, key in (("vCPU", dv, "vcpus"), ("RAM", dr, "ram_bytes"), ("storage", dd, "disk_bytes")):
        if asked > 0 and fleet[key] + asked > MAX_TOTAL:
            return f"{name} total of the fleet would pass its limit ({MAX_TOTAL})"
    return "quota exceeded"
