"""rackctl as an operator runs it: a real subprocess against the session stack, checked on its exit code,
its stdout (tables or JSON) and its stderr (one line on error, never a traceback)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from deploy.stack import Stack, free_port
from rackctl.client import Client
from rackctl.commands import instance as instance_commands
from rackctl.commands.args import POOL_NAME_MAX, Ref, instance_path, pool_path
from rackctl.commands.base import Failure, Invocation
from rackctl.output import Progress
from rackctl.sizes import format_size, parse_size
from shared.bus import CommandError
from shared.messages import AutoRestart, PoolName, SimFaults
from tests.conftest import GiB, eventually, make_stack, unique

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def _env(nats_url: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RACKPLANE_TRACES", "RACKCTL_LOG", "NATS_URL")}
    if nats_url:
        env["NATS_URL"] = nats_url
    return {**env, **extra}


def _cmd(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "rackctl.main", *args]


async def rackctl(stack: Stack, *args: str, **env: str) -> Run:
    """Run the CLI without blocking the session's event loop (the `client` fixture lives on it)."""
    proc = await asyncio.create_subprocess_exec(
        *_cmd(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(stack.nats_url, **env),
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


def rackctl_offline(*args: str) -> Run:
    """For what must fail before or without a stack."""
    p = subprocess.run(_cmd(args), capture_output=True, text=True, env=_env(None), cwd=ROOT, timeout=60)
    return Run(p.returncode, p.stdout, p.stderr)


def assert_ok(r: Run) -> None:
    assert r.code == 0 and r.err == "", r


def _fields(r: Run) -> dict[str, str]:
    """The `key  value` lines of a human `show`."""
    assert_ok(r)
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.out.splitlines())


def assert_one_error(r: Run, contains: str) -> None:
    assert r.code == 1, r
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("rackctl: error: ") and contains in lines[0], lines[0]
    assert r.out == ""


# --- sizes (pure) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("4 gib", 4 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512", 512),
        ("512B", 512),
        ("2KiB", 2048),
        ("10MiB", 10 * 2**20),
        ("1TiB", 2**40),
        ("1KB", 1000),
        ("3mb", 3_000_000),
        ("2GB", 2 * 10**9),
        ("1TB", 10**12),
        ("0", 0),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "4G", "4 GiBs", "-1GiB", "1.5B", "1.0000000001KiB", "4e3", "four"]
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (512, "512 B"), (4 * GiB, "4 GiB"), (3 * GiB // 2, "1.5 GiB"), (2**40, "1 TiB")],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


# --- waiting (pure: a scripted client stands in for the stack) -------------------------------------------


class ScriptedClient:
    """Answers `show` with the next scripted view (or raises it), as the instance-manager would."""

    def __init__(self, *replies: dict[str, Any] | Exception, repeat_last: bool = False) -> None:
        self.replies = list(replies)
        self.repeat_last = repeat_last
        self.timeout = 1.0

    async def instance(self, verb: str, *ref: str) -> dict[str, Any]:
        assert verb == "show"
        reply = self.replies[0] if self.repeat_last and len(self.replies) == 1 else self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def view(state: str, last_error: str | None = None) -> dict[str, Any]:
    return {"state": state, "last_error": last_error, "sled_id": "sled-0"}


async def wait(client: ScriptedClient, first: dict[str, Any], target: str | None, timeout: float = 5) -> Any:
    ctx = Invocation(argparse.Namespace(timeout=timeout, json=False, nats="nats://unused"))
    return await instance_commands._wait_for(ctx, client, Ref("s", "p", "vm"), first, target)  # type: ignore[arg-type]


async def test_wait_reaches_target() -> None:
    got = await wait(ScriptedClient(view("starting"), view("running")), view("starting"), "running")
    assert got["state"] == "running"


@pytest.mark.parametrize(
    ("last", "message"),
    [
        (view("failed", "VMM x failed on sled-0"), "s/p/vm failed: VMM x failed on sled-0"),
        (view("stopped", "no sled has room"), "s/p/vm did not start: no sled has room"),
    ],
)
async def test_wait_for_running_stops_on_failure(last: dict[str, Any], message: str) -> None:
    with pytest.raises(Failure, match=f"^{message}$"):
        await wait(ScriptedClient(view("starting"), last), view("starting"), "running")


async def test_wait_times_out_clearly() -> None:
    client = ScriptedClient(view("starting"), repeat_last=True)
    with pytest.raises(
        Failure, match=r"timed out after 0.3s waiting for s/p/vm to be running \(it is starting\)"
    ):
        await wait(client, view("starting"), "running", timeout=0.3)


async def test_wait_for_delete_ends_when_show_says_not_found() -> None:
    gone = CommandError("not_found", "no instance s/p/vm")
    assert await wait(ScriptedClient(view("destroyed"), gone), view("destroyed"), None) is None


def test_progress_only_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for out, drawn in ((Terminal(), True), (io.StringIO(), False)):
        p = Progress("s/p/vm", out=out)
        p.update("starting")
        p.clear()
        assert ("s/p/vm: starting (" in out.getvalue()) is drawn
        assert out.getvalue().endswith("\r\033[K") is drawn


# --- usage errors and connection failure (no stack) ------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("instance", "show", "silo/proj"),
        ("instance", "start", "a/b/c/d", "--wait"),
        ("instance", "show", "silo/Proj/vm"),
        ("project", "create", "onlysilo"),
        ("silo", "create", "9lives"),
        ("usage", "--project", "a"),
        ("usage", "--silo", "a", "--project", "a/b"),
        ("instance", "create", "a/b/c", "--cpus", "1", "--ram", "4G", "--disk", "1GiB"),
        ("instance", "create", "a/b/c", "--cpus", "1", "--ram", "1KiB", "--disk", "1GiB"),
        ("sled", "expunge", "Sled-0", "--yes"),
        ("sim", "sled", "reboot"),
        ("sim", "sled", "add", "--cpus", "0"),
        ("sim", "sled", "add", "--ram", "1MiB"),
        ("sim", "faults", "sled-0", "--delay-seconds", "2"),
        ("sim", "faults", "sled-0", "--delay-count", "2"),
        ("sim", "faults", "sled-0", "--drop-probability", "1.5"),
        ("sim", "faults", "sled-0", "--duplicate", "11"),
        ("sim", "faults", "sled-0", "--delay-state", "asleep", "--delay-count", "1", "--delay-seconds", "1"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    r = rackctl_offline(*args)
    assert r.code == 2, r
    assert r.out == "" and "Traceback" not in r.err
    assert "error:" in r.err.splitlines()[-1]


POOL_TOO_LONG = "p" * (POOL_NAME_MAX + 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("instance", "create", "a/b/c", "--from-pool", "a/b/warm", "--cpus", "1", "--ram", "1GiB"),
            "a VM from a pool has the pool's shape: --cpus, --ram not allowed with --from-pool",
        ),
        (
            ("instance", "create", "a/b/c", "--from-pool", "a/other/warm"),
            "pool a/other/warm is not in project a/b: a pool hands out VMs in its own project only",
        ),
        (
            ("instance", "create", "a/b/c", "--from-pool", "x/b/warm", "--require-pool"),
            "pool x/b/warm is not in project a/b",
        ),
        (
            ("instance", "create", "a/b/c", "--from-pool", f"a/b/{POOL_TOO_LONG}"),
            f"invalid pool name '{POOL_TOO_LONG}' in 'a/b/{POOL_TOO_LONG}': a pool name is 1 to 56",
        ),
        (
            ("pool", "create", f"a/b/{POOL_TOO_LONG}", "--size", "1", "--cpus", "1", "--ram", "1GiB"),
            "a pool name is 1 to 56 lowercase letters",
        ),
        (("pool", "show", "a/b/" + "p" * 64), "a pool name is 1 to 56 lowercase letters"),
        (("pool", "delete", "a/b"), "expected SILO/PROJECT/POOL"),
        (
            ("instance", "create", "a/b/c", "--cpus", "1"),
            "the following arguments are required: --ram, --disk (or --from-pool)",
        ),
        (
            (
                "instance",
                "create",
                "a/b/c",
                "--cpus",
                "1",
                "--ram",
                "1GiB",
                "--disk",
                "1GiB",
                "--require-pool",
            ),
            "--require-pool needs --from-pool",
        ),
        (
            ("pool", "create", "a/b/p", "--size", "1001", "--cpus", "1", "--ram", "1GiB", "--disk", "1GiB"),
            "--size must be at most 1000",
        ),
        (
            ("pool", "create", "a/b/p", "--size", "1", "--cpus", "0", "--ram", "1GiB", "--disk", "1GiB"),
            "--cpus must be at least 1",
        ),
        (("pool", "resize", "a/b/p", "--size", "-1"), "invalid count '-1'"),
        (
            ("pool", "list", "--silo", "a", "--project", "b/c"),
            "--silo a and --project b/c name different silos",
        ),
        (("sim", "sled", "partition"), "the following arguments are required: SLED_ID"),
    ],
)
def test_pool_usage_errors_exit_2_with_a_clear_line(args: tuple[str, ...], message: str) -> None:
    r = rackctl_offline(*args)
    assert r.code == 2 and r.out == "", r
    last = r.err.splitlines()[-1]
    assert last.startswith(f"rackctl {args[0]} {args[1]}") and message in last, last


