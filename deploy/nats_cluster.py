"""Three nats-server nodes in one JetStream cluster, on one machine: the broker of `make run HA=1`.

Clustering, replication and failover are nats-server's own (routes between the nodes, Raft for JetStream's
meta layer and each stream's replicas): nothing here does more than what a config file and a signal do.
Each node has its own name, ports, store and pid file, and routes to the other two; all share the same
include of the accounts and users (and TLS) that deploy/security.py writes, so one identity works on every
node. Clients are given every node's URL (`url`, comma-separated) and move to a survivor when theirs dies.
The API mirrors `deploy.stack.Nats`: `url`, `start()`, `stop()`, `kill(i)`, `start_node(i)`, `reload()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.stack import end, free_port, nats_server_binary, port_open, wait_until

CLUSTER_NAME = "rackplane"
META_LEADER_WITHIN = 30.0
"""Seconds a (re)started cluster has to elect its JetStream meta leader: until then no stream can be made
or read."""


@dataclass
class Node:
    """One member: its ports (client, cluster route, HTTP monitoring) and its process."""

    index: int
    dir: Path
    port: int
    cluster_port: int
    http_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """The server name: JetStream's Raft groups know a node by it, so it never changes across restarts."""
        return f"{CLUSTER_NAME}-n{self.index + 1}"

    @property
    def pid_file(self) -> Path:
        return self.dir / "nats.pid"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive and self.proc else None


