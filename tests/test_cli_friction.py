"""rackctl's contract for scripts (issue 30): errors as JSON on stderr with `--json`, exit codes that say
failure, and global options before or after the command words."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.stack import Nats, Stack, free_port
from rackctl import context as contexts
from rackctl.client import Client
from tests.conftest import GiB, unique
from tests.test_cli import ROOT, Run, _env, assert_ok, rackctl, rackctl_offline
from tests.test_events import _start_and_stop


def json_error(r: Run, code: str, status: int = 1) -> dict[str, str]:
    """The one JSON object on stderr, its code, the exit status, and nothing on stdout."""
    assert r.code == status, r
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err
    error = json.loads(lines[0])["error"]
    assert error["code"] == code and error["message"], error
    return error


@pytest.mark.parametrize("before", [True, False])
def test_json_errors_are_json_on_stderr(before: bool) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    args = ("--nats", url, "--timeout", "1", "sled", "list")
    r = rackctl_offline(*(("--json", *args) if before else (*args, "--json")))
    assert f"cannot reach nats at {url}" in json_error(r, "unreachable")["message"]
    assert r.out == ""


def test_json_usage_errors_are_json_and_exit_2() -> None:
    r = rackctl_offline("instance", "start", "--json")  # no instance given: argparse's own error
    assert "required" in json_error(r, "usage", status=2)["message"]
    r = rackctl_offline("sled", "expunge", "sled-9", "--json")  # without --yes: refused before any network
    json_error(r, "unconfirmed", status=2)


async def test_refusal_is_json_with_the_services_code(stack: Stack) -> None:
    r = await rackctl(stack, "--json", "instance", "show", "nosilo/noproject/nothing")
    json_error(r, "not_found")
    assert r.out == ""


async def test_global_options_before_or_after_the_command(stack: Stack) -> None:
    before = await rackctl(stack, "--json", "sled", "list")
    after = await rackctl(stack, "sled", "list", "--json")
    assert_ok(before)
    assert_ok(after)
    assert before.json() and all("id" in s for s in before.json() + after.json())  # sleds still join
    r = await rackctl(stack, "sled", "list", "--json", "--nats", stack.nats_url, "--timeout", "5")
    assert_ok(r)
    r = await rackctl(stack, "--timeout", "5", "sled", "list", "--context", "nobody-at-all")
    assert r.code == 1 and "no rackctl context 'nobody-at-all'" in r.err, r


@pytest.fixture(scope="module")
def lone_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nats]:
    """A broker with no service behind it: every service's answer is an error."""
    nats = Nats(tmp_path_factory.mktemp("lone-nats")).start()
    try:
        yield nats
    finally:
        nats.stop()


@pytest.mark.parametrize("as_json", [True, False])
def test_chaos_status_fails_when_no_service_answers(lone_broker: Nats, tmp_path: Path, as_json: bool) -> None:
    args = ["--nats", lone_broker.url, "chaos", "status", *(["--json"] if as_json else [])]
    p = subprocess.run(
        [sys.executable, "-m", "rackctl.main", *args],
        capture_output=True,
        text=True,
        env=_env(None, RACKCTL_CONTEXTS=str(tmp_path)),
        cwd=ROOT,
        timeout=60,
    )
    r = Run(p.returncode, p.stdout, p.stderr)
    if as_json:
        assert {e["service"] for e in json.loads(r.out)} and all("error" in e for e in json.loads(r.out))
        assert "no service answered" in json_error(r, "failed")["message"]
    else:
        assert r.code == 1 and "rackctl: error: no service answered" in r.err, r


# --- completion ------------------------------------------------------------------------------------------

COMPLETE = r"""
    source <(.venv/bin/rackctl completion bash)
    complete -p .venv/bin/rackctl ./.venv/bin/rackctl > /dev/null || { echo "not bound" >&2; exit 3; }
    complete_line() {
        COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}; COMP_TYPE=9
        read -r -a COMP_WORDS <<< "$COMP_LINE"
        [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")
        COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
        COMPREPLY=()
        _python_argcomplete "${COMP_WORDS[0]}"
        printf '%s|' "${COMPREPLY[@]}"; echo
    }
"""


def complete_lines(nats_url: str, *lines: str) -> list[list[str]]:
    """Each line completed as bash would, by the function `rackctl completion bash` defines."""
    script = COMPLETE + "".join(f"complete_line {shlex.quote(line)}\n" for line in lines)
    env = {**_env(nats_url), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [sorted(w.strip() for w in line.split("|") if w) for line in done.stdout.splitlines()]


async def test_completion_binds_the_venv_path_and_completes_names(
    stack: Stack, client: Client, project: tuple[str, str]
) -> None:
    silo, proj = project
    await client.instance_create(silo, proj, "web", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    replies = await asyncio.to_thread(
        complete_lines,
        stack.nats_url,
        f".venv/bin/rackctl instance show {silo}",
        f"./.venv/bin/rackctl instance show {silo}/",
        f".venv/bin/rackctl instance show {silo}/{proj}/w",
        f"./.venv/bin/rackctl silo show {silo}",
        f".venv/bin/rackctl instance list --project {silo}/",
    )
    assert replies == [
        [f"{silo}/"],
        [f"{silo}/{proj}/"],
        [f"{silo}/{proj}/web"],
        [silo],
        [f"{silo}/{proj}"],
    ], replies


def test_completion_of_names_is_silent_without_a_broker(tmp_path: Path) -> None:
    [reply] = complete_lines(f"nats://127.0.0.1:{free_port()}", ".venv/bin/rackctl instance show a")
    assert reply == []


# --- events follow: names, not ids -----------------------------------------------------------------------

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


async def test_events_follow_names_outcomes_and_usage(stack: Stack, client: Client) -> None:
    """Provision outcomes and usage changes carry only ids: the NAME column shows the instance's
    `project/name` and the project's name instead, even for events from before rackctl started."""
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    await _start_and_stop(client, silo)
    r = await rackctl(stack, "events", "follow", "--silo", silo, "--since", "10m", "--count", "8")
    assert_ok(r)
    rows = [line.split() for line in r.out.splitlines()[1:]]
    outcomes = [row for row in rows if row[2] == "provision.outcome"]
    usage = [row for row in rows if row[2] == "usage.changed"]
    assert outcomes and usage, r.out
    assert {row[3] for row in outcomes} == {"web/vm"}, r.out
    assert {row[3] for row in usage} == {"web"}, r.out
    assert not UUID.search(r.out), r.out


# --- a context refused: which one would do ---------------------------------------------------------------


async def test_a_refused_context_names_the_context_that_may(stack: Stack, tmp_path: Path) -> None:
    """`make run` writes `default` (console) and `events-reader`: a command refused to the latter says
    which context it is and names the one to use instead, in plain text and in --json."""
    assert stack.security is not None and stack.nats_url
    contexts.write("events-reader", stack.security.context("events-reader", stack.nats_url), tmp_path)
    contexts.write("default", stack.security.context("console", stack.nats_url), tmp_path)
    env = {"RACKCTL_CONTEXTS": str(tmp_path)}
    r = await rackctl(stack, "--context", "events-reader", "sled", "list", **env)
    assert r.code == 1 and r.out == "" and len(r.err.splitlines()) == 1, r
    assert (
        "this context (events-reader) may only read events: use --context default for other commands" in r.err
    )
    r = await rackctl(stack, "instance", "show", "a/b/c", "--json", "--context", "events-reader", **env)
    assert "use --context default" in json_error(r, "forbidden")["message"]
    assert_ok(await rackctl(stack, "sled", "list", "--context", "default", **env))  # which does work
