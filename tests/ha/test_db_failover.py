"""PostgreSQL under Patroni (deploy/patroni.py): the primary's whole node killed, writes through the same
multi-host DSN go on on the promoted standby, no acknowledged write is lost, and the old primary comes back
as the synchronous standby. `make test-ha` runs these (marker `ha`); they need Debian's patroni and
etcd-server, and say so when they are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import pytest

from deploy import dbroles
from deploy.patroni import PatroniCluster, installed
from rackctl.client import Client
from shared import db
from shared.bus import CommandError
from shared.errors import transient
from tests.conftest import (
    GiB,
    assert_invariants,
    eventually,
    make_stack,
    sleds_known,
    unique,
    usage_is,
    wait_state,
)

pytestmark = [
    pytest.mark.ha,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(installed()), reason="; ".join(installed())),
]

SCHEMA = "ha_test"


@pytest.fixture(scope="module")
def cluster() -> Iterator[PatroniCluster]:
    """One cluster for the module: a start costs some 15 s (initdb, a base backup, the sync standby)."""
    base = Path(tempfile.mkdtemp(prefix="rackplane-patroni-"))
    os.chmod(base, 0o755)
    c = PatroniCluster(base)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if os.environ.get("RACKPLANE_KEEP_LOGS") is None:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def pool(cluster: PatroniCluster) -> AsyncIterator[asyncpg.Pool]:
    """The services' own kind of pool (shared.db.create_pool) on the cluster's multi-host DSN."""
    p = await db.create_pool(cluster.url, SCHEMA, max_size=4)
    await p.execute("CREATE TABLE IF NOT EXISTS writes (id bigint PRIMARY KEY, at timestamptz DEFAULT now())")
    yield p
    await p.close()


async def test_create_pool_waits_for_a_read_write_node(cluster: PatroniCluster) -> None:
    """While every node answers but none takes writes (a switchover's moment, or a primary that demoted
    itself on losing etcd), asyncpg says TargetServerAttributeNotMatched: a service starting then must
    wait for a primary, as it waits for a database that is not up yet, not exit."""
    admin = await asyncpg.connect(cluster.url)
    role = "ha_readonly"
    try:
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'ro' SUPERUSER")
        await admin.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
        hosts = cluster.url.split("@", 1)[1]
        url = f"postgresql://{role}:ro@{hosts}"
        deadline = time.monotonic() + 10
        while True:  # what every node says, once the standby has replayed the role: none takes writes
            try:
                await (await asyncpg.connect(url)).close()
            except asyncpg.InvalidPasswordError:  # not on the standby yet (a sync commit is flushed there,
                assert time.monotonic() < deadline  # and replayed a moment later)
                await asyncio.sleep(0.1)
                continue
            except asyncpg.exceptions.TargetServerAttributeNotMatched:
                break
            raise AssertionError("a read-only role found a read-write node")

        async def primary_again() -> None:
            await asyncio.sleep(1.5)
            await admin.execute(f"ALTER ROLE {role} RESET default_transaction_read_only")

        again = asyncio.create_task(primary_again())
        p = await db.create_pool(url, "ha_probe")
        try:
            assert await p.fetchval("SELECT NOT current_setting('transaction_read_only')::bool")
        finally:
            await p.close()
            await again
    finally:
        with contextlib.suppress(asyncpg.UndefinedObjectError):
            await admin.execute(f"DROP OWNED BY {role}")  # its schema
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


class Writer:
    """Writes a new row at a time through the multi-host DSN, and keeps what it was told committed."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.acked: list[int] = []
        self.at: list[float] = []
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Writer:
        self._task = asyncio.create_task(self._run())
        await _until(lambda: len(self.acked) >= 50, 15)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task:
            await self._task

    async def _run(self) -> None:
        i = int(await self.pool.fetchval("SELECT coalesce(max(id), 0) FROM writes WHERE id < 1e9"))
        while not self._stop.is_set():
            i += 1
            try:
                await asyncio.wait_for(self.pool.execute("INSERT INTO writes (id) VALUES ($1)", i), 5)
            except Exception as e:
                self.failures.append(e)
                await asyncio.sleep(0.1)
                continue
            self.acked.append(i)
            self.at.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def more(self, n: int, timeout: float) -> None:
        """Wait for `n` more acknowledged writes."""
        have = len(self.at)
        await _until(lambda: len(self.at) >= have + n, timeout)

    def gap(self, since: float) -> float:
        """How long no write succeeded, across `since`."""
        before = [t for t in self.at if t <= since]
        after = [t for t in self.at if t > since]
        return after[0] - (before[-1] if before else since)

    async def all_present(self) -> set[int]:
        present = {r["id"] for r in await self.pool.fetch("SELECT id FROM writes")}
        lost = sorted(set(self.acked) - present)
        assert not lost, f"{len(lost)} acknowledged writes lost: {lost[:10]}"
        assert all(transient(e) for e in self.failures), [repr(e) for e in self.failures if not transient(e)]
        return present


