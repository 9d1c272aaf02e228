"""Usage over time: every change of a silo's or project's totals is kept (usage_history), the fleet's is
their sum, `rp.cmd.<silo>.usage.history` compacts it into intervals, and `rackctl usage history` and
`usage plot` show it; against the session's real broker and database."""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.client import Client
from services.accounting.history import append_history
from shared import bus
from shared.messages import Quota
from tests.conftest import GiB, eventually, unique, usage_is, wait_state
from tests.test_cli import assert_ok, assert_one_error, rackctl, rackctl_offline
from tests.test_security import _with_silo_operator

QUOTA = Quota(vcpus=4, ram_bytes=8 * GiB, disk_bytes=40 * GiB)
A = {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB}
B = {"vcpus": 1, "ram_bytes": 2 * GiB, "disk_bytes": 5 * GiB}
STEPS: list[tuple[str, str, tuple[int, int, int]]] = [
    ("create", "a", (0, 0, 10 * GiB)),
    ("start", "a", (2, 4 * GiB, 10 * GiB)),
    ("create", "b", (2, 4 * GiB, 15 * GiB)),
    ("start", "b", (3, 6 * GiB, 15 * GiB)),
    ("stop", "a", (1, 2 * GiB, 15 * GiB)),
    ("stop", "b", (0, 0, 15 * GiB)),
]
"""What the project (and its silo, its only one) holds after each step."""
KEYS = ("vcpus", "ram_bytes", "disk_bytes")


def lasts(h: dict[str, Any]) -> list[tuple[int, ...]]:
    """The levels a history went through, each once: its start, then each interval's last that moved."""
    seen = [tuple(h["start"][k] for k in KEYS)]
    for p in h["points"]:
        level = tuple(p[k]["last"] for k in KEYS)
        if level != seen[-1]:
            seen.append(level)
    return seen


@pytest.fixture(scope="module")
async def busy(client: Client) -> tuple[str, str]:
    """A silo with quotas and one project, whose instances were created, started and stopped, each step
    landed before the next (half a second apart, so that each falls in an interval of its own)."""
    silo, proj = unique("hist"), unique("proj")
    await client.silo_create(silo, QUOTA)
    await client.project_create(silo, proj)
    for verb, name, level in STEPS:
        if verb == "create":
            await client.instance_create(silo, proj, name, **(A if name == "a" else B))
        else:
            await client.instance(verb, silo, proj, name)
            await wait_state(client, silo, proj, name, "running" if verb == "start" else "stopped")
        await usage_is(client, dict(zip(KEYS, level, strict=True)), silo, proj)
        await asyncio.sleep(0.5)
    return silo, proj


async def test_each_change_is_kept_in_order(busy: tuple[str, str], db: asyncpg.Pool) -> None:
    silo, _ = busy
    silo_id = await db.fetchval("SELECT id FROM accounting.silos WHERE name = $1", silo)
    for scope in ("project", "silo"):
        rows = await db.fetch(
            "SELECT at, vcpus, ram_bytes, disk_bytes FROM accounting.usage_history "
            "WHERE scope = $1 AND silo_id = $2 ORDER BY seq",
            scope,
            silo_id,
        )
        assert [tuple(r[k] for k in KEYS) for r in rows] == [level for _, _, level in STEPS]
        assert [r["at"] for r in rows] == sorted(r["at"] for r in rows)


