"""Fault injection in the bus (shared/faults.py), `rackctl chaos` and `rackctl check`.

Each fault test shows the fault really happened (its `faults.<type>` counter moved, read through
`rp.svc.<service>.faults`) and that the invariants held anyway: `rackctl.invariants.check` clean at rest, the
broker's consumers included, and the totals exact. Faults are only ever set on a private stack (whose
consumers wait 1 s for an ack, so redeliveries come quickly), and every test clears what it set.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.js import api

from deploy.stack import Stack
from rackctl.client import Client
from rackctl.invariants import check, consumers_settled, no_zombie_vmms
from shared import faults, telemetry
from shared.bus import CommandError
from shared.messages import (
    DelayFault,
    DuplicateFault,
    HoldAcksFault,
    InventoryVmm,
    ReorderFault,
    Reply,
    RequestFault,
    ServiceFaults,
    SledInventory,
    VmmState,
    decode,
    encode,
    envelope,
)
from shared.topology import subjects
from tests.conftest import GiB, counter, eventually, make_stack, new_project, usage_is, wait_state
from tests.test_cli import assert_ok, rackctl, rackctl_offline

# --- the fault layer alone, against a fake JetStream -------------------------------------------------------


class FakeJetStream:
    """Records what reaches the broker, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> api.PubAck:
        self.sent.append((subject, payload, headers))
        return api.PubAck(stream="S", seq=len(self.sent))

    async def publish_async(self, subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        future = asyncio.get_running_loop().create_future()
        future.set_result(await self.publish(subject, payload, headers))
        return future


def _msg(n: int, subject: str = "rp.acct.delta.s.p") -> tuple[str, bytes, dict[str, str]]:
    env = envelope(ServiceFaults(seed=n), "test")  # any registered body: only its bytes matter here
    return subject, encode(env), {faults.MSG_ID: str(env.id)}


def _injected(kind: str) -> int:
    return telemetry.COUNTERS.get(f"faults.{kind}", 0)


def test_the_bus_and_the_services_know_nothing_of_faults() -> None:
    """Faults are wrappers put on the bus's contact points with the broker (`faults.install`, when a
    process starts with RACKPLANE_FAULTS): no module of the bus checks for them, and no service code can
    read a fault setting, so none can switch off a fence or a check."""
    root = Path(__file__).resolve().parent.parent
    aware = [
        p.relative_to(root).as_posix()
        for top in ("shared/bus", "services")
        for p in sorted((root / top).rglob("*.py"))
        if re.search(r"\bFAULTS\b|shared\.faults|from shared import .*\bfaults\b", p.read_text())
    ]
    assert aware == []


def test_faults_are_off_by_default() -> None:
    assert not faults.FAULTS.active
    assert not faults.Faults().active
    f = faults.Faults()
    f.configure(ServiceFaults())  # a read changes nothing
    assert not f.active and f.describe()["faults"]["delay"] is None


def test_settings_merge_and_clear() -> None:
    f = faults.Faults()
    f.configure(ServiceFaults(delay=DelayFault(min_seconds=1, max_seconds=2), only=["rp.sled."]))
    f.configure(ServiceFaults(duplicate=DuplicateFault(copies=2)))
    s = f.describe()["faults"]
    assert s["delay"]["max_seconds"] == 2 and s["duplicate"]["copies"] == 2 and s["only"] == ["rp.sled."]
    assert f.active and f.targets("rp.sled.sled-0.report.vmm") and not f.targets("rp.acct.delta.s.p")
    f.configure(ServiceFaults(clear=True, hold_acks=HoldAcksFault(count=1)))
    s = f.describe()["faults"]
    assert s["delay"] is None and s["only"] is None and s["hold_acks"]["count"] == 1
    f.configure(ServiceFaults(hold_acks=HoldAcksFault(count=0)))  # a zero value turns a fault off
    assert not f.active


def test_a_delay_range_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="max_seconds must not be below min_seconds"):
        DelayFault(min_seconds=2, max_seconds=1)


