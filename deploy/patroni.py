"""PostgreSQL under an HA manager: Patroni with etcd, on one machine, for `make run HA=1` and the HA tests.

`PatroniCluster` mirrors `deploy.stack.Postgres` (`dir`, `database`, `url`, `start()`, `stop()`, `kill()`),
so that a stack swaps one for the other in one line; its `url` is a multi-host DSN over every node with
`target_session_attrs=read-write`, so a client always lands on whichever node leads now. Clustering,
replication and failover are Patroni's and PostgreSQL's own: nothing here decides who leads.

Three etcd members (a quorum of two) hold the leader key, and every Patroni node is given all three: the
key, and so the primary, survive the loss of any one member, as they survive the loss of a Patroni node.
A real deployment puts each member on a machine of its own (three, or five to survive two losses).

Settings (docs/architecture.md, "PostgreSQL under Patroni", says why):
- `synchronous_mode: true`, not strict: a commit is acknowledged once the synchronous standby has it,
  and only that standby may be promoted, so no acknowledged transaction is lost with the primary; with the
  standby gone, the primary goes on alone (writes stay up; durability is one node's until it is back).
- leader TTL 20 s, loop_wait 5 s, retry_timeout 7 s (loop_wait + 2 * retry_timeout <= ttl, as Patroni
  asks): a dead primary's lock expires within 20 s, and the standby takes over on its next look.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from deploy.stack import PG_USER, _hand_to_postgres, create_database, end, free_port, pg_binary, run_sync

TTL = 20
"""Seconds a leader's lock lives without renewal: the longest a dead primary holds the cluster."""
LOOP_WAIT = 5
RETRY_TIMEOUT = 7
SUPERUSER = "postgres"
REPLICATOR = "replicator"
REWINDER = "rewinder"


def installed() -> list[str]:
    """What is missing to run a cluster here, one line each (empty: nothing)."""
    missing = [b for b in ("patroni", "etcd") if not _which(b)]
    return [f"{', '.join(missing)} not found: apt-get install patroni etcd-server"] if missing else []


def _which(name: str) -> str | None:
    """On PATH, or where Debian's packages put it (a service's PATH may be a short one)."""
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin")


def _binary(name: str) -> str:
    found = _which(name)
    if found is None:
        raise FileNotFoundError(installed()[0])
    return found


@dataclass
class Node:
    """One Patroni node: the Patroni process and the PostgreSQL it manages, on ports of its own."""

    name: str
    dir: Path
    port: int = field(default_factory=free_port)
    rest_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def config(self) -> Path:
        return self.dir / "patroni.yml"

    @property
    def log(self) -> Path:
        return self.dir / "patroni.log"

    def rest(self, path: str, timeout: float = 1.0) -> Any:
        """Patroni's REST API on this node: the JSON it answers (also with a 503, as /replica does)."""
        url = f"http://127.0.0.1:{self.rest_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"null")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class EtcdMember:
    """One etcd member: its data folder and ports (the peer port is kept in its data: it stays)."""

    name: str
    dir: Path
    port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """It answers, and is part of a quorum that has a leader."""
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        return False


ETCD_MEMBERS = 3
"""A quorum of two: the leader key survives the loss of any one member."""