async def test_history_shows_the_changes_for_project_silo_and_fleet(
    stack: Stack, busy: tuple[str, str], db: asyncpg.Pool
) -> None:
    silo, proj = busy
    expected = [(0, 0, 0), *(level for _, _, level in STEPS)]
    window = ("--since", "2m", "--buckets", "500", "--json")
    r = await rackctl(stack, "usage", "history", f"{silo}/{proj}", *window)
    assert_ok(r)
    project = r.json()
    assert (project["scope"], project["name"], project["quota"]) == ("project", f"{silo}/{proj}", None)
    assert len(project["points"]) == 500 and lasts(project) == expected
    r = await rackctl(stack, "usage", "history", silo, *window)
    assert_ok(r)
    silo_history = r.json()
    assert silo_history["scope"] == "silo" and lasts(silo_history) == expected
    assert silo_history["quota"] == {"vcpus": 4, "ram_bytes": 8 * GiB, "disk_bytes": 40 * GiB}
    peak = {k: max(p[k]["max"] for p in silo_history["points"]) for k in KEYS}
    assert peak == {"vcpus": 3, "ram_bytes": 6 * GiB, "disk_bytes": 15 * GiB}

    r = await rackctl(stack, "usage", "history", "fleet", *window)
    assert_ok(r)
    fleet = r.json()
    assert fleet["scope"] == "fleet" and fleet["quota"] is None
    assert fleet_levels(fleet, await silo_rows(db)) == [
        tuple(fleet["start"][k] for k in KEYS),
        *(tuple(p[k]["last"] for k in KEYS) for p in fleet["points"]),
    ]
    now = await db.fetch("SELECT vcpus, ram_bytes, disk_bytes FROM accounting.silos")
    assert tuple(fleet["points"][-1][k]["last"] for k in KEYS) == tuple(sum(s[k] for s in now) for k in KEYS)

    r = await rackctl(stack, "usage", "history", silo, "--since", "2m", "--buckets", "4")
    assert_ok(r)
    lines = r.out.splitlines()
    assert lines[0] == f"silo {silo}" and lines[1] == "quota: vCPUs 4, RAM 8 GiB, storage 40 GiB"
    assert lines[2].split() == ["UNTIL", "(UTC)", "VCPUS", "RAM", "GIB", "STORAGE", "GIB"]
    assert len(lines) == 3 + 4
    cells = re.split(r"\s{2,}", lines[-1])  # each: the last level, and the range when it moved: `0 (0-3)`
    assert [c.split()[0] for c in cells[1:]] == ["0", "0", "15"]


async def silo_rows(db: asyncpg.Pool) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT at, seq, id, vcpus, ram_bytes, disk_bytes FROM accounting.usage_history "
        "WHERE scope = 'silo' ORDER BY at, seq"
    )


def fleet_levels(h: dict[str, Any], rows: list[asyncpg.Record]) -> list[tuple[int, ...]]:
    """The fleet's level at the start and at the end of each interval, worked out here from every silo's
    rows: the sum of each silo's latest."""
    since, until = datetime.fromisoformat(h["since"]), datetime.fromisoformat(h["until"])
    width, n = h["bucket_seconds"], len(h["points"])
    latest: dict[uuid.UUID, tuple[int, ...]] = {}
    out: list[tuple[int, ...]] = []

    def level() -> tuple[int, ...]:
        return tuple(sum(v[i] for v in latest.values()) for i in range(3))

    rows = [r for r in rows if r["at"] <= until]  # what the reply could see
    for edge in range(-1, n):  # -1: everything before `since`
        while rows:
            r = rows[0]
            bucket = (
                -1 if r["at"] < since else min(math.floor((r["at"] - since).total_seconds() / width), n - 1)
            )
            if bucket > edge:
                break
            latest[r["id"]] = tuple(r[k] for k in KEYS)
            rows.pop(0)
        out.append(level())
    return out


async def test_plot_draws_three_panels_against_the_quota(
    stack: Stack, client: Client, busy: tuple[str, str], tmp_path: Path
) -> None:
    import matplotlib.image

    from rackctl.plot import usage_figure

    silo, _ = busy
    fig = usage_figure(await client.usage_history(silo, since_seconds=120))
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["vCPUs", "RAM (GiB)", "storage (GiB)"]
    assert axes[-1].get_xlabel() == "time (UTC)" and fig.get_suptitle().startswith(f"Usage of silo {silo}")
    for ax, quota in zip(axes, (4, 8, 40), strict=True):
        labels = ax.get_legend_handles_labels()[1]
        assert "quota" in labels and "used (last)" in labels
        (line,) = [x for x in ax.get_lines() if x.get_label() == "quota"]
        assert list(line.get_ydata()) == [quota, quota]

    out = tmp_path / "usage.png"
    r = await rackctl(stack, "usage", "plot", silo, "--since", "2m", "--out", str(out))
    assert_ok(r)
    assert r.out.strip() == f"wrote {out}"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (800, 1000)
    assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas

    # a project has no quota: no quota line
    fig = usage_figure(await client.usage_history(*busy, since_seconds=120))
    assert all("quota" not in ax.get_legend_handles_labels()[1] for ax in fig.get_axes())