@pytest.mark.parametrize("bypass", [False, True])
async def test_copies_keep_their_id_unless_bypassing_dedupe(bypass: bool) -> None:
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(duplicate=DuplicateFault(copies=3, bypass_dedupe=bypass, copy_delay_seconds=0)))
    before = _injected("duplicate")
    subject, payload, headers = _msg(1)
    await f.publish(js, subject, payload, headers)  # type: ignore[arg-type]
    await eventually(lambda: _async(len(js.sent) == 4))
    ids = {h[faults.MSG_ID] for _, _, h in js.sent}
    assert len(ids) == (4 if bypass else 1)
    assert all(p == payload for _, p, _ in js.sent)
    assert _injected("duplicate") == before + 3


async def test_a_window_is_released_out_of_order() -> None:
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(reorder=ReorderFault(window=4, max_hold_seconds=5), seed=7))
    before = _injected("reorder")
    msgs = [_msg(n) for n in range(4)]
    acks = await asyncio.gather(*(f.publish(js, *m) for m in msgs))  # type: ignore[arg-type]
    assert sorted(a.seq for a in acks) == [1, 2, 3, 4]
    assert [p for _, p, _ in js.sent] != [p for _, p, _ in msgs]
    assert sorted(p for _, p, _ in js.sent) == sorted(p for _, p, _ in msgs)
    assert _injected("reorder") >= before + 2


async def test_a_partial_window_is_released_after_its_hold_time() -> None:
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(reorder=ReorderFault(window=10, max_hold_seconds=0.1)))
    await asyncio.wait_for(f.publish(js, *_msg(1)), 2)  # type: ignore[arg-type]
    assert len(js.sent) == 1


async def test_a_delay_holds_the_message_and_its_ack() -> None:
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(delay=DelayFault(min_seconds=0.2, max_seconds=0.2)))
    before = _injected("delay")
    started = asyncio.get_running_loop().time()
    await f.publish(js, *_msg(1))  # type: ignore[arg-type]
    assert asyncio.get_running_loop().time() - started >= 0.2
    assert _injected("delay") == before + 1


async def test_only_the_first_attempt_is_dropped_whatever_its_id() -> None:
    """The sled reporter gives each retry a new id: a message is known by its subject and content."""
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(drop_first_attempt=True))
    before = _injected("drop_first_attempt")
    subject, payload, _ = _msg(1)
    env, _ = decode(payload)
    retry = encode(envelope(ServiceFaults(seed=1), "test"))  # same content, new id and time
    assert decode(retry)[0].id != env.id
    with pytest.raises(faults.InjectedFault):
        await f.publish(js, subject, payload, {})  # type: ignore[arg-type]
    await f.publish(js, subject, retry, {})  # type: ignore[arg-type]
    assert len(js.sent) == 1 and _injected("drop_first_attempt") == before + 1


async def test_subjects_outside_the_filter_are_untouched() -> None:
    f, js = faults.Faults(), FakeJetStream()
    f.configure(ServiceFaults(drop_first_attempt=True, only=["rp.sled."]))
    await f.publish(js, *_msg(1, "rp.acct.delta.s.p"))  # type: ignore[arg-type]
    assert len(js.sent) == 1


def test_holding_acks_counts_down() -> None:
    f = faults.Faults()
    f.configure(ServiceFaults(hold_acks=HoldAcksFault(count=2)))
    msg: Any = type("M", (), {"subject": "rp.acct.delta.s.p"})()
    assert [f.holds_ack(msg) for _ in range(3)] == [True, True, False]
    assert not f.active


async def _async(value: Any) -> Any:
    return value


# --- a private stack -------------------------------------------------------------------------------------


@dataclass
class Rack:
    stack: Stack
    client: Client
    db: asyncpg.Pool


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    stack = make_stack("faults", RACKPLANE_ACK_WAIT="1")
    try:
        stack.start()
        client = await Client.connect(stack.nats_url)
        db = await asyncpg.create_pool(stack.database_url, min_size=1, max_size=4)
        assert db is not None
        try:
            yield Rack(stack, client, db)
        finally:
            await db.close()
            await client.close()
    finally:
        stack.stop()
        if os.environ.get("RACKPLANE_KEEP_LOGS") is None:
            shutil.rmtree(stack.dir, ignore_errors=True)


