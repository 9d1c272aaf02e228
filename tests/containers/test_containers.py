"""rackplane in containers (`make test-containers`, after `make test` in CI): the images built here
without a registry (deploy/containers.sh), PostgreSQL and nats-server run by testcontainers under the
services, and the whole docker-compose.yml brought up, walked through as the README walks `make run`,
and taken down.

Run by `pytest -m containers tests/containers` once the images exist; `make test` leaves them out.
testcontainers' reaper (Ryuk) is an image from a registry, so it is off: every container here is stopped
by the test that started it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.community.postgres import PostgresContainer
from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import LogMessageWaitStrategy

from deploy.security import BrokerSecurity
from deploy.stack import ROOT, Stack, free_port
from rackctl.client import Client
from tests.conftest import FAST, GiB, eventually, sleds_known, wait_state
from tests.test_make_run import walk_the_readme

pytestmark = pytest.mark.containers

IMAGE = os.environ.get("RACKPLANE_IMAGE", "rackplane:local")
NATS_IMAGE = os.environ.get("RACKPLANE_NATS_IMAGE", "rackplane-nats:local")
POSTGRES_IMAGE = os.environ.get("RACKPLANE_POSTGRES_IMAGE", "rackplane-postgres:local")
RACKCTL = str(Path(sys.executable).parent / "rackctl")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {r.stderr.strip()}")
    return r


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    for image in (IMAGE, NATS_IMAGE, POSTGRES_IMAGE):
        if docker("image", "inspect", image, check=False).returncode != 0:
            pytest.fail(f"no image {image}: `make test-containers` builds it (deploy/containers.sh images)")


# --- testcontainers: the broker and the database in containers, the services as processes -------------


@pytest.fixture
def postgres() -> Iterator[str]:
    with PostgresContainer(
        POSTGRES_IMAGE, username="postgres", password=uuid.uuid4().hex, dbname="rackplane", driver=None
    ) as pg:
        yield pg.get_connection_url().replace("localhost", "127.0.0.1")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[str, BrokerSecurity]]:
    """nats-server in a container with rackplane's own accounts and nkeys (the identities of this test run),
    the config mounted at the same path, so that its includes resolve."""
    security = BrokerSecurity(tmp_path)
    conf = tmp_path / "server.conf"
    conf.write_text(
        f"listen: 0.0.0.0:4222\nserver_name: rackplane-container\njetstream {{\n  store_dir: /data\n}}\n"
        f"include {json.dumps(security.server_conf().name)}\n"
    )
    mounts = {str(tmp_path): str(tmp_path), str(security.store.dir): str(security.store.dir)}
    container = (
        DockerContainer(NATS_IMAGE)
        .with_command(f"-c {conf}")
        .with_exposed_ports(4222)
        .waiting_for(LogMessageWaitStrategy("Server is ready"))
    )
    for host, inside in mounts.items():
        container = container.with_volume_mapping(host, inside, "ro")
    with container:
        yield f"nats://127.0.0.1:{container.get_exposed_port(4222)}", security


async def test_a_start_and_a_stop_with_the_broker_and_the_database_in_containers(
    broker: tuple[str, BrokerSecurity], postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nats_url, security = broker
    monkeypatch.setenv("NATS_NKEY_FILE", security.seed("stream-admin"))  # the streams, as deploy makes them
    stack = Stack(tmp_path / "stack", nats_url, postgres, {**FAST, "RACKPLANE_SLEDS": "2"})
    stack.security = security  # each service with its own credential
    stack.start()
    try:
        client = await Client.connect(nats_url)
        try:
            await eventually(lambda: sleds_known(client, 2), timeout=30)
            await client.silo_create("boxed")
            await client.project_create("boxed", "p")
            await client.instance_create("boxed", "p", "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
            await client.instance("start", "boxed", "p", "vm")
            view = await wait_state(client, "boxed", "p", "vm", "running", timeout=30)
            assert view["active_vmm_id"]
            await client.instance("stop", "boxed", "p", "vm")
            await wait_state(client, "boxed", "p", "vm", "stopped", timeout=30)
            usage = await eventually(lambda: _usage_settled(client), timeout=30)
            assert usage["vcpus"] == 0 and usage["disk_bytes"] == GiB
        finally:
            await client.close()
    finally:
        stack.stop()


async def _usage_settled(client: Client) -> Any:
    usage = (await client.usage("boxed", "p"))["usage"]
    return usage if usage["vcpus"] == 0 else None


# --- docker-compose.yml, whole ----------------------------------------------------------------------------


def test_the_compose_stack_runs_the_readme_walkthrough() -> None:
    """`docker-compose up` with the images built here, then the README's walkthrough through rackctl on the
    host (a context with the console's credential from the identities volume; the checker's read-only
    login from the db-logins volume, PostgreSQL published on loopback for it by an override), then
    `docker-compose down -v`."""
    project = f"rackplane-test-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="rackplane-compose-"))
    nats_port, pg_port = free_port(), free_port()
    override = work / "override.yml"
    override.write_text(
        "services:\n  postgres:\n    ports:\n"
        f'      - "127.0.0.1:{pg_port}:5432"\n'
        "  sled-agent:\n    environment:\n      RACKPLANE_INVENTORY_INTERVAL: '1'\n"
    )
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": project,
        "RACKPLANE_IMAGE": IMAGE,
        "RACKPLANE_NATS_IMAGE": NATS_IMAGE,
        "RACKPLANE_POSTGRES_IMAGE": POSTGRES_IMAGE,
        "RACKPLANE_NATS_PORT": str(nats_port),
        "RACKPLANE_NATS_MONITOR_PORT": str(free_port()),
    }
    compose = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "-f", str(override)]

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )

    try:
        up = run("up", "-d")
        assert up.returncode == 0, up.stderr[-3000:]
        seed = docker("run", "--rm", "-v", f"{project}_identities:/i:ro", IMAGE, "cat", "/i/console.nk")
        login = docker("run", "--rm", "-v", f"{project}_db-logins:/d:ro", IMAGE, "cat", "/d/check.url")
        (work / "console.nk").write_text(seed.stdout)
        (work / "console.nk").chmod(0o600)
        context = work / "context.json"
        url, nkey = f"nats://127.0.0.1:{nats_port}", str(work / "console.nk")
        context.write_text(json.dumps({"url": url, "nkey": nkey, "identity": "console"}))
        database = login.stdout.strip().replace("@postgres:5432/", f"@127.0.0.1:{pg_port}/")
        cli_env = {**os.environ, "RACKCTL_CONTEXT": str(context), "DATABASE_URL": database}
        cli_env.pop("NATS_URL", None)

        def rackctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [RACKCTL, *args], cwd=work, env=cli_env, capture_output=True, text=True, timeout=120
            )

        deadline = time.monotonic() + 180
        while True:  # every service up (healthchecks pass), and the eight simulated sleds known
            listed = rackctl("sled", "list", "--json")
            if listed.returncode == 0 and len(json.loads(listed.stdout)) >= 8:
                break
            assert time.monotonic() < deadline, (listed.stderr, run("ps").stdout)
            time.sleep(2)
        walk_the_readme(rackctl)
        ps = run("ps")
        for service in ("sled-agent", "instance-manager", "accounting", "recovery"):
            assert any(service in line and "(healthy)" in line for line in ps.stdout.splitlines()), ps.stdout
    except BaseException:
        logs = run("logs", "--tail", "40")
        print(logs.stdout[-20000:])
        raise
    finally:
        down = run("down", "-v", "--remove-orphans")
        shutil.rmtree(work, ignore_errors=True)
        assert down.returncode == 0, down.stderr[-2000:]