def test_pool_names_are_those_the_schema_accepts() -> None:
    """The CLI refuses exactly the pool names `messages.PoolName` refuses, with its own clear message."""
    schema = TypeAdapter(PoolName)
    for name in ("p", "warm-1", "p" * POOL_NAME_MAX):
        assert pool_path(f"a/b/{name}").name == schema.validate_python(name)
    for name in ("p" * (POOL_NAME_MAX + 1), "Warm", "1warm", ""):
        with pytest.raises(ValidationError):
            schema.validate_python(name)
        with pytest.raises(argparse.ArgumentTypeError, match="a pool name is 1 to 56"):
            pool_path(f"a/b/{name}")
    assert instance_path("a/b/" + "i" * 63).name == "i" * 63  # other names keep their 63


def test_unreachable_nats_is_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    r = rackctl_offline("--nats", url, "--timeout", "1", "sled", "list")
    assert_one_error(r, f"cannot reach nats at {url}")


# --- against the stack -----------------------------------------------------------------------------------


async def test_silo_and_project(stack: Stack) -> None:
    silo = unique("silo")
    r = await rackctl(stack, "silo", "create", silo, "--cpus", "40", "--ram", "64GiB", "--storage", "1TiB")
    assert_ok(r)
    assert "64 GiB" in r.out and "1 TiB" in r.out
    assert_ok(r := await rackctl(stack, "project", "create", f"{silo}/web"))

    r = await rackctl(stack, "silo", "list", "--json")
    assert_ok(r)
    [mine] = [s for s in r.json() if s["name"] == silo]
    assert mine["quota"] == {"vcpus": 40, "ram_bytes": 64 * GiB, "disk_bytes": 2**40}

    r = await rackctl(stack, "project", "list", silo, "--json")
    assert_ok(r)
    assert [p["name"] for p in r.json()] == ["web"]

    r = await rackctl(stack, "project", "create", f"{silo}/web")
    assert_one_error(r, "already exists")