@pytest.fixture
async def chaos(rack: Rack) -> AsyncIterator[Rack]:
    """The private stack; every service's faults are cleared when the test ends, whatever happened."""
    try:
        yield rack
    finally:
        await rack.client.clear_faults()


async def injected(client: Client, service: str, kind: str) -> int:
    return (await client.faults(service))["counters"].get(f"faults.{kind}", 0)


async def at_rest_and_clean(rack: Rack, timeout: float = 30) -> None:
    """Every check, the broker's included, finds nothing once in-flight work has settled."""
    js = rack.client.nc.jetstream()

    async def violations() -> list[str]:
        async with rack.db.acquire() as conn:
            return await check(conn, at_rest=True, js=js)

    try:
        await eventually(lambda: _not(violations()), timeout, interval=0.5)
    except AssertionError:
        raise AssertionError("invariants violated:\n" + "\n".join(await violations())) from None


async def _not(found: Any) -> bool:
    return not await found


async def settled_project(client: Client) -> tuple[str, str]:
    """A fresh silo and project, once accounting knows them (before any fault is set)."""
    silo, proj = await new_project(client, "chaos")

    async def known() -> bool:
        try:
            return bool(await client.usage(silo, proj))
        except CommandError:
            return False

    await eventually(known)
    await eventually(lambda: every_sled_answers(client))
    return silo, proj


async def every_sled_answers(client: Client, within: float = 2.0) -> bool:
    """Each sled's latest inventory is younger than `within` seconds, so placement counts it as answering
    (a test before may have held or dropped the sleds' reports for a while)."""
    now = datetime.now(UTC)
    sleds = await client.sled_list()
    return bool(sleds) and all(
        s["state"] != "active"
        or (s["last_seen_at"] and (now - datetime.fromisoformat(s["last_seen_at"])).total_seconds() < within)
        for s in sleds
    )


async def churn(client: Client, silo: str, proj: str, n: int, *, keep: int) -> dict[str, int]:
    """Create n instances, start them all at once, stop all but `keep`; return the usage that must remain."""
    names = [f"vm-{i}" for i in range(n)]
    for name in names:
        await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=2 * GiB)
    await asyncio.gather(*(client.instance("start", silo, proj, name) for name in names))
    await asyncio.gather(*(wait_state(client, silo, proj, name, "running", timeout=40) for name in names))
    await asyncio.gather(*(client.instance("stop", silo, proj, name) for name in names[keep:]))
    await asyncio.gather(
        *(wait_state(client, silo, proj, name, "stopped", timeout=40) for name in names[keep:])
    )
    return {"vcpus": keep, "ram_bytes": keep * GiB, "disk_bytes": n * 2 * GiB}


@pytest.mark.parametrize("bypass", [False, True], ids=["same-id", "own-ids"])
async def test_every_sled_report_three_times(chaos: Rack, bypass: bool) -> None:
    client = chaos.client
    before = await injected(client, "sled-agent", "duplicate")
    stale = await counter(client, "instance-manager", "reports.stale")
    silo, proj = await settled_project(client)
    await client.faults(
        "sled-agent",
        ServiceFaults(duplicate=DuplicateFault(copies=3, bypass_dedupe=bypass), only=["rp.sled."]),
    )
    expected = await churn(client, silo, proj, 3, keep=1)
    assert await injected(client, "sled-agent", "duplicate") >= before + 3 * 3 * 3  # 3 VMMs, 3+ reports
    if bypass:  # the copies reached instance-manager, whose generation fence dropped them
        await eventually(lambda: _more(counter(client, "instance-manager", "reports.stale"), stale))
    await client.clear_faults()
    await usage_is(client, expected, silo, proj)
    await at_rest_and_clean(chaos)


async def test_deltas_delayed_and_reordered(chaos: Rack) -> None:
    client = chaos.client
    delayed = await injected(client, "instance-manager", "delay")
    reordered = await injected(client, "instance-manager", "reorder")
    silo, proj = await settled_project(client)
    await client.faults(
        "instance-manager",
        ServiceFaults(
            delay=DelayFault(min_seconds=0.05, max_seconds=0.3),
            reorder=ReorderFault(window=3, max_hold_seconds=0.5),
            only=["rp.acct.delta."],
        ),
    )
    expected = await churn(client, silo, proj, 6, keep=2)
    assert await injected(client, "instance-manager", "delay") > delayed
    assert await injected(client, "instance-manager", "reorder") > reordered
    await client.clear_faults()
    await usage_is(client, expected, silo, proj)
    await at_rest_and_clean(chaos)


