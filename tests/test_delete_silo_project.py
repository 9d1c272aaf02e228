"""`silo delete` and `project delete`: refused, with what still lives inside, until nothing does;
then the row is marked deleted, the name free again, and the event told. A create racing a delete lands
either before it (the delete refused) or after it (not found), never inside a deleted project or silo;
and `python -m rackctl` runs and completes like `rackctl`."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats.errors
import pytest

from deploy.migrations import migrations_dir
from deploy.stack import Stack
from rackctl.client import Client
from services.instance_manager.base import Q
from services.instance_manager.pools import P
from shared.bus import CommandError
from shared.db import create_pool, migrate
from shared.messages import ProjectDeleted, Quota, SiloDeleted, SiloLimitsSet, decode
from tests.conftest import GiB, assert_invariants, eventually, unique
from tests.test_cli import ROOT, _env, assert_ok, rackctl


async def refused(call: Any, code: str) -> str:
    """The one-line message of a command refused with `code`."""
    with pytest.raises(CommandError) as e:
        await call
    assert e.value.code == code, e.value
    return e.value.message


async def events(client: Client, subject: str, expect: type) -> list[Any]:
    """Every event the EVENTS stream holds on `subject`, decoded."""
    sub = await client.nc.jetstream().subscribe(subject, ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return out
            _, event = decode(msg.data, expect)
            out.append(event)
    finally:
        await sub.unsubscribe()


async def new_instance(client: Client, silo: str, project: str, name: str) -> Any:
    return await client.instance_create(silo, project, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)


# --- through the control plane ----------------------------------------------------------------------------


async def test_a_project_is_deleted_only_once_nothing_lives_inside(client: Client) -> None:
    silo, proj = unique("del"), "web"
    await client.silo_create(silo)
    first = await client.project_create(silo, proj)
    await new_instance(client, silo, proj, "a")
    await new_instance(client, silo, proj, "b")
    await client.pool_create(silo, proj, "warm", size=0, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    message = await refused(client.project_delete(silo, proj), "conflict")
    assert message == f"project {silo}/{proj} still holds 2 instances and 1 pool"
    await client.instance("delete", silo, proj, "a")
    await client.instance("delete", silo, proj, "b")  # destroyed instances live no more
    message = await refused(client.project_delete(silo, proj), "conflict")
    assert message == f"project {silo}/{proj} still holds 1 pool"
    await client.pool("delete", silo, proj, "warm")

    deleted = await client.project_delete(silo, proj)
    assert deleted == {"id": first["id"], "silo": silo, "name": proj}
    assert await client.project_list(silo) == []
    assert "no project" in await refused(client.project_delete(silo, proj), "not_found")
    assert "no project" in await refused(new_instance(client, silo, proj, "c"), "not_found")
    assert "no project" in await refused(
        client.pool_create(silo, proj, "warm", size=0, vcpus=1, ram_bytes=GiB, disk_bytes=GiB), "not_found"
    )

    again = await client.project_create(silo, proj)  # the name is free: another project
    assert again["id"] != first["id"]
    assert (await new_instance(client, silo, proj, "a"))["name"] == "a"
    assert [p["id"] for p in await client.project_list(silo)] == [again["id"]]

    [told] = await events(client, f"rp.evt.{silo}.project.deleted", ProjectDeleted)
    assert (str(told.project_id), told.silo, told.name) == (first["id"], silo, proj)


async def test_a_silo_is_deleted_only_once_it_holds_no_project(client: Client, db: asyncpg.Pool) -> None:
    silo = unique("del")
    first = await client.silo_create(silo, Quota(vcpus=8))
    for p in ("db", "web", "api"):
        await client.project_create(silo, p)
    message = await refused(client.silo_delete(silo), "conflict")
    assert message == f"silo {silo} still holds 3 projects: api, db, web (rackctl project delete)"
    for p in ("db", "web"):
        await client.project_delete(silo, p)
    message = await refused(client.silo_delete(silo), "conflict")
    assert message == f"silo {silo} still holds 1 project: api (rackctl project delete)"
    await client.project_delete(silo, "api")

    assert await client.silo_delete(silo) == {"id": first["id"], "name": silo}
    assert silo not in [s["name"] for s in await client.silo_list()]
    assert "no silo" in await refused(client.silo_show(silo), "not_found")
    assert "no silo" in await refused(client.silo_delete(silo), "not_found")
    assert "no silo" in await refused(client.project_create(silo, "web"), "not_found")

    # The name is free: another silo, whose quota accounting shows (not the deleted one's, whose rows stay).
    again = await client.silo_create(silo, Quota(vcpus=32))
    assert again["id"] != first["id"]
    await client.project_create(silo, "web")

    async def new_quota() -> bool:
        try:
            return (await client.usage(silo))["quota"]["vcpus"] == 32
        except CommandError:
            return False

    await eventually(new_quota)
    [told] = await events(client, f"rp.evt.{silo}.silo.deleted", SiloDeleted)
    assert (str(told.silo_id), told.name) == (first["id"], silo)
    await assert_invariants(db)


async def test_a_deleted_project_stops_counting_against_the_silos_limit(client: Client) -> None:
    silo = unique("del")
    await client.silo_create(silo)
    await client.silo_limits(SiloLimitsSet(name=silo, projects=1))
    await client.project_create(silo, "one")
    assert "at most 1 projects" in await refused(client.project_create(silo, "two"), "limit")
    await client.project_delete(silo, "one")
    await client.project_create(silo, "two")
    assert (await client.silo_show(silo))["used"]["projects"] == 1


async def test_a_create_racing_a_delete_lands_before_it_or_is_refused_after(client: Client) -> None:
    """Each round, an instance create and its project's delete, and a project create and its silo's
    delete, sent together: exactly one of each pair wins, and what is left agrees."""
    for _ in range(6):
        silo = unique("race")
        await client.silo_create(silo)
        await client.project_create(silo, "p")
        create, delete = await asyncio.gather(
            new_instance(client, silo, "p", "vm"), client.project_delete(silo, "p"), return_exceptions=True
        )
        if isinstance(delete, CommandError):  # the create came first
            assert delete.code == "conflict" and not isinstance(create, BaseException), (create, delete)
            assert [p["name"] for p in await client.project_list(silo)] == ["p"]
        else:
            assert isinstance(create, CommandError) and create.code == "not_found", (create, delete)
            assert await client.project_list(silo) == []
            created, deleted = await asyncio.gather(
                client.project_create(silo, "q"), client.silo_delete(silo), return_exceptions=True
            )
            if isinstance(deleted, CommandError):
                assert deleted.code == "conflict" and not isinstance(created, BaseException)
            else:
                assert isinstance(created, CommandError) and created.code == "not_found", (created, deleted)


# --- the inserts themselves, against PostgreSQL -----------------------------------------------------------


@pytest.fixture
async def im(stack: Stack) -> AsyncIterator[asyncpg.Pool]:
    """instance-manager's schema migrated afresh under another name: its rows are this test's alone."""
    schema = unique("deletes").replace("-", "_")
    assert stack.admin_database_url
    pool = await create_pool(stack.admin_database_url, schema, min_size=2, max_size=4)
    try:
        await migrate(pool, schema, migrations_dir("instance_manager"))
        yield pool
    finally:
        async with pool.acquire() as conn:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await pool.close()


async def _insert_both(conn: asyncpg.Connection, project: uuid.UUID) -> tuple[str, str]:
    """An instance and a pool inserted into `project`, as the create saga and `pool create` insert them."""
    i = await conn.execute(Q["instance_insert"], uuid.uuid4(), project, "vm", 1, GiB, GiB, "never", None)
    p = await conn.execute(P["pool_insert"], uuid.uuid4(), project, "warm", 1, GiB, GiB, 0)
    return i, p


async def test_an_insert_waits_for_a_project_delete_then_inserts_nothing(im: asyncpg.Pool) -> None:
    """The project's delete holds its row FOR UPDATE; an instance or pool insert (FOR KEY SHARE of the live
    project, as its foreign key) waits, and once the delete commits finds no live project: the foreign key
    alone would have let it in, into a deleted project."""
    silo, project = uuid.uuid4(), uuid.uuid4()
    await im.execute("INSERT INTO silos (id, name) VALUES ($1, 's')", silo)
    await im.execute("INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, 'p')", project, silo)
    async with im.acquire() as deleter, im.acquire() as inserter:
        tx = deleter.transaction()
        await tx.start()
        s = await deleter.fetchrow(Q["silo_lock_limits"], "s")
        assert (await deleter.fetchrow(Q["project_lock_delete"], s["id"], "p"))["id"] == project
        assert tuple(await deleter.fetchrow(Q["project_holds"], project)) == (0, 0)
        await deleter.execute(Q["project_mark_deleted"], project)
        insert = asyncio.create_task(_insert_both(inserter, project))
        await asyncio.sleep(0.3)
        assert not insert.done(), "the insert did not wait for the delete"
        await tx.commit()
        assert await asyncio.wait_for(insert, 5) == ("INSERT 0 0", "INSERT 0 0")
    assert await im.fetchval("SELECT count(*) FROM instances") == 0
    assert await im.fetchval("SELECT count(*) FROM pools") == 0


async def test_a_project_delete_waits_for_an_insert_then_counts_it(im: asyncpg.Pool) -> None:
    silo, project = uuid.uuid4(), uuid.uuid4()
    await im.execute("INSERT INTO silos (id, name) VALUES ($1, 's')", silo)
    await im.execute("INSERT INTO projects (id, silo_id, name) VALUES ($1, $2, 'p')", project, silo)
    async with im.acquire() as deleter, im.acquire() as inserter:
        tx = inserter.transaction()
        await tx.start()
        assert await _insert_both(inserter, project) == ("INSERT 0 1", "INSERT 0 1")

        async def delete() -> tuple[int, int]:
            async with deleter.transaction():
                await deleter.fetchrow(Q["project_lock_delete"], silo, "p")
                return tuple(await deleter.fetchrow(Q["project_holds"], project))  # type: ignore[return-value]

        counted = asyncio.create_task(delete())
        await asyncio.sleep(0.3)
        assert not counted.done(), "the delete did not wait for the insert"
        await tx.commit()
        assert await asyncio.wait_for(counted, 5) == (1, 1)


# --- the CLI ----------------------------------------------------------------------------------------------


async def test_the_cli_deletes_and_says_why_it_cannot(stack: Stack, client: Client) -> None:
    silo = unique("del")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    await new_instance(client, silo, "web", "vm")

    r = await rackctl(stack, "project", "delete", f"{silo}/web")
    assert (r.code, r.out, r.err) == (1, "", f"rackctl: error: project {silo}/web still holds 1 instance\n")
    r = await rackctl(stack, "project", "delete", f"{silo}/web", "--json")
    assert (r.code, r.out) == (1, ""), r
    assert json.loads(r.err) == {
        "error": {"code": "conflict", "message": f"project {silo}/web still holds 1 instance"}
    }
    r = await rackctl(stack, "--json", "silo", "delete", silo)
    assert r.code == 1 and json.loads(r.err)["error"]["code"] == "conflict", r

    await client.instance("delete", silo, "web", "vm")
    r = await rackctl(stack, "project", "delete", f"{silo}/web")
    assert_ok(r)
    assert r.out == f"deleted project {silo}/web\n"
    r = await rackctl(stack, "project", "delete", f"{silo}/web")
    assert (r.code, r.err) == (1, f"rackctl: error: no project {silo}/web\n"), r
    r = await rackctl(stack, "silo", "delete", silo, "--json")
    assert_ok(r)
    assert r.json()["name"] == silo and uuid.UUID(r.json()["id"])
    r = await rackctl(stack, "silo", "delete", silo)
    assert (r.code, r.err) == (1, f"rackctl: error: no silo {silo}\n"), r


# --- python -m rackctl --------------------------------------------------------------------------------------

COMPLETE = r"""
    source <(.venv/bin/python -m rackctl completion bash)
    complete -p .venv/bin/python ./.venv/bin/python .venv/bin/python3 > /dev/null || exit 3
    complete_line() {
        COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}; COMP_TYPE=9
        read -r -a COMP_WORDS <<< "$COMP_LINE"
        [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")
        COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
        COMPREPLY=()
        _python_argcomplete_rackctl_module "${COMP_WORDS[0]}"
        printf '%s|' "${COMPREPLY[@]}"; echo
    }