async def test_instance_lifecycle(stack: Stack, project: tuple[str, str]) -> None:
    silo, proj = project
    path = f"{silo}/{proj}/web"
    r = await rackctl(stack, "instance", "create", path, "--cpus", "2", "--ram", "4GiB", "--disk", "10GiB")
    assert_ok(r)
    assert "4 GiB" in r.out

    r = await rackctl(stack, "instance", "start", path, "--wait", "--timeout", "30")
    assert_ok(r)
    assert r.out.startswith(f"{path}: running"), r.out  # not a tty: no progress line, just the result

    r = await rackctl(stack, "instance", "show", path, "--json")
    assert_ok(r)
    shown = r.json()
    assert (shown["state"], shown["vcpus"], shown["ram_bytes"]) == ("running", 2, 4 * GiB)
    assert (shown["health"], shown["intended_state"], shown["auto_restarts"]) == ("ok", "running", 0)

    r = await rackctl(stack, "instance", "show", path)
    assert_ok(r)
    fields = _fields(r)
    assert (fields["health"], fields["intended state"], fields["sled"]) == ("ok", "running", shown["sled_id"])
    assert fields["state"] == f"running (generation {shown['generation']})"
    assert not {"auto-restarts", "last error", "failed at"} & set(fields)  # empty recovery fields: left out

    r = await rackctl(stack, "usage", "--project", f"{silo}/{proj}", "--json")
    assert_ok(r)
    assert r.json()["usage"] == {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB}

    r = await rackctl(stack, "instance", "list", "--project", f"{silo}/{proj}", "--json")
    assert_ok(r)
    assert [(v["name"], v["state"]) for v in r.json()] == [("web", "running")]

    r = await rackctl(stack, "instance", "list", "--silo", silo)
    assert_ok(r)
    header, row = r.out.splitlines()
    assert header.split()[:3] == ["INSTANCE", "STATE", "HEALTH"]
    assert row.split()[:3] == [path, "running", "ok"] and "4 GiB" in row

    r = await rackctl(stack, "instance", "migrate", path, "--wait", "--timeout", "30")
    assert_ok(r)
    moved = (await rackctl(stack, "instance", "show", path, "--json")).json()
    assert moved["sled_id"] != shown["sled_id"] and moved["active_vmm_id"] != shown["active_vmm_id"]
    assert r.out.startswith(f"{path}: running on {moved['sled_id']} ("), r.out
    r = await rackctl(stack, "instance", "migrate", path, "--to", moved["sled_id"])
    assert_one_error(r, f"instance already runs on {moved['sled_id']}")
    r = await rackctl(stack, "instance", "migrate", path, "--to", shown["sled_id"], "--wait", "--json")
    assert_ok(r)
    assert (r.json()["state"], r.json()["sled_id"]) == ("running", shown["sled_id"])
    r = await rackctl(stack, "instance", "migrate", path, "--to", "not a sled")
    assert r.code == 2 and "invalid sled id" in r.err

    r = await rackctl(stack, "instance", "stop", path, "--wait", "--json")
    assert_ok(r)
    assert r.json()["state"] == "stopped"

    assert_ok(r := await rackctl(stack, "instance", "delete", path, "--wait"))
    assert r.out.startswith(f"{path}: deleted")

    r = await rackctl(stack, "instance", "show", path)
    assert_one_error(r, f"no instance {path}")