@pytest.mark.parametrize(
    ("service", "only"),
    [("instance-manager", None), ("sled-agent", ["rp.sled."])],
    ids=["outbox-and-sagas", "sled-reports"],
)
async def test_first_attempts_dropped(chaos: Rack, service: str, only: list[str] | None) -> None:
    """instance-manager: its outbox relay, the charge step and the sled command of the start saga retry;
    the sled agent: its reporter retries."""
    client = chaos.client
    before = await injected(client, service, "drop_first_attempt")
    silo, proj = await settled_project(client)
    await client.faults(service, ServiceFaults(drop_first_attempt=True, only=only))
    expected = await churn(client, silo, proj, 2, keep=1)
    assert await injected(client, service, "drop_first_attempt") >= before + 4
    if service == "instance-manager":
        assert await counter(client, service, "outbox.errors") > 0  # the relay sent its rows again
        assert await counter(client, service, "saga.step_retries") > 0  # so did ensure_on_sled
    await client.clear_faults()
    await usage_is(client, expected, silo, proj)
    await at_rest_and_clean(chaos)


async def test_held_acks_make_jetstream_redeliver_deltas(chaos: Rack) -> None:
    client = chaos.client
    held = await injected(client, "accounting", "hold_ack")
    fenced = await _fenced(client)
    duplicates = await counter(client, "accounting", "deltas.duplicate")
    silo, proj = await settled_project(client)
    await client.faults("accounting", ServiceFaults(hold_acks=HoldAcksFault(count=4), only=["rp.acct."]))
    expected = await churn(client, silo, proj, 2, keep=1)
    assert await injected(client, "accounting", "hold_ack") == held + 4
    # Each held delta came again and was fenced: as a duplicate, or as stale once a newer one was applied.
    await eventually(lambda: _more(_fenced(client), fenced, by=4))
    assert await counter(client, "accounting", "deltas.duplicate") > duplicates
    await client.clear_faults()
    await usage_is(client, expected, silo, proj)
    await at_rest_and_clean(chaos)


async def test_a_redelivery_while_the_first_handler_runs(chaos: Rack) -> None:
    """Accounting's handler sleeps 6 s on each first delivery, its ack wait is 1 s: JetStream redelivers
    the delta, which is handled while the first delivery is still in its handler (so a start does not wait
    for it); the first delivery then finds it applied already."""
    client = chaos.client
    slowed = await injected(client, "accounting", "slow_handler")
    fenced = await _fenced(client)
    silo, proj = await settled_project(client)
    await client.faults("accounting", ServiceFaults(slow_handler_seconds=6, only=["rp.acct."]))
    await client.instance_create(silo, proj, "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    started = time.monotonic()
    await client.instance("start", silo, proj, "vm")  # its charge step waits for accounting's outcome
    await wait_state(client, silo, proj, "vm", "running", timeout=20)
    took = time.monotonic() - started
    assert (await client.faults("accounting"))["slow_handlers_running"] > 0, f"running after {took:.1f}s"
    await client.instance("stop", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "stopped", timeout=20)
    # create, start, stop: the stop's delta follows the stopped state through the outbox, so wait for it
    await eventually(lambda: _more(injected(client, "accounting", "slow_handler"), slowed, by=3))
    await eventually(lambda: _more(_fenced(client), fenced, by=3), timeout=20)
    await client.clear_faults()
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo, proj)
    await at_rest_and_clean(chaos)


async def _fenced(client: Client) -> int:
    """Deltas accounting received again and left alone (same generation, or older than the one held)."""
    counters = (await client.stats("accounting"))["counters"]
    return counters.get("deltas.duplicate", 0) + counters.get("deltas.stale", 0)


async def _more(now: Any, than: int, by: int = 1) -> bool:
    return await now >= than + by


# --- control: the request, `rackctl chaos` -----------------------------------------------------------------


