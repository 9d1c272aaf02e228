"""`rackctl usage audit`: quiet on a rack whose ledger holds, and exact about a drift made on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.client import Client
from rackctl.invariants.audit import Drift, Resources, exact_size
from tests.conftest import GiB, unique, usage_is, wait_state
from tests.test_cli import Run, assert_ok, rackctl

SHAPE = {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB}


async def audit(stack: Stack, *args: str) -> Run:
    assert stack.database_url is not None
    return await rackctl(stack, "usage", "audit", *args, "--database-url", stack.database_url)


@pytest.fixture
async def admin(stack: Stack) -> AsyncIterator[asyncpg.Connection]:
    """A superuser connection: the auditor's own role is read-only."""
    conn = await asyncpg.connect(stack.admin_database_url)
    yield conn
    await conn.close()


@pytest.fixture
async def rack_with_two(client: Client) -> tuple[str, str, str]:
    """A silo and project with `web-1` running and `web-2` stopped again; the id of `web-1`."""
    silo, proj = unique("audit"), unique("proj")
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    web1 = await client.instance_create(silo, proj, "web-1", **SHAPE)
    await client.instance_create(silo, proj, "web-2", **SHAPE)
    for name in ("web-1", "web-2"):
        await client.instance("start", silo, proj, name)
    for name in ("web-1", "web-2"):
        await wait_state(client, silo, proj, name, "running")
    await client.instance("stop", silo, proj, "web-2")
    await wait_state(client, silo, proj, "web-2", "stopped")
    await usage_is(client, {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 20 * GiB}, silo, proj)
    return silo, proj, web1["id"]


def test_sizes_are_shown_exactly() -> None:
    assert [exact_size(n) for n in (0, 512, 4 * GiB, 4 * GiB + 1, 1536 * 2**20)] == [
        "0 B",
        "512 B",
        "4 GiB",
        f"{4 * GiB + 1} B",
        "1536 MiB",
    ]
    drift = Drift("silo", None, "acme", Resources(1, 0, GiB), Resources(0, 0, GiB))
    assert drift.line() == "silo acme: totals (vcpus=1 ram=0 B disk=1 GiB) != sum of its charges " + (
        "(vcpus=0 ram=0 B disk=1 GiB)"
    )


async def test_a_ledger_that_holds_has_no_drift(stack: Stack, rack_with_two: tuple[str, str, str]) -> None:
    silo, proj, _ = rack_with_two
    for scope in ((), (silo,), (f"{silo}/{proj}",)):
        r = await audit(stack, *scope)
        assert_ok(r)
        assert r.out.splitlines()[-1] == "no drift", r
    r = await audit(stack, silo, "--json")
    assert_ok(r)
    assert r.json() == {"scope": silo, "ok": True, "drifts": []}