"""


def complete_lines(nats_url: str, *lines: str) -> list[list[str]]:
    """Each line completed as bash would, by the function `python -m rackctl completion bash` binds to the
    checkout's interpreter."""
    script = COMPLETE + "".join(f"complete_line {shlex.quote(line)}\n" for line in lines)
    env = {**_env(nats_url), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [sorted(w.strip() for w in line.split("|") if w) for line in done.stdout.splitlines()]


async def test_python_m_rackctl_runs_and_completes(stack: Stack, client: Client) -> None:
    silo = unique("pym")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    assert stack.nats_url
    replies = await asyncio.to_thread(
        complete_lines,
        stack.nats_url,
        ".venv/bin/python -m rackctl silo del",
        f"./.venv/bin/python -m rackctl project delete {silo}/",
        f".venv/bin/python3 -m rackctl silo delete {silo}",
        ".venv/bin/python -m json.tool --no-e",  # another module's line is left to the shell
    )
    assert replies == [["delete"], [f"{silo}/web"], [silo], []], replies


def test_python_m_rackctl_carries_the_marker_of_argcomplete_global_completion() -> None:
    """Where a bare `python` runs it, argcomplete's global completion (activate-global-python-argcomplete)
    completes `python -m rackctl` once this, its own check of the module, passes."""
    python = str(ROOT / ".venv/bin/python")
    marked = subprocess.run([python, "-m", "argcomplete._check_module", "rackctl"], cwd=ROOT, timeout=30)
    assert marked.returncode == 0
    version = subprocess.run([python, "-m", "rackctl", "version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("rackctl "), version