async def test_an_invalid_fault_request_gets_a_clear_error(rack: Rack) -> None:
    body = {"hold_acks": {"probability": 2}}
    raw = json.dumps(
        {
            "schema": "rp.svc.faults",
            "version": 1,
            "id": str(uuid.uuid4()),
            "source": "test",
            "time": "2026-01-01T00:00:00Z",
            "data": body,
        }
    ).encode()
    msg = await rack.client.nc.request(subjects.faults("accounting"), raw, timeout=5)
    reply = Reply.model_validate_json(msg.data)
    assert not reply.ok and reply.error is not None
    assert reply.error["code"] == "invalid" and "hold_acks.probability" in reply.error["message"]
    assert not (await rack.client.faults("accounting"))["active"]


async def test_rackctl_chaos_sets_shows_and_clears(chaos: Rack) -> None:
    stack = chaos.stack
    r = await rackctl(
        stack, "chaos", "accounting", "--hold-acks", "0.5", "--delay-range", "0.1", "0.2",
        "--only", "rp.acct.delta.", "--json",
    )  # fmt: skip
    assert_ok(r)
    data = json.loads(r.out)
    assert data["active"] and data["faults"]["hold_acks"]["probability"] == 0.5
    assert data["faults"]["delay"] == {"min_seconds": 0.1, "max_seconds": 0.2}
    assert data["faults"]["only"] == ["rp.acct.delta."]

    r = await rackctl(stack, "chaos", "accounting")  # no option: only shows them
    assert_ok(r)
    assert r.out.splitlines()[0] == (
        "accounting: faults: delay 0.1-0.2s, hold acks (50%), only rp.acct.delta."
    )

    r = await rackctl(stack, "chaos", "status")
    assert_ok(r)
    rows = {line.split()[0]: line for line in r.out.splitlines()[1:]}
    assert set(rows) == set(subjects.SERVICES)
    assert "hold acks (50%)" in rows["accounting"] and rows["recovery"].split()[1] == "none"

    assert_ok(r := await rackctl(stack, "chaos", "accounting", "--clear"))
    assert r.out.startswith("accounting: no faults")
    assert not (await chaos.client.faults("accounting"))["active"]


async def test_chaos_status_shows_a_service_that_does_not_answer(chaos: Rack) -> None:
    stack = chaos.stack
    stack.services["recovery"].stop()
    try:
        r = await rackctl(stack, "chaos", "status", "--json")
        assert_ok(r)
        by_service = {s["service"]: s for s in json.loads(r.out)}
        assert "no service answers" in by_service["recovery"]["error"]
        assert by_service["accounting"]["active"] is False
        human = await rackctl(stack, "chaos", "status")
        assert "no answer" in next(line for line in human.out.splitlines() if line.startswith("recovery"))
    finally:
        stack.start_service("recovery")
        stack.wait_ready(("recovery",))


@pytest.mark.parametrize(
    "args",
    [
        ("chaos", "nobody"),
        ("chaos", "accounting", "--delay-range", "2", "1"),
        ("chaos", "accounting", "--bypass-dedupe"),
        ("chaos", "accounting", "--duplicate", "11"),
        ("chaos", "accounting", "--delay", "6"),
        ("chaos", "accounting", "--hold-acks", "1.5"),
        ("chaos", "accounting", "--delay", "1", "--delay-range", "1", "2"),
        ("chaos", "status", "--delay", "1"),
    ],
)
def test_chaos_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    r = rackctl_offline(*args)
    assert r.code == 2, r
    assert r.out == "" and "Traceback" not in r.err
    assert "error:" in r.err.splitlines()[-1]


# --- `rackctl check` -------------------------------------------------------------------------------------


async def test_rackctl_check_is_clean_on_a_quiet_stack(rack: Rack) -> None:
    stack = rack.stack
    assert stack.database_url is not None
    await at_rest_and_clean(rack)
    r = await rackctl(stack, "check", "--database-url", stack.database_url)
    assert_ok(r)
    assert r.out.startswith("ok: ") and "every invariant holds" in r.out
    r = await rackctl(stack, "check", "--database-url", stack.database_url, "--json")
    assert_ok(r)
    data = json.loads(r.out)
    assert data["ok"] and data["violations"] == []
    assert {"consumers_settled", "no_zombie_vmms", "outboxes_empty", "no_stuck_transitions"} <= set(
        data["checks"]
    )


