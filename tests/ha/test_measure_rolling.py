"""A rolling restart of every process of `make run HA=1`, one at a time, as an operator does it, while 32
callers start and stop instances (tests/ha/callers.py): each nats-server node by lame duck mode
(`nats-server --signal ldm`: it hands off its stream leaders and moves its clients before it exits), each
Patroni node (the standby first; the primary only after a switchover through Patroni's REST API, as
`patronictl switchover` does), each service process (SIGTERM), the simulator last. The next process goes
only once the last is back: every stream with all three replicas current, the old node the synchronous
standby, the process ready. Every command is sent again until it succeeds (they are idempotent): none
may be given up on, the checker finds nothing and the ledger audits clean.

    .venv/bin/pytest -n 0 -m ha -s -p no:cacheprovider -o timeout=900 tests/ha/test_measure_rolling.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable

import pytest

from deploy.identities import ACCOUNT
from deploy.nats_cluster import NatsCluster
from deploy.patroni import PatroniCluster, installed
from deploy.stack import REPLICATED, SERVICES, Stack, nats_server_binary, replica_key, wait_until
from shared.topology import subjects
from tests.conftest import Rack, assert_invariants, private_rack
from tests.ha.callers import Loss, callers, measure
from tests.ha.test_broker_loss import SILENCE
from tests.test_cli import assert_ok
from tests.test_usage_audit import audit

pytestmark = [
    pytest.mark.ha,
    pytest.mark.timeout(900),
    pytest.mark.skipif(bool(installed()), reason="; ".join(installed())),
]

CALLERS = 32
CALL_TIMEOUT = float(os.environ.get("HA_CALL_TIMEOUT", "5"))
SETTLE = 2.0
"""Seconds of calls between one process back and the next one's stop."""


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    env = {"RACKPLANE_HA": "1", "RACKPLANE_SLEDS": "8", **SILENCE}
    async with private_rack("rolling", **env) as made:
        yield made


def streams_whole(cluster: NatsCluster) -> bool:
    """Every stream has a leader, and its leader sees both other replicas current (a node back has
    caught up)."""
    whole: set[str] = set()
    for node in cluster.nodes:
        info = cluster.jsz(node.index, f"?acc={ACCOUNT}&streams=true")
        for a in info.get("account_details", []):
            for s in a.get("stream_detail", []):
                c = s.get("cluster", {})
                peers = c.get("replicas", [])
                if c.get("leader") == node.name and len(peers) == 2 and all(p.get("current") for p in peers):
                    whole.add(s["name"])
    return whole >= set(subjects.STREAMS)


def restart_nats_node(stack: Stack, i: int) -> None:
    """Lame duck mode, as `nats-server --signal ldm=<pid>`; the node exits by itself once its clients
    are gone, then starts again and catches up."""
    cluster = stack.nats
    assert isinstance(cluster, NatsCluster)
    node = cluster.nodes[i]
    assert node.proc is not None
    subprocess.run([nats_server_binary(), "--signal", f"ldm={node.proc.pid}"], check=True, timeout=10)
    node.proc.wait(60)
    cluster.stop_node(i)  # the exited process forgotten, stack.json rewritten
    cluster.start_node(i)
    cluster.wait_meta_leader()
    wait_until(lambda: streams_whole(cluster), 60, f"every stream current on {node.name}")


def restart_patroni_node(stack: Stack, i: int) -> None:
    """A primary hands over first (a switchover to the synchronous standby); then Patroni is stopped
    (SIGTERM: it stops its PostgreSQL, fast) and started again, and it rejoins as the standby."""
    cluster = stack.postgres
    assert isinstance(cluster, PatroniCluster)
    node = cluster.members[i]
    if cluster.primary() == i:
        other = cluster.members[cluster.wait_standby()]
        body = json.dumps({"leader": node.name, "candidate": other.name}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{node.rest_port}/switchover", body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200, r.read()
        cluster.wait_primary(cluster.ttl + 15, other_than=i)
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    node.proc.wait(60)
    node.proc = None
    stack.write_manifest()
    cluster.start_node(i)
    cluster.wait_standby(i, 120)
    stack.write_manifest()


def restart_service(stack: Stack, key: str) -> None:
    name = stack.services[key].name
    stack.services[key].stop()
    stack.start_service(name, replica=None if key == name else key)
    stack.wait_replicas_ready()


def steps(stack: Stack) -> list[tuple[str, Callable[[], None]]]:
    """Every process of the stack, in the order an operator restarts them."""
    assert isinstance(stack.nats, NatsCluster) and isinstance(stack.postgres, PatroniCluster)
    out: list[tuple[str, Callable[[], None]]] = [
        (n.name, lambda i=n.index: restart_nats_node(stack, i)) for n in stack.nats.nodes
    ]
    pg = stack.postgres
    standby_first = sorted(range(len(pg.members)), key=lambda i: i == pg.primary())
    out += [(pg.members[i].name, lambda i=i: restart_patroni_node(stack, i)) for i in standby_first]
    keys = [k for name in REPLICATED for k in (name, replica_key(name))]
    keys += [name for name in SERVICES if name not in REPLICATED]  # the simulator
    out += [(key, lambda key=key: restart_service(stack, key)) for key in keys]
    return out


async def test_rolling_restart_of_every_process(rack: Rack) -> None:
    stack, _, db = rack
    done: list[Loss] = []
    started = time.monotonic()
    async with callers(rack, CALLERS, CALL_TIMEOUT) as (rec, silo):
        await asyncio.sleep(3)
        base = measure(rec, "none", started + 1, time.monotonic())
        for what, restart in steps(stack):
            at = time.monotonic()
            await asyncio.to_thread(restart)
            await asyncio.sleep(SETTLE)
            done.append(measure(rec, what, at, time.monotonic()))
    took = time.monotonic() - started
    failed = sum(1 for c in rec.calls if not c.ok)
    print(
        f"\nrolling restart of {len(done)} processes under {CALLERS} callers in {took:.0f}s: "
        f"{rec.commands} commands succeeded, {len(rec.lost)} given up on; {len(rec.calls)} calls, "
        f"{failed} attempts failed and were sent again ({rec.codes()}); baseline gap "
        f"{', '.join(f'{k} {v:.2f}s' for k, v in base.gaps.items())}\n" + "\n".join(x.line() for x in done)
    )
    assert not rec.lost, f"commands given up on: {rec.lost}"
    await assert_invariants(db, timeout=30)
    assert_ok(await audit(stack, silo, "--settle", "20"))
    dead = [key for key, svc in stack.services.items() if not svc.alive]
    assert not dead, {key: stack.logs(key) for key in dead}
