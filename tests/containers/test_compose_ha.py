"""docker-compose.ha.yml, whole: three nats-server nodes in one cluster, PostgreSQL under Patroni (a primary
and a synchronous standby, three etcd members), two containers of each service. Brought up with the images
built here, walked through as the README walks `make run`; then the container of one broker node is
stopped, then the Patroni primary's while an instance is being started, and the stack answers again (the
instance runs, a new start succeeds, `rackctl check` finds every invariant holding); then taken down with
its volumes.

Run by `make test-containers` (marker `containers`), after deploy/containers.sh built the images.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deploy.nats_cluster import CLUSTER_NAME
from deploy.stack import REPLICATED, ROOT, free_port
from tests.containers.test_containers import IMAGE, NATS_IMAGE, RACKCTL, docker
from tests.test_make_run import walk_the_readme

pytestmark = [pytest.mark.containers, pytest.mark.timeout(720)]

PATRONI_IMAGE = os.environ.get("RACKPLANE_PATRONI_IMAGE", "rackplane-patroni:local")
COMPOSE_FILE = ROOT / "docker-compose.ha.yml"
UP_WITHIN = 300.0
"""Seconds for `up` and every container healthy: a Patroni bootstrap, a base backup, the broker's meta
leader, then seven service containers that wait for all of it (some 2 min on a busy 2-core machine)."""
TRANSIENT = re.compile(r"try again|no reply on|connection was lost|no service answers")
"""What rackctl says when the stack could not serve a command for the moment: asked again."""
FAILOVER_WITHIN = 120.0
"""Seconds for the stack to answer again after a node's container stops: Patroni's leader TTL (20 s) at
most, when the primary goes without releasing its lock, and the services' reconnects."""


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    for image in (IMAGE, NATS_IMAGE, PATRONI_IMAGE):
        if docker("image", "inspect", image, check=False).returncode != 0:
            pytest.fail(f"no image {image}: `make test-containers` builds it (deploy/containers.sh images)")


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 2.0) -> Any:
    """`check()` until it returns something true; its last answer is in the failure's message."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s (last: {found!r})")
        time.sleep(interval)


def test_the_ha_compose_stack_answers_after_losing_a_broker_node_and_the_primary() -> None:
    project = f"rackplane-ha-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="rackplane-compose-ha-"))
    nats_ports = [free_port() for _ in range(3)]
    pg_ports = [free_port() for _ in range(2)]
    override = work / "override.yml"
    # PostgreSQL on loopback for `rackctl check` (its read-only login); sleds report every second.
    override.write_text(
        "services:\n"
        + "".join(f'  pg{i}:\n    ports:\n      - "127.0.0.1:{p}:5432"\n' for i, p in enumerate(pg_ports))
        + "  sled-agent:\n    environment:\n      RACKPLANE_INVENTORY_INTERVAL: '1'\n"
    )
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": project,
        "RACKPLANE_IMAGE": IMAGE,
        "RACKPLANE_NATS_IMAGE": NATS_IMAGE,
        "RACKPLANE_PATRONI_IMAGE": PATRONI_IMAGE,
        "RACKPLANE_NATS_PORT": str(nats_ports[0]),
        "RACKPLANE_NATS_PORT_2": str(nats_ports[1]),
        "RACKPLANE_NATS_PORT_3": str(nats_ports[2]),
    }
    compose = ["docker-compose", "-f", str(COMPOSE_FILE), "-f", str(override)]

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )

    def container(service: str) -> str:
        return f"{project}_{service}_1"

    def patroni_view() -> dict[str, str]:
        """Who is what (member name -> role), as the first Patroni node that answers says (none: {})."""
        for node in ("pg0", "pg1"):
            try:
                r = docker(
                    "exec",
                    container(node),
                    "python3",
                    "-c",
                    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8008/cluster', "
                    "timeout=3).read().decode())",
                    check=False,
                    timeout=30,
                )
            except subprocess.TimeoutExpired:  # a busy machine: asked again by the caller's wait
                continue
            if r.returncode == 0:
                members = json.loads(r.stdout)["members"]
                return {m["name"]: m["role"] for m in members if m.get("state") in ("running", "streaming")}
        return {}

    began = time.monotonic()

    def phase(what: str) -> None:  # where the time went, printed with the test's output
        print(f"{time.monotonic() - began:6.1f}s {what}")

    def jsz(node: str) -> dict[str, Any]:
        query = "http://127.0.0.1:8222/jsz?accounts=true&streams=true&config=true"
        r = docker("exec", container(node), "wget", "-q", "-O", "-", query, timeout=60)
        return dict(json.loads(r.stdout))

    try:
        up = run("up", "-d", timeout=UP_WITHIN)
        assert up.returncode == 0, up.stderr[-3000:]
        phase("up")
        seed = docker("run", "--rm", "-v", f"{project}_identities:/i:ro", IMAGE, "cat", "/i/console.nk")
        login = docker("run", "--rm", "-v", f"{project}_db-logins:/d:ro", IMAGE, "cat", "/d/check.url")
        (work / "console.nk").write_text(seed.stdout)
        (work / "console.nk").chmod(0o600)
        # every broker node in the context, as every service is given them
        url = ",".join(f"nats://127.0.0.1:{p}" for p in nats_ports)
        context = work / "context.json"
        context.write_text(json.dumps({"url": url, "nkey": str(work / "console.nk"), "identity": "console"}))
        # the checker's login names both nodes, with the attribute that finds the primary
        database, hosts = re.subn(
            r"@pg0:5432,pg1:5432/", f"@127.0.0.1:{pg_ports[0]},127.0.0.1:{pg_ports[1]}/", login.stdout.strip()
        )
        assert hosts == 1 and "target_session_attrs=primary" in database, "check.url names both nodes"
        cli_env = {**os.environ, "RACKCTL_CONTEXT": str(context), "DATABASE_URL": database}
        cli_env.pop("NATS_URL", None)

        def rackctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [RACKCTL, *args], cwd=work, env=cli_env, capture_output=True, text=True, timeout=timeout
            )

        def answer(*args: str) -> subprocess.CompletedProcess[str]:
            """A command asked again while the stack says it cannot serve it now (a node's loss in
            progress: `try again`, no reply, the connection lost): it must be answered within
            FAILOVER_WITHIN. A create whose first answer was lost finds its object made."""
            deadline = time.monotonic() + FAILOVER_WITHIN
            asked = 0
            while True:
                r = rackctl(*args)
                asked += 1
                if asked > 1 and r.returncode == 1 and "already exists" in r.stderr:
                    return subprocess.CompletedProcess(r.args, 0, r.stdout, r.stderr)
                if r.returncode == 0 or not TRANSIENT.search(r.stderr) or time.monotonic() > deadline:
                    return r
                print(f"rackctl {' '.join(args)}: {r.stderr.strip()}")
                time.sleep(1)

        def healthy() -> list[str]:
            ps = run("ps").stdout.splitlines()
            return [line.split()[0] for line in ps if "(healthy)" in line]

        # every service container healthy: two of each replicated one, the simulator, and the nodes
        expected = 2 * len(REPLICATED) + 1 + 3 + 2 + 1
        wait_for("every container healthy", lambda: len(healthy()) >= expected or None, UP_WITHIN)
        for service in REPLICATED:
            names = {f"{project}_{service.replace('_', '-')}_{i}" for i in (1, 2)}
            assert names <= set(healthy()), (names, healthy())
        wait_for(
            "a Patroni leader and a synchronous standby",
            lambda: sorted(patroni_view().values()) == ["leader", "sync_standby"],
            UP_WITHIN,
        )
        phase("every container healthy")

        def sleds() -> int:
            listed = rackctl("sled", "list", "--json")
            return len(json.loads(listed.stdout)) if listed.returncode == 0 else 0

        wait_for("the eight simulated sleds", lambda: sleds() >= 8, 120)
        walk_the_readme(rackctl)
        phase("the README walked through")

        # every stream (rackplane's and the subscribers') at three replicas, on every node's view
        streams = [s for a in jsz("nats1")["account_details"] for s in a.get("stream_detail", [])]
        assert streams and all(s["config"]["num_replicas"] == 3 for s in streams), streams

        # --- one broker node lost: the JetStream meta leader's container stopped -----------------------
        leader = jsz("nats1")["meta_cluster"]["leader"]
        lost_node = f"nats{leader.removeprefix(f'{CLUSTER_NAME}-n')}"
        docker("stop", "-t", "10", container(lost_node), timeout=60)
        phase(f"{lost_node} stopped")
        for args in (
            ["silo", "create", "ha", "--cpus", "32", "--ram", "64GiB", "--storage", "1TiB"],
            ["project", "create", "ha/p"],
        ):
            r = answer(*args)
            assert r.returncode == 0, (f"with {lost_node} stopped", r)
        for name in ("a", "b", "c"):
            r = answer("instance", "create", f"ha/p/{name}", "--cpus", "2", "--ram", "1GiB", "--disk", "1GiB")
            assert r.returncode == 0, r
        started = answer("instance", "start", "ha/p/a", "--wait", "--timeout", str(FAILOVER_WITHIN))
        assert started.returncode == 0, (f"a start with {lost_node} stopped", started)
        phase("ha/p/a started")

        # --- the Patroni primary's container stopped while an instance is being started ----------------
        primary = next(name for name, role in patroni_view().items() if role == "leader")
        starting = subprocess.Popen(
            [RACKCTL, "instance", "start", "ha/p/b", "--wait", "--timeout", str(FAILOVER_WITHIN)],
            cwd=work,
            env=cli_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            docker("stop", "-t", "30", container(primary), timeout=90)
            phase(f"{primary} (the primary) stopped")
            out, err = starting.communicate(timeout=FAILOVER_WITHIN + 60)
        finally:
            if starting.poll() is None:
                starting.kill()
                starting.wait()
        survivor = "pg1" if primary == "pg0" else "pg0"
        wait_for(f"{survivor} leading", lambda: patroni_view().get(survivor) == "leader", FAILOVER_WITHIN)
        phase(f"{survivor} leads")
        if (
            starting.returncode != 0
        ):  # the answer lost with the node: the start is asked again, as a user would
            print(
                f"the start across the failover answered {starting.returncode}: {out.strip()} {err.strip()}"
            )
            again = answer("instance", "start", "ha/p/b", "--wait", "--timeout", str(FAILOVER_WITHIN))
            assert again.returncode == 0, again

        def state(name: str) -> str | None:
            r = rackctl("instance", "show", f"ha/p/{name}", "--json")
            return json.loads(r.stdout)["state"] if r.returncode == 0 else None

        assert wait_for("ha/p/b running", lambda: state("b") == "running", FAILOVER_WITHIN)
        assert state("a") == "running"
        phase("ha/p/b running")
        started = answer("instance", "start", "ha/p/c", "--wait", "--timeout", str(FAILOVER_WITHIN))
        assert started.returncode == 0, (
            f"a start on {survivor} with {primary} and {lost_node} stopped",
            started,
        )
        check = rackctl("check", "--no-at-rest")
        assert check.returncode == 0 and "every invariant holds" in check.stdout, check
        phase("ha/p/c started, every invariant holds")
    except BaseException:
        logs = run("logs", "--no-color", "--tail", "30", timeout=120)  # every container's last lines
        print(logs.stdout)
        raise
    finally:
        down = run("down", "-v", "--remove-orphans", timeout=180)
        shutil.rmtree(work, ignore_errors=True)
        assert down.returncode == 0, down.stderr[-2000:]