async def test_rackctl_check_does_not_cry_wolf_while_work_is_in_flight(rack: Rack) -> None:
    """Checked the moment a delete has been accepted (its saga, its events and the sled's report still
    on their way), the rack is found clean: the at-rest checks are looked at again until work settles."""
    stack, client = rack.stack, rack.client
    assert stack.database_url is not None
    silo, proj = await settled_project(client)
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "running")
    await client.instance("stop", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "stopped")
    await client.instance("delete", silo, proj, "vm")
    r = await rackctl(stack, "check", "--database-url", stack.database_url)
    assert_ok(r)
    assert "every invariant holds" in r.out


async def test_rackctl_check_reports_a_corrupted_total(rack: Rack) -> None:
    stack, client = rack.stack, rack.client
    assert stack.database_url is not None
    silo, proj = await settled_project(client)
    await client.instance_create(silo, proj, "vm", vcpus=2, ram_bytes=GiB, disk_bytes=GiB)
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, silo, proj)
    corrupt = "UPDATE accounting.silos SET vcpus = vcpus + $2 WHERE name = $1"
    admin = await asyncpg.connect(stack.admin_database_url)  # the checker's role is read-only
    await admin.execute(corrupt, silo, 1)
    try:
        r = await rackctl(stack, "check", "--database-url", stack.database_url, "--no-at-rest")
        assert r.code == 1, r
        silo_line, fleet_line = r.out.splitlines()  # the fleet's totals are the sum of the silos'
        assert silo_line == (
            f"silo {silo}: totals (vcpus=1 ram=0 B disk=1 GiB) != "
            "sum of its charges (vcpus=0 ram=0 B disk=1 GiB)"
        )
        assert fleet_line.startswith("fleet: sum of silo totals (vcpus=")
        assert r.err.splitlines() == ["rackctl: error: 2 invariant violations"]
    finally:
        await admin.execute(corrupt, silo, -1)
        await admin.close()
    assert_ok(await rackctl(stack, "check", "--database-url", stack.database_url, "--no-at-rest"))


async def test_rackctl_check_reports_an_unreachable_broker(rack: Rack) -> None:
    from deploy.stack import free_port

    stack = rack.stack
    assert stack.database_url is not None
    url = f"nats://127.0.0.1:{free_port()}"
    r = await rackctl(stack, "check", "--database-url", stack.database_url, "--nats", url, "--timeout", "1")
    assert r.code == 1
    assert any(line.startswith("broker checks not run: cannot reach nats") for line in r.out.splitlines())


async def test_check_finds_a_consumer_that_has_not_read_everything(rack: Rack) -> None:
    js = rack.client.nc.jetstream()
    durable = f"test-unread-{uuid.uuid4().hex[:6]}"
    await js.add_consumer(
        subjects.EVENTS_STREAM,
        api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, filter_subject="rp.evt.>"
        ),
    )
    try:
        [line] = [v for v in await consumers_settled(js, grace=0.5) if durable in v]
        assert line.startswith(f"consumer {durable} on EVENTS: ") and "not delivered" in line
    finally:
        await js.delete_consumer(subjects.EVENTS_STREAM, durable)
    assert not [v for v in await consumers_settled(js, grace=0.5) if durable in v]


async def test_check_gives_a_consumer_time_to_settle_what_it_holds(rack: Rack) -> None:
    """Sleds publish inventories on a timer, so a quiet rack has a message in flight now and then: the
    check reports a consumer only if what it held when the check began is still unsettled after a grace."""
    js = rack.client.nc.jetstream()
    durable = f"test-holding-{uuid.uuid4().hex[:6]}"
    await js.add_consumer(
        subjects.EVENTS_STREAM,
        api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, filter_subject="rp.evt.>", ack_wait=60
        ),
    )
    sub = await js.pull_subscribe_bind(durable=durable, stream=subjects.EVENTS_STREAM)
    try:
        held = []
        while pending := (await js.consumer_info(subjects.EVENTS_STREAM, durable)).num_pending:
            held += await sub.fetch(min(pending, 256), timeout=5)
        assert held
        [line] = [v for v in await consumers_settled(js, grace=0) if durable in v]
        assert line.endswith(f"{len(held)} not acknowledged")

        async def ack_later() -> None:
            await asyncio.sleep(1)
            for m in held:
                await m.ack()

        acking = asyncio.create_task(ack_later())
        assert not [v for v in await consumers_settled(js, grace=10) if durable in v]
        await acking
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(subjects.EVENTS_STREAM, durable)


