"""Fixtures: one real stack (nats-server, PostgreSQL, the four services as processes) for the session.

Tests that kill or restart the broker or the database build their own `Stack` on free ports instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest

from deploy.stack import Nats, Stack, free_port
from deploy.streams import ensure_streams
from rackctl.client import Client

GiB = 2**30

FAST = {
    "RACKPLANE_VMM_START_DELAY": "0.05",
    "RACKPLANE_VMM_STOP_DELAY": "0.05",
    "RACKPLANE_REPORT_RETRY": "0.5",
    "RACKPLANE_INVENTORY_INTERVAL": "1",
    "RACKPLANE_RECONCILE_INTERVAL": "1",
    "RACKPLANE_RESTART_COOLDOWN": "1",
    "RACKPLANE_SLED_UNKNOWN_AFTER": "3",
    "RACKPLANE_TRANSITION_TIMEOUT": "6",
    "RACKPLANE_ZOMBIE_GRACE": "2",
    "RACKPLANE_ACK_WAIT": "5",  # what a killed consumer held comes back in seconds, not half a minute
    "RACKPLANE_LOG": "INFO",
    "RACKPLANE_FAULTS": "1",  # the services answer fault injection (from the test identity only)
}


Rack = tuple[Stack, Client, asyncpg.Pool]
JetStreamAs = Callable[[str], Awaitable[Any]]
"""`jetstream_as(identity)`: a JetStream context with that identity's credential."""


def make_stack(name: str, **env: str) -> Stack:
    base = Path(tempfile.mkdtemp(prefix=f"rackplane-{name}-"))
    os.chmod(base, 0o755)
    return Stack(base, env={**FAST, **env})


@asynccontextmanager
async def bare_jetstream(prefix: str) -> AsyncIterator[Any]:
    """A nats-server of its own with rackplane's streams and no identities, and a JetStream context on
    it: for tests of the consumer machinery alone."""
    folder = Path(tempfile.mkdtemp(prefix=f"rackplane-{prefix}-"))
    server = Nats(folder / "nats", port=free_port()).start()
    nc = await nats.connect(server.url)
    try:
        await ensure_streams(nc.jetstream())
        yield nc.jetstream()
    finally:
        await nc.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@asynccontextmanager
async def private_rack(name: str, *, timeout: float = 15.0, **env: str) -> AsyncIterator[Rack]:
    """A stack of its own (and a client and a database pool on it), for tests that reboot, kill, inject
    faults or restart the broker or the database; it waits until every simulated sled has registered."""
    stack = make_stack(name, **env)
    async with AsyncExitStack() as undo:  # whatever came up goes, however the test ends
        undo.callback(_remove, stack)
        stack.start()
        undo.callback(stack.stop)
        client = await Client.connect(stack.nats_url, timeout=timeout)
        undo.push_async_callback(client.close)
        db = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=4)
        undo.push_async_callback(db.close)
        sleds = int(env.get("RACKPLANE_SLEDS", "8"))
        await eventually(lambda: sleds_known(client, sleds), timeout=20 + sleds / 50)  # each connects
        yield stack, client, db


def _remove(stack: Stack) -> None:
    if os.environ.get("RACKPLANE_KEEP_LOGS") is None:
        shutil.rmtree(stack.dir, ignore_errors=True)


def restart_service(stack: Stack, service: str, crash_at: str | None = None) -> None:
    """Restart a service (or start it, if it is down), armed to die at a crash point (or not)."""
    if stack.services[service].alive:
        stack.services[service].stop()
    if crash_at:
        stack.env["RACKPLANE_CRASH_AT"] = crash_at
    else:
        stack.env.pop("RACKPLANE_CRASH_AT", None)
    stack.start_service(service)
    stack.wait_ready((service,))


async def sleds_known(client: Client, n: int) -> bool:
    return len(await client.sled_list()) >= n


@pytest.fixture(scope="session", autouse=True)
def pg_template() -> Iterator[None]:
    """One initdb for the whole run: each stack's cluster starts as a copy of it (see deploy/stack.py)."""
    if os.environ.get("RACKPLANE_PG_TEMPLATE"):
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="rackplane-pg-template-"))
    os.environ["RACKPLANE_PG_TEMPLATE"] = str(folder / "data")
    try:
        yield
    finally:
        del os.environ["RACKPLANE_PG_TEMPLATE"]
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def identities(pytestconfig: pytest.Config) -> Iterator[Path]:
    """One set of NATS identities for the whole run (every stack's server trusts them), and a rackctl
    context with the test identity, so that every client and `rackctl` the tests start uses it. A sled
    identity for each of the scale benchmark's sleds when benchmarks run."""
    if os.environ.get("RACKPLANE_IDENTITIES"):
        yield Path(os.environ["RACKPLANE_IDENTITIES"])
        return
    from deploy.identities import Store, standard
    from rackctl.context import ConnectionContext, write

    folder = Path(tempfile.mkdtemp(prefix="rackplane-identities-"))
    sleds = 64
    marks = pytestconfig.getoption("markexpr") or ""
    if "bench" in marks and "not bench" not in marks:
        from tests.bench.test_scale_bench import SLEDS

        sleds = max(sleds, SLEDS)
    store = Store.init(folder / "identities", standard(sleds=sleds, test=True))
    test = ConnectionContext(url="nats://127.0.0.1:4222", nkey=str(store.seed_file("test")), identity="test")
    saved = {k: os.environ.get(k) for k in ("RACKPLANE_IDENTITIES", "RACKCTL_CONTEXT")}
    os.environ["RACKPLANE_IDENTITIES"] = str(store.dir)
    os.environ["RACKCTL_CONTEXT"] = str(write("test", test, folder / "contexts"))
    try:
        yield store.dir
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