async def test_start_of_missing_instance_is_one_line(stack: Stack, project: tuple[str, str]) -> None:
    silo, proj = project
    r = await rackctl(stack, "instance", "start", f"{silo}/{proj}/nope", "--wait")
    assert_one_error(r, f"no instance {silo}/{proj}/nope")


async def test_quota_refusal_is_one_line(stack: Stack, client: Client) -> None:
    silo = unique("silo")
    assert_ok(await rackctl(stack, "silo", "create", silo, "--cpus", "2"))
    await client.project_create(silo, "p")
    await client.instance_create(silo, "p", "big", vcpus=4, ram_bytes=GiB, disk_bytes=GiB)
    r = await rackctl(stack, "instance", "start", f"{silo}/p/big", "--wait")
    assert_one_error(r, "vCPU quota exceeded")


async def test_human_tables(stack: Stack, project: tuple[str, str]) -> None:
    r = await rackctl(stack, "sled", "list")
    assert_ok(r)
    assert r.out.splitlines()[0].split()[:2] == ["SLED", "STATE"]
    assert "GiB" in r.out

    r = await rackctl(stack, "--timeout", "10", "usage", "--silo", project[0])
    assert_ok(r)
    assert r.out.startswith(f"silo {project[0]}")  # its projects reach accounting a moment later
    assert [line.split()[0] for line in r.out.splitlines()[2:5]] == ["vCPUs", "RAM", "storage"]

    r = await rackctl(stack, "sled", "list", "--json")
    assert_ok(r)
    assert all({"id", "state", "vcpus", "ram_bytes"} <= set(s) for s in r.json())


