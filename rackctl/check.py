"""The invariant checker: reads every service's tables and lists what does not hold.

It is an auditor, so unlike the services it reads across schemas (read-only). Each check returns one line
per violation; an empty list means the invariant holds. Checks marked "at rest" hold only once the system
is quiet (no saga or message in flight).
"""

from __future__ import annotations

import asyncpg

from shared.messages import CHARGED_STATES


async def totals_match_ledger(conn: asyncpg.Connection) -> list[str]:
    """Project, silo and fleet totals equal the sums of the per-instance charges, and are never negative."""
    out: list[str] = []
    for level, table, key in (("project", "projects", "project_id"), ("silo", "silos", "silo_id")):
        rows = await conn.fetch(
            f"""
            SELECT t.id, t.vcpus, t.ram_bytes, t.disk_bytes,
                   coalesce(sum(c.vcpus), 0) AS c_vcpus, coalesce(sum(c.ram_bytes), 0) AS c_ram,
                   coalesce(sum(c.disk_bytes), 0) AS c_disk
            FROM accounting.{table} t LEFT JOIN accounting.instance_charges c ON c.{key} = t.id
            GROUP BY t.id
            """
        )
        for r in rows:
            if (r["vcpus"], r["ram_bytes"], r["disk_bytes"]) != (r["c_vcpus"], r["c_ram"], r["c_disk"]):
                out.append(
                    f"{level} {r['id']}: totals ({r['vcpus']}, {r['ram_bytes']}, {r['disk_bytes']}) != "
                    f"charges ({r['c_vcpus']}, {r['c_ram']}, {r['c_disk']})"
                )
    fleet = await conn.fetchrow(
        """
        SELECT f.vcpus, f.ram_bytes, f.disk_bytes,
               (SELECT coalesce(sum(vcpus), 0) FROM accounting.instance_charges) AS c_vcpus,
               (SELECT coalesce(sum(ram_bytes), 0) FROM accounting.instance_charges) AS c_ram,
               (SELECT coalesce(sum(disk_bytes), 0) FROM accounting.instance_charges) AS c_disk
        FROM accounting.fleet f
        """
    )
    if (fleet["vcpus"], fleet["ram_bytes"], fleet["disk_bytes"]) != (
        fleet["c_vcpus"],
        fleet["c_ram"],
        fleet["c_disk"],
    ):
        out.append(f"fleet totals {tuple(fleet)[:3]} != charges {tuple(fleet)[3:]}")
    return out


async def quotas_respected(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(
        """
        SELECT name, vcpus, quota_vcpus, ram_bytes, quota_ram_bytes, disk_bytes, quota_disk_bytes
        FROM accounting.silos
        WHERE vcpus > quota_vcpus OR ram_bytes > quota_ram_bytes OR disk_bytes > quota_disk_bytes
        """
    )
    return [f"silo {r['name']} exceeds its quota: {dict(r)}" for r in rows]


async def charges_follow_instances(conn: asyncpg.Connection) -> list[str]:
    """At rest: an instance holds a vCPU/RAM charge iff it has a live VMM, and its disk iff it exists."""
    rows = await conn.fetch(
        """
        SELECT i.id, i.name, i.state, i.vcpus, i.ram_bytes, i.disk_bytes, i.active_vmm_id,
               c.vcpus AS c_vcpus, c.ram_bytes AS c_ram, c.disk_bytes AS c_disk
        FROM instance_manager.instances i
        LEFT JOIN accounting.instance_charges c ON c.instance_id = i.id
        WHERE i.state <> 'creating'
        """
    )
    out = []
    for r in rows:
        live = r["state"] in CHARGED_STATES
        want = (
            r["vcpus"] if live else 0,
            r["ram_bytes"] if live else 0,
            0 if r["state"] == "destroyed" else r["disk_bytes"],
        )
        have = (r["c_vcpus"] or 0, r["c_ram"] or 0, r["c_disk"] or 0)
        if want != have:
            out.append(f"instance {r['name']} ({r['id']}) is {r['state']}: charged {have}, should be {want}")
        if live != (r["active_vmm_id"] is not None):
            out.append(
                f"instance {r['name']} ({r['id']}) is {r['state']} with active VMM {r['active_vmm_id']}"
            )
    return out


async def reservations_match_vmms(conn: asyncpg.Connection) -> list[str]:
    """Each sled's reservation equals the sum over its live VMMs, within its capacity."""
    rows = await conn.fetch(
        """
        SELECT s.id, s.reserved_vcpus, s.reserved_ram_bytes, s.vcpus, s.ram_bytes,
               coalesce(sum(v.vcpus), 0) AS v_vcpus, coalesce(sum(v.ram_bytes), 0) AS v_ram
        FROM instance_manager.sleds s
        LEFT JOIN instance_manager.vmms v ON v.sled_id = s.id AND v.ended_at IS NULL
        GROUP BY s.id
        """
    )
    return [
        f"sled {r['id']}: reserved ({r['reserved_vcpus']}, {r['reserved_ram_bytes']}) != "
        f"live VMMs ({r['v_vcpus']}, {r['v_ram']})"
        for r in rows
        if (r["reserved_vcpus"], r["reserved_ram_bytes"]) != (r["v_vcpus"], r["v_ram"])
    ]


async def one_live_vmm(conn: asyncpg.Connection) -> list[str]:
    """No instance has two live VMMs (outside a migration)."""
    rows = await conn.fetch(
        """
        SELECT instance_id, count(*) AS n FROM instance_manager.vmms
        WHERE ended_at IS NULL GROUP BY instance_id HAVING count(*) > 1
        """
    )
    return [f"instance {r['instance_id']} has {r['n']} live VMMs" for r in rows]


async def no_unfinished_sagas(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(
        "SELECT id, kind, status FROM instance_manager.sagas WHERE status IN ('running', 'unwinding')"
    )
    return [f"saga {r['kind']} {r['id']} still {r['status']}" for r in rows]


ALWAYS = (totals_match_ledger, quotas_respected, one_live_vmm)
AT_REST = (charges_follow_instances, reservations_match_vmms, no_unfinished_sagas)


async def check(conn: asyncpg.Connection, *, at_rest: bool = True) -> list[str]:
    out: list[str] = []
    for f in ALWAYS + (AT_REST if at_rest else ()):
        out += await f(conn)
    return out