async def test_a_quiet_scope_carries_its_level_in_from_before(stack: Stack, client: Client) -> None:
    """A project whose last change is older than the window: every interval holds that level."""
    silo, proj = unique("hist"), unique("proj")
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}, silo, proj)
    admin = await asyncpg.connect(stack.admin_database_url)
    try:  # a change two hours ago, written here as accounting would have (a project's row only)
        await admin.execute(
            "INSERT INTO accounting.usage_history (at, scope, id, silo_id, vcpus, ram_bytes, disk_bytes) "
            "SELECT now() - interval '2 hours', 'project', p.id, p.silo_id, 1, $3, $4 "
            "FROM accounting.projects p JOIN accounting.silos s ON s.id = p.silo_id "
            "WHERE s.name = $1 AND p.name = $2",
            silo,
            proj,
            GiB,
            5 * GiB,
        )
    finally:
        await admin.close()
    h = await client.usage_history(silo, proj, since_seconds=3600, buckets=6)
    level = {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 5 * GiB}
    assert h["start"] == level and len(h["points"]) == 6
    for p in h["points"]:
        assert {k: p[k] for k in KEYS} == {k: {"min": v, "max": v, "last": v} for k, v in level.items()}
    assert (await client.usage_history(silo, proj, since_seconds=3 * 3600, buckets=3))["start"] == {
        k: 0 for k in KEYS
    }


async def test_unknown_or_bad_scopes_are_one_line(stack: Stack, client: Client) -> None:
    assert_one_error(await rackctl(stack, "usage", "history", "no-such-silo"), "no silo no-such-silo")
    silo = unique("hist")
    await client.silo_create(silo)

    async def accounting_knows_it() -> bool:  # it learns of a silo from the event, a moment later
        try:
            return await client.usage_history(silo) is not None
        except bus.CommandError:
            return False

    await eventually(accounting_knows_it)
    assert_one_error(
        await rackctl(stack, "usage", "plot", f"{silo}/nope", "--out", "x.png"), f"no project {silo}/nope"
    )
    with pytest.raises(bus.CommandError) as e:
        await client.usage_history("no-such-silo")
    assert e.value.code == "not_found"
    for args in (
        ("Bad",),
        ("a/b/c",),
        ("fleet", "--since", "3y"),
        ("fleet", "--since", "10s"),
        ("fleet", "--buckets", "0"),
    ):
        r = rackctl_offline("usage", "history", *args)
        assert r.code == 2 and r.out == "" and "Traceback" not in r.err, r
        assert r.err.splitlines()[-1].startswith("rackctl usage history: error: "), r.err
    r = rackctl_offline("usage", "plot", "fleet")
    assert r.code == 2 and "--out" in r.err.splitlines()[-1]


async def test_a_silo_operator_sees_the_history_of_its_silo_only(stack: Stack, client: Client) -> None:
    mine, theirs = unique("hist"), unique("hist")
    for silo in (mine, theirs):
        await client.silo_create(silo)
    _with_silo_operator(stack, mine)
    assert stack.security is not None
    context = stack.security.write_context(f"op-{mine}", f"silo-operator-{mine}", stack.nats_url or "")
    op = await Client.connect(stack.nats_url, timeout=5, context=str(context))
    try:
        assert (await op.usage_history(mine))["name"] == mine
        for call in (op.usage_history(theirs), op.usage_history(None)):
            with pytest.raises(bus.CommandError) as refused:
                await call
            assert refused.value.code == "forbidden", refused.value
    finally:
        await op.close()


async def test_the_service_role_appends_and_the_checker_only_reads(stack: Stack, db: asyncpg.Pool) -> None:
    conn = await asyncpg.connect(
        stack.service_database_urls["accounting"], server_settings={"search_path": "accounting"}
    )
    try:
        tr = conn.transaction()
        await tr.start()
        try:
            ids = [uuid.uuid4(), uuid.uuid4()]
            await append_history(
                conn, [("silo", ids[0], ids[0], 1, 2, 3), ("project", ids[1], ids[0], 1, 2, 3)]
            )
            assert await conn.fetchval("SELECT count(*) FROM usage_history WHERE silo_id = $1", ids[0]) == 2
        finally:
            await tr.rollback()
    finally:
        await conn.close()
    assert await db.fetchval("SELECT count(*) >= 0 FROM accounting.usage_history")
    with pytest.raises((asyncpg.InsufficientPrivilegeError, asyncpg.ReadOnlySQLTransactionError)):
        await db.execute(
            "INSERT INTO accounting.usage_history (scope, id, silo_id) VALUES ('silo', $1, $1)", uuid.uuid4()
        )