async def test_one_trace_from_cli_to_services(stack: Stack, tmp_path: Path) -> None:
    spec = stack.env.get("RACKPLANE_TRACES", "")
    if not spec.startswith("file:"):
        pytest.skip("the session stack does not write its traces to a file")
    cli_file = tmp_path / "cli.jsonl"
    assert_ok(await rackctl(stack, "sled", "list", "--json", RACKPLANE_TRACES=f"file:{cli_file}"))
    [root] = [s for s in _spans(cli_file) if s["name"] == "rackctl sled list"]
    assert root["parent_id"] is None and root["service"] == "rackctl"
    served = _spans(Path(spec.removeprefix("file:")))
    assert any(s["trace_id"] == root["trace_id"] and s["service"] != "rackctl" for s in served)


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- recovery: sled expunge and the simulator ------------------------------------------------------------


def _boots(r: Run) -> dict[str, str]:
    assert_ok(r)
    return {s["sled_id"]: s["boot_id"] for s in r.json()}


async def test_sim_sled_list(stack: Stack) -> None:
    boots = _boots(await rackctl(stack, "sim", "sled", "list", "--json"))
    assert {f"sled-{i}" for i in range(8)} <= set(boots)  # the session stack has 8 sleds
    assert all(uuid.UUID(b) for b in boots.values())

    r = await rackctl(stack, "sim", "sled", "list")
    assert_ok(r)
    lines = r.out.splitlines()
    assert lines[0].split() == ["SLED", "STATE", "BOOT", "BOOT", "ID", "VCPUS", "RAM", "VMMS", "FAULTS"]
    assert lines[1].split()[:4] == ["sled-0", "up", "1", boots["sled-0"]]


async def test_sim_faults_set_and_clear(stack: Stack, client: Client) -> None:
    try:
        r = await rackctl(stack, "sim", "faults", "sled-3", "--drop-commands", "--json")
        assert_ok(r)
        assert r.json()["sled_id"] == "sled-3" and r.json()["faults"]["drop_commands"] is True

        r = await rackctl(stack, "sim", "sled", "list")
        assert_ok(r)
        [row] = [line for line in r.out.splitlines() if line.startswith("sled-3 ")]
        assert row.endswith("drop commands"), row

        r = await rackctl(stack, "sim", "faults", "sled-3")
        assert_ok(r)
        assert r.out == "sled-3: faults cleared\n"
    finally:
        await client.sim_faults(SimFaults(sled_id="sled-3"))
    [sled3] = [s for s in await client.sim_sled("list") if s["sled_id"] == "sled-3"]
    assert sled3["faults"] == SimFaults(sled_id="sled-3").model_dump(mode="json")


async def test_sim_faults_describes_what_it_set(stack: Stack, client: Client) -> None:
    args = ("--delay-state", "running", "--delay-seconds", "1.5", "--delay-count", "2", "--duplicate", "1")
    try:
        r = await rackctl(stack, "sim", "faults", "sled-4", *args)
        assert_ok(r)
        assert r.out == "sled-4: faults set: delay next 2 running reports by 1.5s, duplicate reports x1\n"
    finally:
        await client.sim_faults(SimFaults(sled_id="sled-4"))


async def test_sim_commands_on_an_unknown_sled_are_one_line(stack: Stack) -> None:
    assert_one_error(await rackctl(stack, "sim", "sled", "freeze", "sled-99"), "sled-99")
    assert_one_error(await rackctl(stack, "sim", "faults", "sled-99", "--fail-starts"), "sled-99")


async def test_expunge_needs_yes_and_does_nothing_without_it(stack: Stack, client: Client) -> None:
    r = await rackctl(stack, "sled", "expunge", "sled-2")
    assert r.code == 2 and r.out == "", r
    [line] = r.err.splitlines()
    assert line.startswith("rackctl: error: ") and "--yes" in line and "irreversible" in line, line
    assert {s["id"]: s["state"] for s in await client.sled_list()}["sled-2"] == "active"