async def test_an_overcharged_instance_is_named_with_every_total_it_throws_off(
    stack: Stack, admin: asyncpg.Connection, rack_with_two: tuple[str, str, str]
) -> None:
    silo, proj, web1 = rack_with_two
    bump = "UPDATE accounting.instance_charges SET vcpus = vcpus + $2 WHERE instance_id = $1::uuid"
    await admin.execute(bump, web1, 1)
    try:
        instance = (
            f"instance web-1 ({web1}) in {silo}/{proj} is running: "
            "charged vcpus=3 ram=4 GiB disk=10 GiB, should be vcpus=2 ram=4 GiB disk=10 GiB"
        )
        project = (
            f"project {silo}/{proj}: totals (vcpus=2 ram=4 GiB disk=20 GiB) != "
            "sum of its charges (vcpus=3 ram=4 GiB disk=20 GiB)"
        )
        silo_line = (
            f"silo {silo}: totals (vcpus=2 ram=4 GiB disk=20 GiB) != "
            "sum of its charges (vcpus=3 ram=4 GiB disk=20 GiB)"
        )
        r = await audit(stack, silo, "--settle", "0")
        assert r.code == 1, r
        assert r.out.splitlines() == [project, silo_line, instance, "3 drifts"]
        assert r.err.splitlines() == [f"rackctl: error: 3 drifts in the usage of {silo}"]

        r = await audit(stack, "--settle", "0")
        assert r.code == 1, r
        out = r.out.splitlines()  # fleet-wide, the fleet's total is thrown off as well
        assert out[:2] == [project, silo_line] and out[3:] == [instance, "4 drifts"], r
        assert out[2].startswith("fleet: sum of silo totals (") and "!= sum of all charges (" in out[2]

        r = await audit(stack, f"{silo}/{proj}", "--settle", "0", "--json")
        assert r.code == 1, r
        data = r.json()
        assert data["scope"] == f"{silo}/{proj}" and not data["ok"]
        assert [(d["level"], d["name"]) for d in data["drifts"]] == [
            ("project", f"{silo}/{proj}"),
            ("instance", "web-1"),
        ]
        [charge] = [d for d in data["drifts"] if d["level"] == "instance"]
        assert charge == {
            "level": "instance",
            "id": web1,
            "name": "web-1",
            "held": {"vcpus": 3, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB},
            "expected": {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB},
            "state": "running",
            "silo": silo,
            "project": proj,
        }

        assert stack.database_url is not None
        r = await rackctl(stack, "check", "--database-url", stack.database_url, "--settle", "0")
        assert r.code == 1, r
        assert {instance, project, silo_line} <= set(r.out.splitlines())
    finally:
        await admin.execute(bump, web1, -1)
    assert_ok(await audit(stack))


async def test_a_silo_total_off_its_charges_is_a_silo_and_a_fleet_drift(
    stack: Stack, admin: asyncpg.Connection, rack_with_two: tuple[str, str, str]
) -> None:
    silo, _, _ = rack_with_two
    corrupt = "UPDATE accounting.silos SET disk_bytes = disk_bytes + $2 WHERE name = $1"
    await admin.execute(corrupt, silo, GiB)
    try:
        r = await audit(stack, "--settle", "0")
        assert r.code == 1, r
        silo_line, fleet, last = r.out.splitlines()
        assert silo_line == (
            f"silo {silo}: totals (vcpus=2 ram=4 GiB disk=21 GiB) != "
            "sum of its charges (vcpus=2 ram=4 GiB disk=20 GiB)"
        )
        assert fleet.startswith("fleet: sum of silo totals (") and last == "2 drifts"
        data = (await audit(stack, "--settle", "0", "--json")).json()
        [f] = [d for d in data["drifts"] if d["level"] == "fleet"]
        assert f["held"]["disk_bytes"] == f["expected"]["disk_bytes"] + GiB

        assert stack.database_url is not None
        r = await rackctl(stack, "check", "--database-url", stack.database_url, "--no-at-rest")
        assert r.code == 1, r
        assert r.out.splitlines() == [silo_line, fleet]
    finally:
        await admin.execute(corrupt, silo, -GiB)
    assert_ok(await audit(stack, silo))


async def test_a_drift_that_clears_itself_within_the_settle_time_is_not_reported(
    stack: Stack, admin: asyncpg.Connection, rack_with_two: tuple[str, str, str]
) -> None:
    silo, _, web1 = rack_with_two
    bump = "UPDATE accounting.instance_charges SET ram_bytes = ram_bytes + $2 WHERE instance_id = $1::uuid"
    await admin.execute(bump, web1, GiB)
    try:
        running = asyncio.create_task(audit(stack, silo, "--settle", "20"))
        await asyncio.sleep(2)
        assert not running.done()
    finally:
        await admin.execute(bump, web1, -GiB)
    r = await running
    assert_ok(r)
    assert r.out == "no drift\n"


async def test_an_unknown_scope_is_one_line_and_exit_2(stack: Stack, client: Client) -> None:
    r = await audit(stack, "no-such-silo")
    assert (r.code, r.out, r.err) == (2, "", "rackctl: error: no silo 'no-such-silo'\n")
    silo = unique("audit")
    await client.silo_create(silo)
    r = await audit(stack, f"{silo}/nope")
    assert (r.code, r.out, r.err) == (2, "", f"rackctl: error: no project 'nope' in silo '{silo}'\n")