async def test_primary_killed_standby_promoted_no_acknowledged_write_lost(
    cluster: PatroniCluster, pool: asyncpg.Pool
) -> None:
    old = cluster.wait_primary()
    [leading] = [p for p in cluster.processes() if p.get("leader")]
    assert leading["name"] == cluster.members[old].name and leading["postgres_pid"]
    async with Writer(pool) as w:
        killed_at = time.monotonic()
        cluster.kill_node(old)
        new = await asyncio.to_thread(cluster.wait_primary, cluster.ttl + 10, old)
        promoted = time.monotonic() - killed_at
        await w.more(20, cluster.ttl + 10)
    gap = w.gap(killed_at)
    print(
        f"\nfailover: node {old} killed, node {new} leads after {promoted:.1f}s; "
        f"writes stopped for {gap:.1f}s ({len(w.failures)} attempts failed, all transient)"
    )
    assert new != old
    assert promoted <= cluster.ttl + 5, f"promoted after {promoted:.1f}s (ttl {cluster.ttl}s)"
    assert gap <= cluster.ttl + 5, f"no write succeeded for {gap:.1f}s (ttl {cluster.ttl}s)"
    assert w.failures, "the kill was not felt at all"
    present = await w.all_present()

    # The old primary back: rewound (pg_rewind) onto the new timeline, it streams as the sync standby.
    cluster.start_node(old)
    await asyncio.to_thread(cluster.wait_standby, old, 90)
    log = cluster.members[old].log.read_text(errors="replace")
    how = (
        "pg_rewind" if "running pg_rewind" in log else "a fresh copy" if "basebackup" in log else "as it was"
    )
    print(f"node {old} rejoined as the synchronous standby ({how})")
    await pool.execute("INSERT INTO writes (id) VALUES ($1)", 10**9)
    standby = await asyncpg.connect(cluster.url.split("?")[0].replace(_hosts(cluster), _host(cluster, old)))
    try:
        # a synchronous standby has every commit (it replays it a moment later)
        await _until_async(
            lambda: standby.fetchval("SELECT count(*) FROM ha_test.writes WHERE id = $1", 10**9), 10
        )
        assert await standby.fetchval("SELECT pg_is_in_recovery()")
        assert present <= {r["id"] for r in await standby.fetch("SELECT id FROM ha_test.writes")}
    finally:
        await standby.close()


async def test_standby_killed_the_primary_writes_on_alone(
    cluster: PatroniCluster, pool: asyncpg.Pool
) -> None:
    """synchronous_mode without strict: the standby's loss stalls commits (each waits for the standby)
    only until Patroni, on its next loop, stops asking for one; the primary keeps leading."""
    primary = cluster.wait_primary()
    standby = cluster.wait_standby()
    async with Writer(pool) as w:
        killed_at = time.monotonic()
        cluster.kill_node(standby)
        await w.more(20, cluster.loop_wait + cluster.retry_timeout + 10)
    gap = w.gap(killed_at)
    print(f"\nstandby (node {standby}) killed: commits stalled for {gap:.1f}s; node {primary} still leads")
    assert cluster.primary() == primary
    assert gap <= cluster.loop_wait + cluster.retry_timeout + 3, f"commits stalled for {gap:.1f}s"
    await w.all_present()
    cluster.start_node(standby)
    await asyncio.to_thread(cluster.wait_standby, standby, 90)


async def test_an_etcd_member_lost_the_primary_keeps_its_key(
    cluster: PatroniCluster, pool: asyncpg.Pool
) -> None:
    """Three etcd members keep the leader key: with any one of them killed (the one Patroni's nodes talk
    to first, among them) the other two are a quorum, the primary renews its key, no failover follows,
    and writes go on; the member started again rejoins."""
    primary = cluster.wait_primary()
    assert len(cluster.etcd) == 3
    for i in range(len(cluster.etcd)):
        async with Writer(pool) as w:
            killed_at = time.monotonic()
            cluster.kill_etcd(i)
            # past the leader TTL: a primary that could not renew its key would have demoted itself
            await asyncio.sleep(cluster.ttl + cluster.loop_wait)
            await w.more(20, 10)
        gap = w.gap(killed_at)
        name = cluster.etcd[i].name
        print(f"\netcd member {name} killed: node {cluster.primary()} leads; writes paused {gap:.1f}s")
        assert cluster.primary() == primary, f"a failover followed the loss of {cluster.etcd[i].name}"
        assert gap <= cluster.retry_timeout, f"no write succeeded for {gap:.1f}s"
        await w.all_present()
        await asyncio.to_thread(cluster.start_etcd)
        assert all(m.healthy() for m in cluster.etcd)