async def test_expunge_of_an_unknown_sled_is_one_line(stack: Stack) -> None:
    assert_one_error(await rackctl(stack, "sled", "expunge", "sled-99", "--yes"), "no sled sled-99")


@pytest.fixture
async def small_rack() -> AsyncIterator[tuple[Stack, Client]]:
    """A private 2-sled stack, for what the session stack must not suffer: reboots, expunges, crash loops."""
    stack = make_stack("cli", RACKPLANE_SLEDS="2")
    try:
        stack.start()
        client = await Client.connect(stack.nats_url)
        try:

            async def known() -> bool:
                return len(await client.sled_list()) == 2

            await eventually(known)
            yield stack, client
        finally:
            await client.close()
    finally:
        stack.stop()
        shutil.rmtree(stack.dir, ignore_errors=True)


async def test_reboot_expunge_and_failures_on_a_private_rack(small_rack: tuple[Stack, Client]) -> None:
    stack, client = small_rack
    silo, proj = unique("silo"), "p"
    await client.silo_create(silo)
    await client.project_create(silo, proj)

    # A crash loop: --wait on start stops at the failure, with its reason, in one line.
    for sled in ("sled-0", "sled-1"):
        assert_ok(await rackctl(stack, "sim", "faults", sled, "--fail-starts"))
    crash = f"{silo}/{proj}/crash"
    await client.instance_create(
        silo, proj, "crash", vcpus=1, ram_bytes=GiB, disk_bytes=GiB, auto_restart=AutoRestart.never
    )
    r = await rackctl(stack, "instance", "start", crash, "--wait", "--timeout", "20")
    assert r.code == 1 and r.out == "", r
    [line] = r.err.splitlines()
    assert line.startswith(f"rackctl: error: {crash} "), line
    shown = _fields(await rackctl(stack, "instance", "show", crash))
    assert shown["state"].split()[0] in ("failed", "stopped") and "health" in shown, shown
    assert shown["last error"] == line.split(": ", 3)[3] and "failed at" in shown, shown
    for sled in ("sled-0", "sled-1"):
        assert_ok(await rackctl(stack, "sim", "faults", sled))

    # A sled reboot: its next boot (number and id) for it alone; its instance fails and comes back by policy.
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    assert_ok(await rackctl(stack, "instance", "start", f"{silo}/{proj}/vm", "--wait", "--timeout", "20"))
    before = _boots(await rackctl(stack, "sim", "sled", "list", "--json"))
    r = await rackctl(stack, "sim", "sled", "reboot", "sled-0")
    assert_ok(r)
    after = _boots(await rackctl(stack, "sim", "sled", "list", "--json"))
    assert r.out == f"rebooted sled-0: boot 2 (boot id {after['sled-0']})\n"
    assert after["sled-0"] != before["sled-0"] and after["sled-1"] == before["sled-1"]

    # Expunge: the sled is listed as expunged, and nothing runs there any more.
    r = await rackctl(stack, "sled", "expunge", "sled-1", "--yes", "--json")
    assert_ok(r)
    assert (r.json()["id"], r.json()["state"]) == ("sled-1", "expunged")
    r = await rackctl(stack, "sled", "list", "--json")
    assert_ok(r)
    assert {s["id"]: s["state"] for s in r.json()} == {"sled-0": "active", "sled-1": "expunged"}
    r = await rackctl(stack, "sled", "list")
    assert_ok(r)
    assert [line.split()[:2] for line in r.out.splitlines()[1:]] == [
        ["sled-0", "active"],
        ["sled-1", "expunged"],
    ]

    async def restarted() -> dict[str, Any] | None:
        v = await client.instance("show", silo, proj, "vm")
        return v if v["state"] == "running" and v["auto_restarts"] >= 1 else None

    v = await eventually(restarted, timeout=20)
    assert v["sled_id"] == "sled-0"
    shown = _fields(await rackctl(stack, "instance", "show", f"{silo}/{proj}/vm"))
    assert shown["auto-restarts"] == str(v["auto_restarts"]) and shown["last error"] == v["last_error"]
    assert shown["last auto-restart"].startswith(v["last_auto_restart_at"]), shown