async def connect_as(stack: Stack, identity: str) -> Any:
    """A NATS connection with one identity's credential (and its private inbox), on `stack`'s broker."""
    from shared import bus
    from shared.topology import subjects

    assert stack.security is not None and stack.nats_url
    ctx = stack.security.context(identity, stack.nats_url)
    return await bus.connect(
        stack.nats_url,
        f"test-as-{identity}",
        retry_for=5,
        seed_file=ctx.nkey,
        inbox_prefix=subjects.inbox_prefix(identity),
        ca_file=ctx.ca,
    )


@pytest.fixture
async def jetstream_as(stack: Stack) -> AsyncIterator[JetStreamAs]:
    """JetStream with one identity's credential, on the session stack: for tests that send, forged or
    malformed, what only that identity may send (a sled's reports, instance-manager's deltas)."""
    opened: list[Any] = []

    async def open_as(identity: str) -> Any:
        nc = await connect_as(stack, identity)
        opened.append(nc)
        return nc.jetstream()

    yield open_as
    for nc in opened:
        await nc.close()


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    traces = Path(tempfile.gettempdir()) / f"rackplane-traces-{os.getpid()}.jsonl"
    s = make_stack("session", RACKPLANE_TRACES=f"file:{traces}")
    try:
        s.start()
        yield s
    finally:
        s.stop()
        if os.environ.get("RACKPLANE_KEEP_LOGS") is None:
            shutil.rmtree(s.dir, ignore_errors=True)
            traces.unlink(missing_ok=True)


@pytest.fixture(scope="session")
async def client(stack: Stack) -> AsyncIterator[Client]:
    c = await Client.connect(stack.nats_url)
    yield c
    await c.close()


@pytest.fixture(scope="session")
async def db(stack: Stack) -> AsyncIterator[asyncpg.Pool]:
    """Direct database access, for tests that check invariants across services' tables: as `rackctl
    check`'s read-only role (a test that writes on purpose connects with `stack.admin_database_url`)."""
    pool = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=4)
    assert pool is not None
    yield pool
    await pool.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def new_project(client: Client, prefix: str = "silo") -> tuple[str, str]:
    """A fresh silo (no quota) and project in it: (silo, project)."""
    silo, proj = unique(prefix), unique("proj")
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    return silo, proj


@pytest.fixture
async def project(client: Client) -> tuple[str, str]:
    """A fresh silo (no quota) and project, on the suite's shared stack."""
    return await new_project(client)


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 15.0, interval: float = 0.1
) -> Any:
    """Poll `check` until it returns something truthy; fail with its last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met after {timeout}s (last: {last!r})")


async def wait_state(
    client: Client, silo: str, project: str, name: str, state: str, timeout: float = 15.0
) -> Any:
    from shared.bus import CommandError

    async def check() -> Any:
        try:
            v = await client.instance("show", silo, project, name)
        except CommandError as e:
            if e.code not in ("unavailable", "timeout"):  # a service reconnecting to a restarted broker
                raise
            return None
        return v if v["state"] == state else None

    return await eventually(check, timeout)


async def assert_invariants(db: asyncpg.Pool, *, at_rest: bool = True, timeout: float = 10.0) -> None:
    """The checker finds nothing (waiting, for at-rest checks, until in-flight work has settled)."""
    from rackctl.invariants import check

    async def clean() -> Any:
        async with db.acquire() as conn:
            return not await check(conn, at_rest=at_rest)

    try:
        await eventually(clean, timeout)
    except AssertionError:
        async with db.acquire() as conn:
            raise AssertionError(
                "invariants violated:\n" + "\n".join(await check(conn, at_rest=at_rest))
            ) from None


async def counter(client: Client, service: str, name: str) -> int:
    return (await client.stats(service))["counters"].get(name, 0)


async def usage_is(
    client: Client, expected: dict[str, int], silo: str | None = None, project: str | None = None
) -> None:
    """Charges follow state through the outbox and accounting's stream: wait for them to land (and, for
    a project just created, for accounting to learn its name from the project's event)."""
    from shared.bus import CommandError

    async def check() -> bool:
        try:
            return (await client.usage(silo, project))["usage"] == expected
        except CommandError as e:
            if e.code != "not_found":
                raise
            return False

    await eventually(check, timeout=10)


async def instance_changes(client: Client, subject: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every instance change the EVENTS stream holds on `subject` (`rp.evt.<silo|*>.instance.changed`,
    or its `.v2`): (instance id, generation) -> the instance view."""
    import nats.errors

    from shared.messages import InstanceChanged, InstanceChangedV2, decode

    expect = InstanceChangedV2 if subject.endswith(".v2") else InstanceChanged
    sub = await client.nc.jetstream().subscribe(subject, ordered_consumer=True)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return out
            _, event = decode(msg.data, expect)
            assert isinstance(event, expect)
            out[str(event.instance.id), event.instance.generation] = event.instance.model_dump(mode="json")
    finally:
        await sub.unsubscribe()