@dataclass
class PatroniCluster:
    """Three etcd members and `nodes` Patroni nodes, each managing a PostgreSQL 15 data folder of its own.
    Owns what it started, and only that; everything lives under `dir` (the credentials too, 0600)."""

    dir: Path
    nodes: int = 2
    database: str = "rackplane"
    ttl: int = TTL
    loop_wait: int = LOOP_WAIT
    retry_timeout: int = RETRY_TIMEOUT
    scope: str = "rackplane"
    members: list[Node] = field(default_factory=list)
    etcd: list[EtcdMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        """The ports of an earlier start in `dir`, if any: etcd keeps its peer address in its data, and
        `make run` finds its database where it was."""
        saved = self.dir / "cluster.json"
        if saved.exists():
            was = json.loads(saved.read_text())
            self.etcd = [
                EtcdMember(m["name"], self.dir / m["name"], m["port"], m["peer_port"])
                for m in was.get("etcd", [])
            ]
            self.members = [
                Node(m["name"], self.dir / m["name"], m["port"], m["rest_port"]) for m in was["nodes"]
            ]
            self.nodes = len(self.members)
        if not self.members:
            self.members = [Node(f"pg{i}", self.dir / f"pg{i}") for i in range(self.nodes)]
        if not self.etcd:
            self.etcd = [EtcdMember(f"etcd{i}", self.dir / f"etcd{i}") for i in range(ETCD_MEMBERS)]

    # --- where to connect ---

    @property
    def url(self) -> str:
        """The superuser's, over every node, read-write only: for deploy (roles, the database) and tests."""
        return self._url(self.database)

    @property
    def admin_url(self) -> str:
        return self.url

    @property
    def port(self) -> int:
        """The leader's port (the first node's while none leads): for a line that says where it listens."""
        return self.members[self.primary() or 0].port

    def _url(self, database: str) -> str:
        password = quote(self._secret(SUPERUSER), safe="")
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.members)
        return f"postgresql://{SUPERUSER}:{password}@{hosts}/{database}?target_session_attrs=read-write"

    def _secret(self, role: str) -> str:
        """A role's password, generated on first use and kept in `<dir>/secrets/<role>.pw`."""
        path = self.dir / "secrets" / f"{role}.pw"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(path.parent, 0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
        return path.read_text().strip()

    # --- lifecycle ---

    def start(self, timeout: float = 90) -> PatroniCluster:
        """etcd, then every node that is not running (again, after a stop or a kill: the same folders and
        ports); returns once one leads and a standby streams as its synchronous one."""
        self.dir.mkdir(parents=True, exist_ok=True)
        saved = {
            "etcd": [{"name": m.name, "port": m.port, "peer_port": m.peer_port} for m in self.etcd],
            "nodes": [{"name": n.name, "port": n.port, "rest_port": n.rest_port} for n in self.members],
        }
        (self.dir / "cluster.json").write_text(json.dumps(saved, indent=2) + "\n")
        try:
            self.start_etcd()
            for i, node in enumerate(self.members):
                new = not (node.data / "PG_VERSION").exists()
                self._write_config(node)
                self.start_node(i)
                if i == 0 and new:  # the first bootstraps (initdb); the others copy it (pg_basebackup)
                    self._wait(lambda: self.primary() == 0, timeout, "the first Patroni node as leader")
            self.wait_standby(timeout=timeout)
            run_sync(create_database(self._url("postgres"), self.database))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, mode: str = "fast") -> None:
        """Every node (Patroni stops its PostgreSQL, fast), then etcd; whatever lingers is killed. Mode
        "immediate" (as `Postgres.stop` takes it: a crash) kills every node instead."""
        try:
            if mode == "immediate":
                for i in range(len(self.members)):
                    self.kill_node(i)
            for node in self.members:
                if node.alive and node.proc:
                    node.proc.send_signal(signal.SIGTERM)
            for i, node in enumerate(self.members):
                if node.proc:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        node.proc.wait(30)
                self.kill_node(i)  # a PostgreSQL left behind by a Patroni that could not stop it
        finally:
            for member in self.etcd:
                end(member.proc, timeout=10)
                member.proc = None

    def kill(self) -> None:
        """The leader's whole node, as a machine's loss would (Postgres.kill's counterpart)."""
        if (i := self.primary()) is not None:
            self.kill_node(i)

    def kill_node(self, i: int) -> None:
        """SIGKILL node `i`: Patroni first (so it cannot restart PostgreSQL), then its PostgreSQL's whole
        process group (the postmaster and every backend: Patroni starts it in a session of its own)."""
        node = self.members[i]
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                node.proc.kill()
            node.proc.wait()
            node.proc = None
        pid = node.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(OSError):  # gone already (a stale pid file), or not ours
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"postgres"):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
            for _ in range(100):  # gone, and its port free again
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.05)

    def start_node(self, i: int) -> None:
        """Start node `i`'s Patroni (again): it finds its data and rejoins as a standby of whoever leads,
        rewinding it (pg_rewind) where it went further than the new leader."""
        node = self.members[i]
        if node.alive:
            return
        kw: dict[str, Any] = {}
        if os.geteuid() == 0:  # PostgreSQL refuses root: Patroni and its PostgreSQL run as PG_USER
            pw = pwd.getpwnam(PG_USER)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        log = open(node.log, "ab")  # the child holds it
        try:
            node.proc = subprocess.Popen(
                [_binary("patroni"), str(node.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=node.dir,
                env={
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "HOME": str(node.dir),
                    "LANG": "C.UTF-8",
                },
                start_new_session=True,
                **kw,
            )
        finally:
            log.close()

    # --- who leads ---

    def cluster(self) -> dict[str, Any] | None:
        """Patroni's view of the cluster (GET /cluster), from the first node that answers."""
        for node in self.members:
            if node.alive:
                with contextlib.suppress(OSError, ValueError):
                    return node.rest("/cluster")  # type: ignore[no-any-return]
        return None

    def primary(self) -> int | None:
        """The index of the node that leads, as Patroni's REST API says (None: no leader now)."""
        view = self.cluster() or {}
        for m in view.get("members", []):
            if m.get("role") in ("leader", "master") and m.get("state") == "running":
                return self._index(m["name"])
        return None

    def sync_standby(self) -> int | None:
        """The index of the synchronous standby, if one streams."""
        view = self.cluster() or {}
        for m in view.get("members", []):
            if m.get("role") == "sync_standby" and m.get("state") in ("running", "streaming"):
                return self._index(m["name"])
        return None

    def _index(self, name: str) -> int:
        return next(i for i, n in enumerate(self.members) if n.name == name)

    def wait_primary(self, timeout: float | None = None, other_than: int | None = None) -> int:
        """Wait for a leader (one that is not `other_than`); returns its index."""
        found: list[int] = []

        def leads() -> bool:
            p = self.primary()
            if p is not None and p != other_than:
                found.append(p)
                return True
            return False

        self._wait(leads, timeout or self.ttl + 15, "a Patroni leader")
        return found[-1]

    def wait_standby(self, i: int | None = None, timeout: float = 90) -> int:
        """Wait for a synchronous standby (node `i`, if given: the old primary back) streaming from the
        leader; returns its index."""
        found: list[int] = []

        def ready() -> bool:
            s = self.sync_standby()
            if s is None or (i is not None and s != i) or self.primary() is None:
                return False
            found.append(s)
            return True

        self._wait(ready, timeout, f"node {i} as synchronous standby" if i is not None else "a sync standby")
        return found[-1]

    def _wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            dead = [n.name for n in self.members if n.proc is not None and not n.alive]
            dead += [m.name for m in self.etcd if m.proc is not None and not m.alive]
            if dead:
                raise RuntimeError(f"{what}: {', '.join(dead)} exited\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout:g}s\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 15) -> str:
        out = []
        for path in [m.dir / "etcd.log" for m in self.etcd] + [n.log for n in self.members]:
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                out.append(f"--- {path}\n" + "\n".join(lines))
        return "\n".join(out)

    def processes(self) -> list[dict[str, Any]]:
        """For a stack's stack.json: etcd, and each node (Patroni's pid, its PostgreSQL's, its ports, and
        whether it leads now), so that an operator or a test finds the node to stop."""
        leader = self.primary()
        out: list[dict[str, Any]] = [
            {
                "role": "etcd",
                "name": m.name,
                "pid": m.proc.pid if m.alive and m.proc else None,
                "ports": {"client": m.port, "peer": m.peer_port},
            }
            for m in self.etcd
        ]
        for i, n in enumerate(self.members):
            out.append(
                {
                    "role": "patroni",
                    "name": n.name,
                    "pid": n.proc.pid if n.alive and n.proc else None,
                    "postgres_pid": n.postmaster_pid() if n.alive else None,
                    "ports": {"client": n.port, "rest": n.rest_port},
                    "leader": i == leader,
                }
            )
        return out

    # --- the parts ---

    def start_etcd(self, timeout: float = 30) -> None:
        """Every etcd member that is not running (again, after a kill: the same folder and ports); returns
        once each answers as part of a quorum with a leader."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.etcd)
        started = [m for m in self.etcd if not m.alive]
        for m in started:
            m.dir.mkdir(parents=True, exist_ok=True)
            log = open(m.dir / "etcd.log", "ab")  # the child holds it
            try:
                m.proc = subprocess.Popen(
                    [
                        _binary("etcd"),
                        f"--name={m.name}",
                        f"--data-dir={m.dir / 'data'}",
                        f"--listen-client-urls={m.client_url}",
                        f"--advertise-client-urls={m.client_url}",
                        f"--listen-peer-urls={m.peer_url}",
                        f"--initial-advertise-peer-urls={m.peer_url}",
                        f"--initial-cluster={initial}",
                        f"--initial-cluster-token={self.scope}-etcd",
                        "--initial-cluster-state=new",  # ignored once its data folder holds a member
                        "--logger=zap",
                        "--log-level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                log.close()
        self._wait(lambda: all(m.healthy() for m in started), timeout, "etcd")

    def kill_etcd(self, i: int) -> None:
        """SIGKILL etcd member `i`, as the loss of its machine would."""
        member = self.etcd[i]
        if member.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                member.proc.kill()
            member.proc.wait()
            member.proc = None

    def _write_config(self, node: Node) -> None:
        """Patroni's YAML (JSON is YAML) for `node`, readable by its owner only: it holds the passwords."""
        node.dir.mkdir(parents=True, exist_ok=True)
        _hand_to_postgres(node.dir)
        # where pg_ctl really is (a link in PATH may stand alone): Patroni needs its siblings too
        bin_dir = str(Path(pg_binary("pg_ctl")).resolve().parent)
        hba = [
            f"host replication {REPLICATOR} 127.0.0.1/32 scram-sha-256",
            "host all all 127.0.0.1/32 scram-sha-256",
        ]
        config = {
            "scope": self.scope,
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{m.port}" for m in self.etcd]},
            "bootstrap": {
                "dcs": {
                    "ttl": self.ttl,
                    "loop_wait": self.loop_wait,
                    "retry_timeout": self.retry_timeout,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": True,
                    "synchronous_mode_strict": False,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "max_connections": 300,
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [
                    {"encoding": "UTF8"},
                    {"auth-host": "scram-sha-256"},
                    {"auth-local": "scram-sha-256"},
                ],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": bin_dir,
                "pgpass": str(node.dir / "pgpass"),
                "pg_hba": hba,
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": self._secret(SUPERUSER)},
                    "replication": {"username": REPLICATOR, "password": self._secret(REPLICATOR)},
                    "rewind": {"username": REWINDER, "password": self._secret(REWINDER)},
                },
                "parameters": {
                    # no Unix socket: its path would be too long under a test's folder; TCP only
                    "unix_socket_directories": "",
                    # fsync off as in deploy.stack.Postgres: a kill here takes processes, not the disk's
                    # cache; what a lost primary must not lose is on the synchronous standby
                    "fsync": "off",
                    "synchronous_commit": "on",
                },
                # a node whose history cannot be rewound is copied afresh from the leader
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }
        fd = os.open(node.config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)
        _hand_to_postgres(node.config)