# --- warm pools ------------------------------------------------------------------------------------------


POOL_HEADERS = "POOL VCPUS RAM DISK TARGET IDLE PROVISIONING HANDED OUT".split()


async def _pool_reaches(client: Client, pool: str, **counts: int) -> dict[str, Any]:
    """Poll the pool until its counts are these (through the client: a rackctl process per poll is slow)."""

    async def check() -> dict[str, Any] | None:
        v = await client.pool("show", *pool.split("/"))
        return v if all(v[k] == n for k, n in counts.items()) else None

    return await eventually(check, timeout=40, interval=0.3)


async def test_pools_through_the_cli_on_a_private_rack(small_rack: tuple[Stack, Client]) -> None:
    stack, client = small_rack
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    pool = f"{silo}/p/warm"

    r = await rackctl(
        stack, "pool", "create", pool, "--size", "2", "--cpus", "1", "--ram", "1GiB", "--disk", "2GiB"
    )
    assert_ok(r)
    assert r.out == f"created pool {pool}: 2 VMs of 1 vCPU, 1 GiB RAM, 2 GiB disk\n"
    again = await rackctl(
        stack, "pool", "create", pool, "--size", "1", "--cpus", "1", "--ram", "1GiB", "--disk", "1GiB"
    )
    assert_one_error(again, f"pool {pool} already exists")

    v = await _pool_reaches(client, pool, idle=2)
    shape = (v["target_size"], v["state"], v["vcpus"], v["ram_bytes"], v["disk_bytes"])
    assert shape == (2, "active", 1, GiB, 2 * GiB), v
    shown = _fields(await rackctl(stack, "pool", "show", pool))
    assert shown == {
        "pool": pool,
        "id": v["id"],
        "state": f"active (generation {v['generation']})",
        "shape": "1 vCPU, 1 GiB RAM, 2 GiB disk",
        "target size": "2",
        "idle": "2",
        "provisioning": "0",
        "handed out": "0",
    }

    r = await rackctl(stack, "pool", "list", "--project", f"{silo}/p")
    assert_ok(r)
    header, row = r.out.splitlines()
    assert header.split() == POOL_HEADERS
    assert row.split() == [pool, "1", "1", "GiB", "2", "GiB", "2", "2", "0", "0"]
    r = await rackctl(stack, "pool", "list", "--silo", silo, "--json")
    assert_ok(r)
    assert [p["id"] for p in r.json()] == [v["id"]]
    r = await rackctl(stack, "pool", "list", "--silo", unique("other"))
    assert_ok(r)
    assert r.out.split() == POOL_HEADERS  # an empty table still has its headers

    # An idle pool VM is an instance of the project, shown as still in its pool.
    r = await rackctl(stack, "instance", "list", "--project", f"{silo}/p", "--json")
    assert_ok(r)
    members = [i for i in r.json() if i["pool"] == "warm"]
    assert len(members) == 2 and all(i["has_customer_data_at"] is None for i in members), members
    member = _fields(await rackctl(stack, "instance", "show", f"{silo}/p/{members[0]['name']}"))
    assert member["pool"] == f"{pool} (not handed out)" and "has customer data since" not in member

    # Handed out: running at once, renamed, marked.
    r = await rackctl(stack, "instance", "create", f"{silo}/p/a", "--from-pool", pool)
    assert_ok(r)
    picked = rf"created instance {silo}/p/a from pool {pool}: running on sled-[01]\n"
    assert re.fullmatch(picked, r.out), r.out
    r = await rackctl(
        stack, "instance", "create", f"{silo}/p/b", "--from-pool", pool, "--auto-restart", "never", "--json"
    )
    assert_ok(r)
    b = r.json()
    got = (b["source"], b["state"], b["name"], b["pool"], b["auto_restart"])
    assert got == ("pool", "running", "b", "warm", "never"), b
    assert b["has_customer_data_at"] is not None and b["id"] in {m["id"] for m in members}
    a = _fields(await rackctl(stack, "instance", "show", f"{silo}/p/a"))
    assert a["pool"] == pool and a["state"].startswith("running"), a
    assert (a["vcpus"], a["disk"]) == ("1", "2 GiB") and a["has customer data since"].endswith("ago)"), a

    # An empty pool: refused with --require-pool, a new instance of the pool's shape without it.
    r = await rackctl(stack, "pool", "resize", pool, "--size", "0")
    assert_ok(r)
    assert r.out.startswith(f"resized pool {pool}: target 0 VMs ("), r.out
    await _pool_reaches(client, pool, idle=0, provisioning=0, handed_out=2)
    r = await rackctl(stack, "instance", "create", f"{silo}/p/strict", "--from-pool", pool, "--require-pool")
    assert_one_error(r, f"pool {pool} has no idle VM")
    r = await rackctl(stack, "instance", "create", f"{silo}/p/fresh", "--from-pool", pool, "--timeout", "30")
    assert_ok(r)
    made, note = r.out.splitlines()
    where = r"\((running on sled-[01]|starting)\)"
    assert re.fullmatch(rf"created instance {silo}/p/fresh: 1 vCPU, 1 GiB RAM, 2 GiB disk {where}", made), (
        made
    )
    assert note == "note: pool warm had no idle VM: created and started a new instance"
    fresh = _fields(await rackctl(stack, "instance", "show", f"{silo}/p/fresh"))
    assert "pool" not in fresh and "has customer data since" in fresh

    # Deleted: gone from show and list; what it handed out stays.
    r = await rackctl(stack, "pool", "delete", pool)
    assert_ok(r)
    assert r.out == f"deleted pool {pool}: its idle VMs are retired; the 2 instances it handed out stay\n"
    assert_one_error(await rackctl(stack, "pool", "show", pool), f"no pool {pool}")
    assert_one_error(await rackctl(stack, "pool", "resize", pool, "--size", "1"), f"no pool {pool}")
    r = await rackctl(stack, "pool", "list", "--json")
    assert_ok(r)
    assert r.json() == []

    async def only_customers_left() -> set[str] | None:  # the retired pool VMs are stopped, then deleted
        names = {i["name"] for i in await client.instance_list(silo, "p")}
        return names if names == {"a", "b", "fresh"} else None

    await eventually(only_customers_left, timeout=20, interval=0.3)