async def test_each_service_gets_a_multi_host_url_of_its_own(cluster: PatroniCluster, tmp_path: Path) -> None:
    """deploy/dbroles.py on a multi-host admin DSN: each login's URL keeps every node and
    target_session_attrs, so that a service, too, follows the leader; the checker's read-only role (to
    which no node is read-write) asks for the primary."""
    urls = await dbroles.provision(cluster.url, tmp_path / "logins")
    hosts = _hosts(cluster)
    for role, url in urls.items():
        attrs = "primary" if role == "check" else "read-write"
        assert f"@{hosts}/{cluster.database}?target_session_attrs={attrs}" in url, (role, url)
        conn = await asyncpg.connect(url)
        try:
            assert not await conn.fetchval("SELECT pg_is_in_recovery()")
            assert await conn.fetchval("SELECT current_user") == dbroles.CHECKER if role == "check" else role
        finally:
            await conn.close()


async def test_the_services_ride_through_a_failover(cluster: PatroniCluster) -> None:
    """The four services on the cluster (each its own role, on the multi-host DSN), the primary's node
    killed while starts are in flight: every start runs, the charges are exact, the checker finds nothing,
    and every service process lived through it."""
    stack = make_stack("patroni")
    urls = await dbroles.provision(cluster.url, dbroles.secrets_dir(stack.dir))
    stack.database_url = urls.pop("check")
    stack.admin_database_url = cluster.url
    stack.service_database_urls = urls
    stack.env["RACKPLANE_SLEDS"] = "3"
    async with AsyncExitStack() as undo:
        undo.callback(shutil.rmtree, stack.dir, True)
        stack.start()
        undo.callback(stack.stop)
        client = await Client.connect(stack.nats_url)
        undo.push_async_callback(client.close)
        check = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=2)
        undo.push_async_callback(check.close)
        await eventually(lambda: sleds_known(client, 3), timeout=20)

        silo, proj = unique("silo"), unique("proj")
        await client.silo_create(silo)
        await client.project_create(silo, proj)
        names = [f"vm-{i}" for i in range(8)]
        for n in names:
            await client.instance_create(silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        for n in names[:4]:
            await client.instance("start", silo, proj, n)
        old = cluster.wait_primary()
        deadline = cluster.ttl + 30
        starts = asyncio.gather(
            *(retrying(lambda n=n: client.instance("start", silo, proj, n), deadline) for n in names[4:])
        )
        await asyncio.sleep(0.05)
        cluster.kill_node(old)
        await asyncio.to_thread(cluster.wait_primary, cluster.ttl + 10, old)
        await starts
        for n in names:
            await wait_state(client, silo, proj, n, "running", timeout=60)
        for n in names[:4]:
            await retrying(lambda n=n: client.instance("stop", silo, proj, n), 30)
        for n in names[:4]:
            await wait_state(client, silo, proj, n, "stopped", timeout=30)
        await usage_is(client, {"vcpus": 4, "ram_bytes": 4 * GiB, "disk_bytes": 8 * GiB}, silo)
        await assert_invariants(check, timeout=30)
        dead = [name for name, svc in stack.services.items() if not svc.alive]
        assert not dead, {name: stack.logs(name) for name in dead}
        cluster.start_node(old)
        await asyncio.to_thread(cluster.wait_standby, old, 90)


async def retrying(call: Callable[[], Awaitable[object]], timeout: float) -> object:
    """An operator retries a command that failed while the database failed over (commands are
    idempotent)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except CommandError as e:
            if e.code not in ("timeout", "unavailable") or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def _hosts(cluster: PatroniCluster) -> str:
    return ",".join(f"127.0.0.1:{n.port}" for n in cluster.members)


def _host(cluster: PatroniCluster, i: int) -> str:
    return f"127.0.0.1:{cluster.members[i].port}"


async def _until(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not after {timeout}s")
        await asyncio.sleep(0.05)


async def _until_async(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not after {timeout}s")
        await asyncio.sleep(0.1)