class InventoryStream:
    """What the zombie check reads of SLED_REPORT: one sled's last inventory."""

    def __init__(self, inventory: SledInventory) -> None:
        self.subject = subjects.sled_report(inventory.sled_id, "inventory")
        self.data = encode(envelope(inventory, "test"))

    async def stream_info(self, name: str, subjects_filter: str) -> Any:
        state = type("State", (), {"subjects": {self.subject: 1}})()
        return type("Info", (), {"state": state})()

    async def get_last_msg(self, stream: str, subject: str) -> Any:
        return type("Raw", (), {"data": self.data})()


async def test_check_finds_a_vmm_without_a_record(rack: Rack) -> None:
    client = rack.client
    silo, proj = await settled_project(client)
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "vm")
    v = await wait_state(client, silo, proj, "vm", "running")
    live = InventoryVmm(vmm_id=v["active_vmm_id"], instance_id=v["id"], state=VmmState.running, generation=3)
    zombie = InventoryVmm(vmm_id=uuid.uuid4(), instance_id=uuid.uuid4(), state=VmmState.running, generation=2)
    inventory = SledInventory(
        sled_id=v["sled_id"],
        boot_id=uuid.uuid4(),
        boot_number=1,
        seq=1,
        vcpus=64,
        ram_bytes=256 * GiB,
        vmms=[live, zombie],
    )
    async with rack.db.acquire() as conn:
        found = await no_zombie_vmms(conn, InventoryStream(inventory))  # type: ignore[arg-type]
    assert found == [
        f"sled {v['sled_id']}: VMM {zombie.vmm_id} of instance {zombie.instance_id} is running without a "
        "live record (zombie): no record"
    ]
    made_before_the_stop = InventoryStream(inventory.model_copy(update={"vmms": [live]}))
    await client.instance("stop", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "stopped")
    made_after_the_stop = InventoryStream(inventory.model_copy(update={"vmms": [live]}))
    async with rack.db.acquire() as conn:
        assert await no_zombie_vmms(conn, made_before_the_stop) == []  # type: ignore[arg-type]
        [found] = await no_zombie_vmms(conn, made_after_the_stop)  # type: ignore[arg-type]
    assert f"VMM {live.vmm_id} " in found and "its record ended at" in found


async def test_requests_handled_twice_late_or_unanswered(chaos: Rack) -> None:
    """instance-manager handles each command twice (as a sender's retry would make it), answers late, or
    not at all (the requester times out and asks again): every command is idempotent or fenced, so the
    instances end as asked, charged once."""
    client = chaos.client
    silo, proj = await settled_project(client)
    before = {k: await injected(client, "instance-manager", k) for k in ("duplicate_request", "delay_reply")}
    await client.faults(
        "instance-manager",
        ServiceFaults(
            requests=RequestFault(duplicate_probability=1, delay_reply_seconds=0.3),
            only=[subjects.command(silo, "instance", "")],
        ),
    )
    expected = await churn(client, silo, proj, 3, keep=2)
    for kind, n in before.items():
        assert await injected(client, "instance-manager", kind) > n, kind
    await client.faults("instance-manager", ServiceFaults(requests=RequestFault(drop_reply_probability=1)))
    client.timeout = 2
    try:
        with pytest.raises(CommandError) as e:
            await client.instance("show", silo, proj, "vm-0")
    finally:
        client.timeout = 15
    assert e.value.code == "timeout"
    assert await injected(client, "instance-manager", "drop_reply") >= 1
    await client.clear_faults()
    assert (await client.instance("show", silo, proj, "vm-0"))["state"] == "running"
    await usage_is(client, expected, silo, proj)
    await at_rest_and_clean(chaos)
