"""Pruning: finished sagas, old charge outcomes and ended VMM records go once older than the retention;
what the fences, the unfinished sagas and the checker need stays. A stack of its own, with a retention of
seconds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from rackctl.client import Client
from rackctl.invariants import check
from shared.config import ConfigError, Settings
from tests.conftest import GiB, assert_invariants, counter, eventually, private_rack, unique, wait_state

RETENTION = 5.0
ROOT = Path(__file__).resolve().parent.parent


async def cycle(client: Client, silo: str, proj: str, name: str, times: int) -> None:
    """Start and stop the instance `times` times: a finished saga, outcomes and an ended VMM each time."""
    for _ in range(times):
        await client.instance("start", silo, proj, name)
        await wait_state(client, silo, proj, name, "running")
        await client.instance("stop", silo, proj, name)
        await wait_state(client, silo, proj, name, "stopped")


async def rows(admin: asyncpg.Connection, instance_id: uuid.UUID) -> dict[str, Any]:
    """What instance-manager holds about one instance."""
    iid = str(instance_id)
    return {
        "sagas": {
            r["id"]
            for r in await admin.fetch(
                "SELECT id FROM instance_manager.sagas WHERE params->>'instance_id' = $1", iid
            )
        },
        "outcomes": sorted(
            r["generation"]
            for r in await admin.fetch(
                "SELECT generation FROM instance_manager.charge_outcomes WHERE instance_id = $1", instance_id
            )
        ),
        "vmms": [
            r["id"]
            for r in await admin.fetch(
                "SELECT id FROM instance_manager.vmms WHERE instance_id = $1 ORDER BY created_at, id",
                instance_id,
            )
        ],
    }


async def test_old_rows_go_and_what_the_fences_need_stays() -> None:
    env = {"RACKPLANE_SLEDS": "2", "RACKPLANE_RETENTION": f"{RETENTION:g}s", "RACKPLANE_PRUNE_INTERVAL": "1"}
    async with private_rack("prune", **env) as (stack, client, db):
        admin = await asyncpg.connect(stack.admin_database_url)
        held = await asyncpg.connect(stack.admin_database_url)
        try:
            silo, proj = unique("silo"), unique("proj")
            await client.silo_create(silo)
            await client.project_create(silo, proj)
            for n in ("cycled", "held", "runs", "gone"):
                await client.instance_create(silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
            ids = {
                n: uuid.UUID((await client.instance("show", silo, proj, n))["id"])
                for n in ("cycled", "held", "runs", "gone")
            }
            await asyncio.gather(
                cycle(client, silo, proj, "cycled", 3),
                cycle(client, silo, proj, "held", 2),
                cycle(client, silo, proj, "gone", 1),
            )
            await client.instance("delete", silo, proj, "gone")
            await client.instance("start", silo, proj, "runs")
            runs = await wait_state(client, silo, proj, "runs", "running")

            # Every charge's outcome is in (the delete's release answers after the reply), so that the
            # snapshot below holds each instance's latest.
            async def settled() -> bool:
                return not await admin.fetchval(
                    "SELECT count(*) FROM instance_manager.pending_charges "
                    "WHERE instance_id = ANY($1::uuid[])",
                    list(ids.values()),
                )

            await eventually(settled, timeout=15)

            # An unfinished saga about "held" that names its first (ended) VMM, run by nobody: this test
            # holds the saga's lock, so the service passes it over.
            before = {n: await rows(admin, i) for n, i in ids.items()}
            assert len(before["cycled"]["vmms"]) == 3 and len(before["held"]["vmms"]) == 2
            pinned_vmm = before["held"]["vmms"][0]
            saga_id = uuid.uuid4()
            assert await held.fetchval(
                "SELECT pg_try_advisory_lock($1)", int.from_bytes(saga_id.bytes[:8], "big", signed=True)
            )
            await admin.execute(
                "INSERT INTO instance_manager.sagas (id, kind, params, data, status, cursor) "
                "VALUES ($1, 'instance-start', $2::jsonb, $3::jsonb, 'running', 1)",
                saga_id,
                json.dumps({"instance_id": str(ids["held"])}),
                json.dumps({"vmm_id": str(pinned_vmm)}),
            )

            await asyncio.sleep(RETENTION + 3)  # every record is past the retention, and a pass has run since
            await eventually(lambda: counter(client, "instance-manager", "pruned.vmms"), timeout=15)
            after = {n: await rows(admin, i) for n, i in ids.items()}
            # The delete's change of the silo's instance count, which no create came to fold, is folded.
            unfolded = await admin.fetchval(
                "SELECT count(*) FROM instance_manager.silo_instance_changes c "
                "JOIN instance_manager.silos s ON s.id = c.silo_id WHERE s.name = $1",
                silo,
            )
            assert unfolded == 0
            assert await counter(client, "instance-manager", "pruned.silo_instance_changes") > 0

            # Finished sagas and their events are gone; the unfinished one stays.
            for n in ("cycled", "runs", "gone"):
                assert not after[n]["sagas"], n
            assert after["held"]["sagas"] == {saga_id}
            orphan_events = await admin.fetchval(
                "SELECT count(*) FROM instance_manager.saga_events WHERE saga_id = ANY($1::uuid[])",
                list(before["cycled"]["sagas"] | before["gone"]["sagas"]),
            )
            assert orphan_events == 0
            # Old outcomes go, each instance's latest stays; an instance a saga works on keeps them all.
            for n in ("cycled", "runs", "gone"):
                assert after[n]["outcomes"] == before[n]["outcomes"][-1:], n
            assert after["held"]["outcomes"] == before["held"]["outcomes"]
            # Ended VMMs go, except each instance's latest, the running one's, and the one the saga names.
            assert after["cycled"]["vmms"] == before["cycled"]["vmms"][-1:]
            assert after["gone"]["vmms"] == before["gone"]["vmms"]
            assert [str(v) for v in after["runs"]["vmms"]] == [runs["active_vmm_id"]]
            assert after["held"]["vmms"] == before["held"]["vmms"]
            horizon = await admin.fetchval(
                "SELECT at FROM instance_manager.pruned_before WHERE what = 'vmms'"
            )
            assert horizon is not None
            assert await counter(client, "instance-manager", "pruned.sagas") >= 7
            assert await counter(client, "instance-manager", "pruned.saga_events") > 0
            assert await counter(client, "instance-manager", "pruned.charge_outcomes") > 0

            # Once the saga has finished long enough ago, what it pinned goes too.
            await admin.execute(
                "UPDATE instance_manager.sagas SET status = 'failed', updated_at = now() - interval '1 hour' "
                "WHERE id = $1",
                saga_id,
            )
            await held.close()

            async def released() -> bool:
                now = await rows(admin, ids["held"])
                return not now["sagas"] and now["vmms"] == before["held"]["vmms"][-1:]

            await eventually(released, timeout=15)
            assert (await rows(admin, ids["held"]))["outcomes"] == before["held"]["outcomes"][-1:]

            # Everything still works, and the checker finds nothing.
            await cycle(client, silo, proj, "cycled", 1)
            await client.instance("stop", silo, proj, "runs")
            await wait_state(client, silo, proj, "runs", "stopped")
            await client.instance("start", silo, proj, "held")
            await wait_state(client, silo, proj, "held", "running")
            await assert_invariants(db)
            async with db.acquire() as conn:
                assert await check(conn, at_rest=True, js=client.nc.jetstream(), nc=client.nc) == []
        finally:
            await admin.close()
            if not held.is_closed():
                await held.close()


def test_a_duration_is_seconds_or_a_number_with_a_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, seconds in (("90", 90.0), ("1.5", 1.5), ("30m", 1800.0), ("12h", 43200.0), ("7d", 604800.0)):
        monkeypatch.setenv("RACKPLANE_RETENTION", raw)
        assert Settings.from_env().retention == seconds
    monkeypatch.delenv("RACKPLANE_RETENTION")
    assert Settings.from_env().retention == 604800.0
    for raw in ("soon", "-1", "0", "7 days", "inf", "1e3"):
        monkeypatch.setenv("RACKPLANE_RETENTION", raw)
        with pytest.raises(ConfigError, match="RACKPLANE_RETENTION"):
            Settings.from_env()


def test_a_bad_retention_stops_instance_manager_with_one_line_naming_it() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RACKPLANE_RETENTION": "a week",
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "NATS_URL": "nats://127.0.0.1:1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.instance_manager"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "RACKPLANE_RETENTION" in lines[0] and "'a week'" in lines[0]
