"""Acceptance 1: `make run` brings the whole stack up from nothing, answers commands, and stops cleanly
on Ctrl-C (SIGINT), leaving no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deploy.stack import ROOT, SERVICES, free_port


@dataclass
class MadeRun:
    """A `make run` underway: its home, the environment a CLI is run in, what it printed on the way up."""

    home: Path
    env: dict[str, str]
    output: str

    def rackctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "rackctl.main", *args]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)

    def sleds(self) -> list[dict[str, object]]:
        out = self.rackctl("sled", "list", "--json")
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout))


@contextlib.contextmanager
def make_run(*make_args: str, up_within: float = 60) -> Iterator[MadeRun]:
    """`make run` (with `make_args`, e.g. HA=1) in a home of its own, as a user runs it: no URL and no
    credential given, so rackctl finds its default context; stopped by Ctrl-C (SIGINT) at the end, which
    must stop it cleanly and leave no process behind."""
    home = Path(tempfile.mkdtemp(prefix="rackplane-make-run-"))
    os.chmod(home, 0o755)
    env = {
        **os.environ,
        "RACKPLANE_HOME": str(home),
        "RACKPLANE_NATS_PORT": str(free_port()),
        "RACKPLANE_PG_PORT": str(free_port()),
        "RACKPLANE_INVENTORY_INTERVAL": "1",
        "RACKPLANE_HTTP_PORT_BASE": "0",  # free ports, not 9460...: another stack may hold those
    }
    for name in ("NATS_URL", "DATABASE_URL", "RACKCTL_CONTEXT", "RACKPLANE_IDENTITIES"):
        env.pop(name, None)  # make run makes its own identities, and rackctl finds its default context
    proc = subprocess.Popen(
        ["make", "-s", "run", *make_args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + up_within
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or proc.poll() is not None:
                break
        output = "".join(lines)
        assert "rackplane is running" in output, output
        made = MadeRun(home, env, output)
        deadline = time.monotonic() + 30
        while len(made.sleds()) < 8 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(made.sleds()) == 8
        yield made
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    # make reports the interrupt itself (-SIGINT); the stack underneath must have stopped cleanly.
    assert proc.returncode in (0, -signal.SIGINT), rest
    assert "stopped." in rest
    leftovers = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"processes left behind: {leftovers}"
    shutil.rmtree(home, ignore_errors=True)


def test_make_run_starts_and_stops_the_stack() -> None:
    with make_run() as run:
        home, env, output = run.home, run.env, run.output
        assert f"nats://127.0.0.1:{env['RACKPLANE_NATS_PORT']}" in output
        assert f"127.0.0.1:{env['RACKPLANE_PG_PORT']}" in output

        assert (home / "contexts" / "default.json").exists()
        for name in ("dlq-admin", "events-reader"):  # the identities an operator picks by name
            assert json.loads((home / "contexts" / f"{name}.json").read_text())["identity"] == name

        # each service's metrics and health endpoint, where the stack printed and recorded it
        ports = json.loads((home / "http-ports.json").read_text())
        assert sorted(ports) == sorted(SERVICES)
        for name, port in ports.items():
            assert f"metrics http://127.0.0.1:{port}/metrics" in output
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                assert r.status == 200, name

        rackctl = run.rackctl
        assert (
            rackctl("sim", "sled", "list").returncode == 0
        )  # the default context includes simulator control
        refused = rackctl("chaos", "accounting", "--timeout", "5")
        assert refused.returncode == 1 and "make run FAULTS=1" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1

        # The database logins are the stack's own, readable by its user only; `rackctl check` finds its
        # read-only one there without being told.
        logins = home / "secrets" / "db"
        assert logins.stat().st_mode & 0o777 == 0o700
        for role in ("instance_manager", "accounting", "recovery", "check"):
            assert (logins / f"{role}.url").stat().st_mode & 0o777 == 0o600
        check = rackctl("check", "--no-at-rest")
        assert check.returncode == 0 and "every invariant holds" in check.stdout, check

        walk_the_readme(rackctl)


def readme_commands() -> list[tuple[list[str], str]]:
    """Every `$ rackctl ...` line of the README's console blocks, with the first line it shows after it."""
    out = []
    for block in re.findall(r"```console\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ rackctl "):
                command = re.split(r"\s+#", line[len("$ rackctl ") :])[0]
                shown = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("$") else ""
                out.append((shlex.split(command), shown))
    return out


def walk_the_readme(rackctl: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """The README's walkthrough, as written, against `make run` with its default context: each command
    succeeds, or fails with the one-line error the README shows."""
    commands = readme_commands()
    assert len(commands) > 15
    for args, shown in commands:
        if "--from-pool" in args:  # "once the pool's VMs are up"
            pool = args[args.index("--from-pool") + 1]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = rackctl("pool", "show", pool, "--json")
                if r.returncode == 0 and json.loads(r.stdout)["idle"] >= 1:
                    break
                time.sleep(0.5)
        r = rackctl(*args)
        if shown.startswith("rackctl: error:"):
            assert r.returncode == 1 and r.stderr.strip() == shown, (args, r)
        else:
            assert r.returncode == 0, (args, r)
            if shown:
                assert r.stdout.split()[:1] == shown.split()[:1], (args, shown, r.stdout)
        if args[:2] == ["sim", "sled"] and args[2] == "reboot":
            time.sleep(3)  # the instance is restarted before the README looks at it