async def test_sim_sled_partition_and_heal_on_a_private_rack(small_rack: tuple[Stack, Client]) -> None:
    stack, client = small_rack

    async def seen(sled: str) -> datetime:
        return datetime.fromisoformat({s["id"]: s["last_seen_at"] for s in await client.sled_list()}[sled])

    try:
        r = await rackctl(stack, "sim", "sled", "partition", "sled-1")
        assert_ok(r)
        assert r.out == "partitioned sled-1: cut off until healed (its VMMs go on running)\n"
        r = await rackctl(stack, "sim", "sled", "list", "--json")
        assert_ok(r)
        assert {s["sled_id"]: s["partitioned"] for s in r.json()} == {"sled-0": False, "sled-1": True}
        r = await rackctl(stack, "sim", "sled", "list")
        assert_ok(r)
        assert [line.split()[:2] for line in r.out.splitlines()[1:]] == [
            ["sled-0", "up"],
            ["sled-1", "partitioned"],
        ]

        # Cut off: its inventories (every second here) stop reaching the control plane.
        await asyncio.sleep(1.5)
        last = await seen("sled-1")
        await asyncio.sleep(2)
        assert await seen("sled-1") == last and await seen("sled-0") > last

        r = await rackctl(stack, "sim", "sled", "heal", "sled-1", "--json")
        assert_ok(r)
        assert (r.json()["sled_id"], r.json()["partitioned"]) == ("sled-1", False)
    finally:
        await client.sim_sled("heal", "sled-1")

    async def heard_again() -> bool:
        return await seen("sled-1") > last

    await eventually(heard_again, timeout=10)
    r = await rackctl(stack, "sim", "sled", "list")
    assert_ok(r)
    assert [line.split()[:2] for line in r.out.splitlines()[1:]] == [["sled-0", "up"], ["sled-1", "up"]]
