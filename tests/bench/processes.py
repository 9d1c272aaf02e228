"""The processes of a benchmark's stack, by name, and what they use (/proc): memory (PSS) and CPU time, so
that a benchmark says where the machine's memory and cores went, not only how fast it was."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.stack import Stack

TICK = os.sysconf("SC_CLK_TCK")


def processes(stack: Stack) -> dict[str, list[int]]:
    """Every process of the stack by name: each service process (replicas by their own key),
    nats-server, postgres (the postmaster and all its backends), and this benchmark's own ("client")."""
    out = {name: [svc.proc.pid] for name, svc in stack.services.items() if svc.proc}
    nats = getattr(stack.nats, "nodes", [stack.nats])  # the HA stack's: three nodes
    out["nats-server"] = [n.proc.pid for n in nats if n is not None and n.proc]
    pg = getattr(stack.postgres, "members", [stack.postgres])  # the HA stack's: two, under Patroni
    for data in [node.data for node in pg if node is not None]:
        master = int((data / "postmaster.pid").read_text().split()[0])
        out.setdefault("postgres", []).extend(
            [master]
            + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == master]
        )
    members = getattr(stack.postgres, "members", [])
    if members:
        out["patroni"] = [n.proc.pid for n in members if n.proc]
    out["client"] = [os.getpid()]
    return out


def pss_mib(pid: int) -> float:
    """The process's proportional set size: its own memory, plus its share of what it shares (PostgreSQL's
    shared buffers are counted once over all its processes, not once per backend as RSS would)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # gone
    return 0.0


def memory(stack: Stack) -> dict[str, float]:
    """Memory of each process (PSS), MiB."""
    return {name: sum(pss_mib(p) for p in pids) for name, pids in processes(stack).items()}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # gone
    return (int(fields[11]) + int(fields[12])) / TICK


SERVERS_OWN = {
    b"autovacuum",
    b"logical",
    b"background",
    b"parallel",
    b"walsender",
    b"walreceiver",
    b"startup",
}
"""The first word of the titles of PostgreSQL's own processes that a login's would not have."""


def postgres_login(pid: int) -> str | None:
    """The login a PostgreSQL backend works for, from its title (`postgres: [<cluster name>:] <login>
    <database> <client> <activity>`; Patroni names the cluster); None for the server's own processes
    (the postmaster, the writers, autovacuum, a parallel worker)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return None
    if title[1:2] and title[1].endswith(b":"):
        title = title[:1] + title[2:]
    if len(title) < 5 or title[0] != b"postgres:" or title[1] in SERVERS_OWN:
        return None
    return title[1].decode()


@contextmanager
def cpu_split(stack: Stack) -> Iterator[dict[str, float]]:
    """CPU seconds each of the stack's processes used inside the block (filled in when it ends), PostgreSQL's
    by the login each backend serves (`postgres:instance_manager`; `postgres` for its own processes). A
    backend PostgreSQL forks inside it counts from zero; one that ends inside it is not counted."""
    before = {pid: cpu_seconds(pid) for pids in processes(stack).values() for pid in pids}
    used: dict[str, float] = {}
    yield used
    for name, pids in processes(stack).items():
        for pid in pids:
            login = postgres_login(pid) if name == "postgres" else None
            key = f"postgres:{login}" if login else name
            used[key] = used.get(key, 0.0) + cpu_seconds(pid) - before.get(pid, 0.0)


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