@dataclass
class NatsCluster:
    """`size` nats-server nodes with JetStream, each restartable on its own ports and store."""

    dir: Path
    size: int = 3
    conf: Path | None = None
    """The identities and their permissions, and TLS (deploy/security.py), included by every node."""
    scheme: str = "nats"
    base_port: int = 0
    """Client ports base_port, base_port+1...; cluster ports 2000 above, HTTP ports 4000 above (`make run
    HA=1`: 4222-4224, 6222-6224, 8222-8224, nats-server's usual ones). 0: free ports."""
    on_change: Callable[[], None] | None = None
    """Called after a node starts or stops (the stack rewrites its stack.json)."""
    nodes: list[Node] = field(init=False)

    def __post_init__(self) -> None:
        def ports(offset: int) -> list[int]:
            if self.base_port:
                return [self.base_port + offset + i for i in range(self.size)]
            return [free_port() for _ in range(self.size)]

        client, route, http = ports(0), ports(2000), ports(4000)
        self.nodes = [Node(i, self.dir / f"n{i + 1}", client[i], route[i], http[i]) for i in range(self.size)]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what clients are given (shared/bus/connect.py splits it)."""
        return ",".join(self.node_url(i) for i in range(self.size))

    def node_url(self, i: int) -> str:
        return f"{self.scheme}://127.0.0.1:{self.nodes[i].port}"

    @property
    def pid_files(self) -> list[Path]:
        return [n.pid_file for n in self.nodes]

    def _write_config(self, node: Node) -> Path:
        """All of a node's settings in its config file (a reload compares the whole file with the running
        config): address, name, pid file, monitoring, store, the cluster and its routes to the others, and
        the include of `conf`."""
        path = node.dir / "server.conf"
        include = f"include {json.dumps(os.path.relpath(self.conf, node.dir))}\n" if self.conf else ""
        routes = "".join(
            f"    nats-route://127.0.0.1:{other.cluster_port}\n" for other in self.nodes if other is not node
        )
        path.write_text(
            f"listen: 127.0.0.1:{node.port}\nserver_name: {node.name}\n"
            f"pid_file: {json.dumps(str(node.pid_file))}\n"
            f"http: 127.0.0.1:{node.http_port}\n"
            # `--signal ldm` (a graceful stop): clients moved off over 30 s (its least), not 2 min
            "lame_duck_grace_period: 1s\nlame_duck_duration: 30s\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(node.dir / 'jetstream'))}\n}}\n"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{node.cluster_port}\n"
            f"  routes: [\n{routes}  ]\n}}\n{include}"
        )
        return path

    def _spawn(self, node: Node) -> None:
        node.dir.mkdir(parents=True, exist_ok=True)
        with open(node.dir / "nats.log", "ab") as log:
            node.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self._write_config(node))],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self) -> NatsCluster:
        """Every node, then wait for the cluster's JetStream meta leader (streams can be made after)."""
        # A single server's pid file, left in this folder by an earlier `make run` without HA: `rackctl
        # subscriber` would signal it rather than the nodes (deploy/subscribers.py, reload_by_pid_file).
        (self.dir / "nats.pid").unlink(missing_ok=True)
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_listening(node)
            self.wait_meta_leader()
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        self._changed()
        return self

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def start_node(self, i: int) -> None:
        """Start node `i` again (after a kill or stop): same name, ports and store; it catches up from the
        others by itself."""
        node = self.nodes[i]
        if node.alive:
            return
        self._spawn(node)
        self._changed()
        self._wait_listening(node)

    def _wait_listening(self, node: Node) -> None:
        """Until the node takes clients; one that exits (its port taken, say) fails at once, with its log."""

        def listening() -> bool:
            if not node.alive:
                log = (node.dir / "nats.log").read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"nats-server {node.name} exited:\n" + "\n".join(log))
            return port_open(node.port)

        wait_until(listening, 15, f"nats-server {node.name}")

    def jsz(self, i: int | None = None, query: str = "") -> dict[str, Any]:
        """A node's `/jsz` (JetStream's state as that node sees it): node `i`, or the first alive one."""
        nodes = [self.nodes[i]] if i is not None else [n for n in self.nodes if n.alive]
        last: Exception | None = None
        for node in nodes:
            try:
                url = f"http://127.0.0.1:{node.http_port}/jsz{query}"
                with urllib.request.urlopen(url, timeout=2) as r:
                    return dict(json.loads(r.read()))
            except (OSError, ValueError) as e:
                last = e
        raise ConnectionError(f"no nats-server node answered /jsz: {last}")

    def meta_leader(self, i: int | None = None) -> str | None:
        """The JetStream meta leader as node `i` (or the first alive) sees it."""
        try:
            return self.jsz(i).get("meta_cluster", {}).get("leader") or None
        except ConnectionError:
            return None

    def wait_meta_leader(self, timeout: float = META_LEADER_WITHIN) -> str:
        """Until every node is alive and sees the same meta leader: the cluster is whole, and a stream at
        three replicas can be placed (with a node missing, a quorum of two elects a leader all the same)."""

        def whole() -> bool:
            for node in self.nodes:
                if not node.alive:
                    raise RuntimeError(f"nats-server {node.name} exited (see {node.dir / 'nats.log'})")
            seen = [self.meta_leader(n.index) for n in self.nodes]
            return None not in seen and len(set(seen)) == 1

        wait_until(whole, timeout, "the JetStream meta leader")
        return self.meta_leader() or ""

    def stream_leader(self, stream: str, account: str) -> int | None:
        """The index of the node that leads `stream` of `account`, or None while it has no leader."""
        try:
            info = self.jsz(query=f"?acc={account}&streams=true")
        except ConnectionError:
            return None
        for acc in info.get("account_details", []):
            for s in acc.get("stream_detail", []):
                if s.get("name") == stream and (leader := s.get("cluster", {}).get("leader")):
                    return next((n.index for n in self.nodes if n.name == leader), None)
        return None

    def reload(self) -> None:
        """Every live node reads its config again (new or rotated identities), as `nats-server --signal
        reload` does."""
        for node in self.nodes:
            if node.alive and node.proc:
                self._write_config(node)
                node.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)

    def _stop_node(self, node: Node, sig: int) -> None:
        end(node.proc, sig)
        node.proc = None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Every node, asked at once, then awaited (each is killed if it takes more than 30 s)."""
        for node in self.nodes:
            if node.proc and node.proc.poll() is None:
                node.proc.send_signal(sig)
        for node in self.nodes:
            self._stop_node(node, sig)

    def kill(self, i: int) -> None:
        """Node `i` dies as in a crash (SIGKILL): the others keep the cluster and its streams going."""
        self._stop_node(self.nodes[i], signal.SIGKILL)
        self._changed()

    def stop_node(self, i: int) -> None:
        self._stop_node(self.nodes[i], signal.SIGTERM)
        self._changed()

    def processes(self) -> list[dict[str, Any]]:
        """Each node for stack.json: role, name, pid and ports."""
        return [
            {
                "role": "nats",
                "name": n.name,
                "pid": n.pid,
                "ports": {"client": n.port, "cluster": n.cluster_port, "http": n.http_port},
                "dir": str(n.dir),
            }
            for n in self.nodes
        ]
