"""The broker enforces who may do what (issue 11): every identity of deploy/identities.py, against a real
nats-server with the generated config.

- the permission matrix: every identity tries to publish to and subscribe on every subject family and
  every JetStream API verb, on a bare server of its own (so that a wrong grant harms nothing else);
  exactly what its grants allow succeeds, and the claims that matter are spelled out besides;
- a sled cannot speak for another, command a service, or read another's commands; nothing changes;
- no credential, no connection; a silo's operator cannot reach another silo's instances;
- fault injection answers the test identity only, and only when enabled; simulator control only the
  simulator operator (and the console and test identities, which include it);
- TLS: a stack behind TLS works with its CA, and refuses a plain connection;
- docs/security.md's matrix is the one the code makes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from deploy import identities
from deploy.identities import Grants, Identity
from deploy.security import BrokerSecurity
from deploy.stack import Nats, Stack, free_port
from rackctl.client import Client
from shared import bus
from shared.messages import InstanceList, ServiceFaults, SimSledFreeze, SimSledList, SledList
from shared.topology import subjects
from tests.conftest import GiB, connect_as, eventually, make_stack, sleds_known, unique, wait_state

ROOT = Path(__file__).resolve().parent.parent

# --- the matrix -------------------------------------------------------------------------------------------

SUBJECTS = [
    # operator commands
    "rp.cmd._fleet.silo.create", "rp.cmd._fleet.sled.expunge", "rp.cmd._fleet.instance.list",
    "rp.cmd._fleet.vmm.lost", "rp.cmd._fleet.vmm.zombie", "rp.cmd._fleet.instance.restart",
    "rp.cmd._fleet.instance.settle", "rp.cmd.acme.instance.start", "rp.cmd.acme.instance.list",
    "rp.cmd.acme.instance.restart", "rp.cmd.other.instance.delete", "rp.cmd.acme.usage.get",
    "rp.cmd.acme.usage.history", "rp.cmd.other.usage.history", "rp.cmd._fleet.usage.history",
    # sleds
    "rp.sled.sled-3.cmd.vmm.ensure", "rp.sled.sled-4.cmd.vmm.destroy", "rp.sled.sled-3.report.vmm",
    "rp.sled.sled-3.report.inventory", "rp.sled.sled-4.report.vmm",
    # accounting, events, dead letters
    "rp.acct.delta.acme.web.i-1", "rp.acct.part.0.acme.web.i-1", "rp.evt.acme.instance.changed",
    "rp.evt.acme.instance.changed.v2", "rp.evt.other.instance.changed", "rp.evt.acme.provision.outcome",
    "rp.evt.acme.usage.changed",
    "rp.evt._fleet.sled.changed", "rp.evt.acme.silo.created", "rp.dlq.accounting.accounting-deltas",
    "rp.dlq.sled-agent.sled-agent-sled-3",
    "rp.dlq.sled-agent.sled-agent-sled-4",
    # services, simulator
    "rp.svc.accounting.stats", "rp.svc.accounting.faults", "rp.svc.sled-agent.faults", "rp.sim.sled.add",
    "rp.sim.sled.list",
    # JetStream API
    "$JS.API.INFO", "$JS.API.STREAM.CREATE.PROBE", "$JS.API.STREAM.UPDATE.PROBE",
    "$JS.API.STREAM.INFO.PROBE", "$JS.API.DIRECT.GET.SLED_CMD", "$JS.API.STREAM.MSG.GET.SLED_CMD",
    "$JS.API.STREAM.DELETE.EVENTS", "$JS.API.STREAM.PURGE.PROVISION", "$JS.API.STREAM.INFO.EVENTS",
    "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.STREAM.MSG.GET.EVENTS",
    "$JS.API.STREAM.MSG.DELETE.EVENTS", "$JS.API.STREAM.SNAPSHOT.EVENTS", "$JS.API.STREAM.RESTORE.PROBE",
    "$JS.API.DIRECT.GET.EVENTS", "$JS.API.CONSUMER.CREATE.EVENTS", "$JS.API.CONSUMER.CREATE.SLED_CMD",
    "$JS.API.CONSUMER.CREATE.SLED_CMD.sled-agent-sled-3.rp.sled.sled-3.cmd.>",
    "$JS.API.CONSUMER.CREATE.SLED_CMD.sled-agent-sled-3.rp.sled.sled-4.cmd.>",
    "$JS.API.CONSUMER.CREATE.SLED_CMD.sled-agent-sled-4.rp.sled.sled-4.cmd.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.SLED_CMD.sled-agent-sled-3",
    "$JS.API.CONSUMER.INFO.SLED_CMD.sled-agent-sled-3",
    "$JS.API.CONSUMER.MSG.NEXT.SLED_CMD.sled-agent-sled-3",
    "$JS.API.CONSUMER.MSG.NEXT.SLED_CMD.sled-agent-sled-4",
    "$JS.API.CONSUMER.DELETE.SLED_CMD.sled-agent-sled-3",
    "$JS.API.CONSUMER.CREATE.PROVISION.accounting-deltas-0.rp.acct.part.0.>",
    "$JS.API.CONSUMER.MSG.NEXT.PROVISION.accounting-deltas-0",
    "$JS.API.CONSUMER.DELETE.PROVISION.accounting-deltas-0",
    "$JS.API.CONSUMER.LIST.EVENTS", "$JS.API.CONSUMER.NAMES.EVENTS", "$JS.API.CONSUMER.PAUSE.EVENTS.x",
    "$JS.ACK.PROVISION.accounting-deltas-0.1.1.1.1.0", "$JS.ACK.SLED_CMD.sled-agent-sled-3.1.1.1.1.0",
    "$JS.ACK.SLED_CMD.sled-agent-sled-4.1.1.1.1.0", "$JS.FC.EVENTS.x",
    "$JS.API.CONSUMER.CREATE.EVENTS.x.rp.evt.acme.>", "$JS.API.CONSUMER.CREATE.EVENTS.x.rp.evt.other.>",
    "$JS.API.CONSUMER.CREATE.EVENTS.accounting-silos.rp.evt.acme.>", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.x",
    "$JS.API.CONSUMER.MSG.NEXT.EVENTS.accounting-silos", "$JS.API.STREAM.MSG.GET.DLQ",
    "$JS.API.STREAM.MSG.DELETE.DLQ",
    # inboxes
    "_INBOX_test.x", "_INBOX_sled-3.x", "_INBOX_accounting.x",
]  # fmt: skip


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching for a literal subject: `*` is one token, `>` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def granted(allow: tuple[str, ...], deny: tuple[str, ...], subject: str) -> bool:
    return any(matches(a, subject) for a in allow) and not any(matches(d, subject) for d in deny)


def may_publish(g: Grants, subject: str) -> bool:
    return granted(g.publish, g.publish_deny, subject)


def may_subscribe(g: Grants, subject: str) -> bool:
    return granted(g.subscribe, g.subscribe_deny, subject)


PROBED = [
    *identities.standard(sleds=8, silos=["acme"], test=True),
]
PROBED = [i for i in PROBED if i.kind != "sled" or i.name == "sled-3"]


@pytest.fixture(scope="module")
async def bare(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Nats, BrokerSecurity]]:
    """A nats-server with the generated config and the streams, and nothing else on it."""
    folder = tmp_path_factory.mktemp("bare-nats")
    shared = os.environ.pop("RACKPLANE_IDENTITIES", None)  # identities of its own, apart from the tests'
    try:
        security = BrokerSecurity(folder, test_identity=True)
    finally:
        if shared is not None:
            os.environ["RACKPLANE_IDENTITIES"] = shared
    security.store.add(identities.silo_operator("acme"))
    server = Nats(folder / "nats", port=free_port(), conf=security.server_conf()).start()
    await security.ensure_streams(server.url)
    yield server, security
    server.stop()


async def probe(server: Nats, security: BrokerSecurity, name: str) -> tuple[set[str], set[str]]:
    """What the broker refused this identity: (subjects it may not publish to, nor subscribe on), in
    lower case, as the server's error messages give them."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(
        server.url,
        nkeys_seed=security.seed(name),
        inbox_prefix=subjects.inbox_prefix(name),
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    try:
        for s in SUBJECTS:
            await nc.subscribe(s)
            await nc.publish(s, b"")
        await nc.flush(5)
        await asyncio.sleep(0.2)
        await nc.flush(5)
    finally:
        await nc.close()
    pub = {e.split('"')[1] for e in errors if "for publish to" in e.lower()}
    sub = {e.split('"')[1] for e in errors if "for subscription to" in e.lower()}
    return pub, sub


@pytest.mark.parametrize("identity", PROBED, ids=lambda i: i.name)
async def test_exactly_the_granted_subjects_succeed(
    bare: tuple[Nats, BrokerSecurity], identity: Identity
) -> None:
    server, security = bare
    denied_pub, denied_sub = await probe(server, security, identity.name)
    g = identity.grants
    assert {s.lower() for s in SUBJECTS if not may_publish(g, s)} == denied_pub
    assert {s.lower() for s in SUBJECTS if not may_subscribe(g, s)} == denied_sub


def publishers(subject: str) -> set[str]:
    return {i.name for i in PROBED if may_publish(i.grants, subject)}


def test_the_grants_that_matter() -> None:
    """What the matrix must say, written out: who alone may do the dangerous things."""
    nobody: set[str] = set()
    for verb in (
        "$JS.API.STREAM.DELETE.EVENTS",
        "$JS.API.STREAM.PURGE.PROVISION",
        "$JS.API.STREAM.MSG.DELETE.EVENTS",
    ):
        assert publishers(verb) == nobody
    # streams: deploy's own, by name, and no other; and the stream administrator touches no consumer
    assert publishers("$JS.API.STREAM.CREATE.EVENTS") == {"stream-admin"}
    assert publishers("$JS.API.STREAM.UPDATE.EVENTS") == {"stream-admin"}
    assert publishers("$JS.API.STREAM.CREATE.PROBE") == nobody
    assert publishers("$JS.API.STREAM.UPDATE.PROBE") == nobody
    assert not [s for s in SUBJECTS if "CONSUMER" in s and may_publish(identities.STREAM_ADMIN, s)]
    assert not may_publish(identities.STREAM_ADMIN, "$JS.API.DIRECT.GET.SLED_CMD")
    # what a stream carries: its one sender, and the dead-letter administrator, who replays dead letters
    replay = "dlq-admin"
    assert publishers("rp.acct.delta.acme.web.i-1") == {"instance-manager", replay}
    assert publishers("rp.acct.part.0.acme.web.i-1") == nobody  # what the stream stores: no one sends it
    assert publishers("rp.sled.sled-4.cmd.vmm.destroy") == {"instance-manager", replay}
    assert publishers("rp.evt.acme.provision.outcome") == {"accounting", replay}
    assert publishers("rp.evt.acme.instance.changed") == {"instance-manager", replay}
    assert publishers("rp.evt.acme.instance.changed.v2") == {"instance-manager", replay}
    assert publishers("rp.sled.sled-3.report.vmm") == {"sled-3", replay}
    assert publishers("rp.sled.sled-4.report.vmm") == {replay}
    assert publishers("$JS.API.STREAM.MSG.DELETE.DLQ") == {replay}
    # following events: through consumers of one's own, held to one's filter, never a service's durable
    followers = {"fleet-operator", "console", "test"}
    assert publishers("$JS.API.CONSUMER.CREATE.EVENTS.x.rp.evt.acme.>") == followers | {"silo-operator-acme"}
    assert publishers("$JS.API.CONSUMER.CREATE.EVENTS.x.rp.evt.other.>") == followers
    assert publishers("$JS.API.CONSUMER.CREATE.EVENTS.accounting-silos.rp.evt.acme.>") == nobody
    assert publishers("$JS.API.CONSUMER.MSG.NEXT.EVENTS.accounting-silos") == {"accounting"}
    # a subscriber: any consumer on its own stream (in the subscribers' account), held to its scope
    assert publishers("$JS.API.CONSUMER.MSG.NEXT.EVENTS-events-reader.x") == {"events-reader"}
    assert publishers("$JS.API.CONSUMER.CREATE.EVENTS-events-reader.x.rp.evt.>") == {"events-reader"}
    assert publishers("$JS.API.CONSUMER.CREATE.EVENTS.x.rp.evt.>") == followers
    for order in (
        "rp.cmd._fleet.vmm.lost",
        "rp.cmd._fleet.vmm.stuck",
        "rp.cmd._fleet.vmm.zombie",
        "rp.cmd._fleet.instance.restart",
        "rp.cmd._fleet.instance.settle",
    ):
        assert publishers(order) == {"recovery"}
    assert publishers("rp.cmd._fleet.silo.create") == {"fleet-operator", "console", "test"}
    assert publishers("rp.cmd.acme.instance.start") == {
        "fleet-operator",
        "console",
        "test",
        "silo-operator-acme",
    }
    assert publishers("rp.cmd.other.instance.delete") == {"fleet-operator", "console", "test"}
    # usage and its history: as for usage.get, a silo's operator for its own silo only
    for verb in ("get", "history"):
        assert publishers(f"rp.cmd.acme.usage.{verb}") == {
            "fleet-operator",
            "console",
            "test",
            "silo-operator-acme",
        }
        assert publishers(f"rp.cmd.other.usage.{verb}") == {"fleet-operator", "console", "test"}
        assert publishers(f"rp.cmd._fleet.usage.{verb}") == {"fleet-operator", "console", "test"}
    servers = {
        i.name for i in PROBED if may_subscribe(i.grants, "rp.cmd.acme.usage.history") and i.grants.responses
    }
    assert servers == {"accounting"}
    assert publishers("rp.svc.accounting.faults") == {"test"}
    assert publishers("rp.sim.sled.add") == {"simulator-operator", "console", "test"}
    assert publishers("$JS.API.CONSUMER.MSG.NEXT.SLED_CMD.sled-agent-sled-3") == {"sled-3"}
    assert publishers("$JS.API.CONSUMER.CREATE.SLED_CMD.sled-agent-sled-3.rp.sled.sled-4.cmd.>") == nobody
    assert publishers("$JS.API.CONSUMER.DELETE.SLED_CMD.sled-agent-sled-3") == nobody
    assert publishers("$JS.API.CONSUMER.DURABLE.CREATE.SLED_CMD.sled-agent-sled-3") == nobody
    assert publishers("$JS.API.CONSUMER.MSG.NEXT.PROVISION.accounting-deltas-0") == {"accounting", "test"}
    subscribers = {i.name for i in PROBED if may_subscribe(i.grants, "rp.evt.other.instance.changed")}
    assert subscribers == {"fleet-operator", "console", "test"}
    assert {i.name for i in PROBED if may_subscribe(i.grants, "_INBOX_sled-3.x")} == {"sled-3"}


async def test_a_consumer_cannot_be_pointed_at_another_filter(bare: tuple[Nats, BrokerSecurity]) -> None:
    """The create subject carries the filter, and the server holds the config to it: sled-3's durable
    cannot be made to read sled-4's commands (the only create subject it may use names its own filter)."""
    server, security = bare
    nc = await nats.connect(server.url, nkeys_seed=security.seed("sled-3"), inbox_prefix="_INBOX_sled-3")
    try:
        config = {"name": "sled-agent-sled-3", "durable_name": "sled-agent-sled-3", "ack_policy": "explicit"}

        async def create(filter_subject: str) -> dict[str, Any]:
            body = {"stream_name": "SLED_CMD", "config": {**config, "filter_subject": filter_subject}}
            subject = "$JS.API.CONSUMER.CREATE.SLED_CMD.sled-agent-sled-3.rp.sled.sled-3.cmd.>"
            return json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=2)).data)

        assert "error" in await create("rp.sled.sled-4.cmd.>")
        assert (await create("rp.sled.sled-3.cmd.>"))["config"]["filter_subject"] == "rp.sled.sled-3.cmd.>"
    finally:
        await nc.close()


# --- each admin identity only for its job (issue 29) -----------------------------------------------------


async def _as(server: Nats, security: BrokerSecurity, name: str) -> Any:
    """A connection with `name`'s own credential and inbox (bus.connect: a denial is seen at once)."""
    return await bus.connect(
        server.url, f"attacker-{name}", retry_for=3, seed_file=security.seed(name),
        inbox_prefix=subjects.inbox_prefix(name),
    )  # fmt: skip


async def _api(nc: Any, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any] | str:
    """A JetStream API request: the server's JSON reply, or "forbidden" when the broker refuses the send."""
    call = nc.request(subject, json.dumps(body or {}).encode(), timeout=3)
    try:
        return dict(json.loads((await bus.unless_denied(nc, subject, call)).data))
    except bus.CommandError as e:
        assert e.code == "forbidden", e
        return "forbidden"


def _push(stream: str, name: str, filter_subject: str, deliver: str) -> dict[str, Any]:
    config = {"name": name, "durable_name": name, "filter_subject": filter_subject, "ack_policy": "explicit"}
    return {"stream_name": stream, "config": {**config, "deliver_subject": deliver}}


async def test_stream_admin_cannot_delete_a_consumer_or_read_orders(
    bare: tuple[Nats, BrokerSecurity],
) -> None:
    """Attack 4: with its own credential, the stream administrator deletes no consumer, reads no sled order
    (no push consumer to its own inbox, no direct or by-sequence get) and touches no stream but deploy's;
    deploy's own work (create or update each stream) still succeeds."""
    server, security = bare
    im = await _as(server, security, "instance-manager")
    sled = await _as(server, security, "sled-3")
    admin = await _as(server, security, "stream-admin")
    try:
        order = subjects.sled_command("sled-3", "vmm.ensure")
        await im.jetstream(timeout=3).publish(order, b'{"secret": "order"}')
        sled_js = sled.jetstream(timeout=3)
        await sled_js.pull_subscribe(subjects.sled_command("sled-3", ">"), durable="sled-agent-sled-3",
                                     stream=subjects.SLED_CMD_STREAM)  # fmt: skip
        got: list[Any] = []

        async def on_msg(msg: Any) -> None:
            got.append(msg)

        inbox = f"{subjects.inbox_prefix('stream-admin')}.orders"
        await admin.subscribe(inbox, cb=on_msg)
        cmd = subjects.SLED_CMD_STREAM
        attempts = {
            f"$JS.API.CONSUMER.DELETE.{cmd}.sled-agent-sled-3": None,
            f"$JS.API.CONSUMER.CREATE.{cmd}": {"stream_name": cmd, "config": {"deliver_subject": inbox}},
            f"$JS.API.CONSUMER.CREATE.{cmd}.peek.rp.sled.>": _push(cmd, "peek", "rp.sled.>", inbox),
            f"$JS.API.CONSUMER.DURABLE.CREATE.{cmd}.peek": _push(cmd, "peek", "rp.sled.>", inbox),
            f"$JS.API.DIRECT.GET.{cmd}": {"seq": 1},
            f"$JS.API.STREAM.MSG.GET.{cmd}": {"seq": 1},
            "$JS.API.STREAM.CREATE.PROBE": {"name": "PROBE", "subjects": ["probe.>"]},
            "$JS.API.STREAM.UPDATE.PROBE": {"name": "PROBE", "subjects": ["probe.>"]},
        }
        for subject, body in attempts.items():
            assert await _api(admin, subject, body) == "forbidden", subject
        await asyncio.sleep(0.5)
        assert got == []
        info = await sled_js.consumer_info(cmd, "sled-agent-sled-3")  # still there, still its own
        assert info.config.filter_subject == subjects.sled_command("sled-3", ">")
        await security.ensure_streams(server.url)  # deploy's job: create, or else update, each stream
    finally:
        for nc in (im, sled, admin):
            await nc.close()


async def test_a_subscribers_stream_keeps_up_past_the_first_megabytes(
    bare: tuple[Nats, BrokerSecurity],
) -> None:
    """Sourcing across the accounts is flow-controlled: the copies stop after a few megabytes unless the
    flow-control replies reach rackplane's account. 6 MB of events all reach the events reader's stream."""
    server, security = bare
    im = await _as(server, security, "instance-manager")
    reader = await _as(server, security, identities.EVENTS_READER)
    try:
        own = subjects.subscriber_stream(identities.EVENTS_READER)
        rjs = reader.jetstream(timeout=5)
        before = (await rjs.stream_info(own)).state.messages
        js, body, n = im.jetstream(), b"x" * 2048, 3000
        for _batch in range(n // 100):
            await asyncio.gather(
                *(js.publish(subjects.event("acme", "instance", "changed"), body) for _ in range(100))
            )

        async def caught_up() -> bool:
            return (await rjs.stream_info(own)).state.messages >= before + n

        await eventually(caught_up, timeout=30)
    finally:
        for nc in (im, reader):
            await nc.close()


async def test_a_subscribers_push_consumer_delivers_nowhere_in_rackplane(
    bare: tuple[Nats, BrokerSecurity],
) -> None:
    """Attack 4's last part, with a subscriber's own credential: on its own stream it may make a push
    consumer that delivers anywhere, but only within the subscribers' account, so a command subject of
    rackplane's hears nothing; and it may not touch EVENTS itself, nor the API the account sources through."""
    server, security = bare
    im = await _as(server, security, "instance-manager")
    reader = await _as(server, security, identities.EVENTS_READER)
    heard: list[str] = []

    async def on_command(msg: Any) -> None:
        heard.append(msg.subject)

    try:
        await im.subscribe(subjects.command_pattern("instance"), cb=on_command)
        await im.flush()
        await im.jetstream().publish(subjects.event("acme", "silo", "created"), b"{}")
        own = subjects.subscriber_stream(identities.EVENTS_READER)
        js = reader.jetstream(timeout=3)

        async def sourced() -> bool:
            return (await js.stream_info(own)).state.messages > 0

        await eventually(sourced, timeout=10)
        elsewhere = subjects.command("acme", "instance", "delete")
        made = await _api(
            reader, f"$JS.API.CONSUMER.CREATE.{own}.p.rp.evt.>", _push(own, "p", "rp.evt.>", elsewhere)
        )
        assert isinstance(made, dict) and "error" not in made, made
        await asyncio.sleep(1.0)
        assert heard == []  # delivered, if at all, in the subscribers' account: no service heard it
        ev = subjects.EVENTS_STREAM
        for subject in (
            f"$JS.API.CONSUMER.CREATE.{ev}.mine.rp.evt.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{ev}.accounting-silos",
            f"{subjects.SUBSCRIBERS_API}.CONSUMER.CREATE.{ev}.mine.rp.evt.>",
            f"$JS.API.STREAM.UPDATE.{own}",
            f"$JS.API.STREAM.DELETE.{own}",
        ):
            assert await _api(reader, subject, _push(ev, "mine", "rp.evt.>", elsewhere)) == "forbidden", (
                subject
            )
    finally:
        for nc in (im, reader):
            await nc.close()


async def test_the_test_identity_is_refused_by_a_stack_without_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack 3: a stack started as `make run` starts it (identities of its own) makes the test identity
    only with FAULTS=1; started again without, the test seed is gone from disk and the broker refuses it,
    while the console's goes on working."""
    monkeypatch.delenv("RACKPLANE_IDENTITIES", raising=False)
    base = make_stack("no-test-identity").dir

    def broker(faults: str) -> Stack:  # the broker as a stack starts it (a database given: none started)
        s = Stack(base, database_url="postgresql://unused", env={"RACKPLANE_FAULTS": faults})
        s.start_infra()
        return s

    s = broker("1")
    try:
        assert s.security is not None and s.nats_url
        seed = s.security.store.seed_file(identities.TEST).read_bytes()
        tester = await bus.connect(s.nats_url, "tester", retry_for=3, seed_file=s.security.seed("test"),
                                   inbox_prefix=subjects.inbox_prefix("test"))  # fmt: skip
        await tester.close()  # with FAULTS=1 it is there, for `rackctl chaos`
    finally:
        s.stop()
    s = broker("0")
    try:
        assert s.security is not None and s.nats_url
        store = s.security.store
        assert identities.TEST not in store.identities and not (store.dir / "test.nk").exists()
        assert identities.TEST not in [row["name"] for row in json.loads(store.manifest.read_text())]
        stolen = base / "stolen-test.nk"
        stolen.write_bytes(seed)
        with pytest.raises(ConnectionError, match="refused"):
            await bus.connect(
                s.nats_url, "thief", retry_for=2, seed_file=str(stolen), inbox_prefix="_INBOX_test"
            )
        console = await bus.connect(s.nats_url, "console", retry_for=3, seed_file=s.security.seed("console"),
                                    inbox_prefix=subjects.inbox_prefix("console"))  # fmt: skip
        await console.close()
    finally:
        s.stop()
        shutil.rmtree(base, ignore_errors=True)


# --- sleds, silos, no credential --------------------------------------------------------------------------


async def test_no_credential_no_connection(stack: Stack) -> None:
    with pytest.raises(ConnectionError, match=r"(?i)authorization"):
        await bus.connect(stack.nats_url or "", "anonymous", retry_for=2)


async def test_a_sled_speaks_only_for_itself(stack: Stack, client: Client) -> None:
    await eventually(lambda: sleds_known(client, 8))  # the stack may have just started
    test_js = client.nc.jetstream()
    before = await test_js.stream_info(subjects.SLED_REPORT_STREAM, subjects_filter="rp.sled.sled-1.>")
    cmds_before = (await test_js.consumer_info(subjects.SLED_CMD_STREAM, "sled-agent-sled-1")).delivered
    sled_list = await client.sled_list()
    nc = await connect_as(stack, "sled-0")
    try:
        js = nc.jetstream(timeout=2)
        with pytest.raises(nats.errors.TimeoutError):  # refused: the broker stores nothing, acks nothing
            await js.publish(subjects.sled_report("sled-1", "inventory"), b"{}")
        with pytest.raises(bus.CommandError, match="forbidden by the broker"):
            await bus.request(nc, subjects.command(None, "sled", "list"), SledList(), source="x", timeout=5)
        with pytest.raises(bus.CommandError, match="forbidden by the broker"):
            await bus.request(nc, subjects.sim_control("sled.list"), SimSledList(), source="x", timeout=5)
        with pytest.raises(nats.errors.TimeoutError):  # another's durable: not even its info
            await js.consumer_info(subjects.SLED_CMD_STREAM, "sled-agent-sled-1")
        with pytest.raises(nats.errors.TimeoutError):
            sub = await js.pull_subscribe_bind("sled-agent-sled-1", subjects.SLED_CMD_STREAM)
            await sub.fetch(1, timeout=2)
        await nc.subscribe("rp.sled.sled-1.cmd.>")  # refused too (it would see only live commands anyway)
        await nc.flush(2)
    finally:
        await nc.close()
    after = await test_js.stream_info(subjects.SLED_REPORT_STREAM, subjects_filter="rp.sled.sled-1.>")
    assert (
        await test_js.consumer_info(subjects.SLED_CMD_STREAM, "sled-agent-sled-1")
    ).delivered == cmds_before
    assert await client.sled_list() is not None and len(sled_list) >= 8
    # sled-1's own inventories go on arriving; what sled-0 sent in its name never did
    reports = await test_js.get_last_msg(
        subjects.SLED_REPORT_STREAM, subjects.sled_report("sled-1", "inventory")
    )
    assert b'"sled-1"' in reports.data and after.state.last_seq >= before.state.last_seq  # (TTLs expire)


async def test_a_silo_operator_reaches_only_its_silo(stack: Stack, client: Client) -> None:
    mine, theirs = unique("silo"), unique("silo")
    for silo in (mine, theirs):
        await client.silo_create(silo)
        await client.project_create(silo, "web")
    await client.instance_create(theirs, "web", "db", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    _with_silo_operator(stack, mine)
    assert stack.security is not None
    context = stack.security.write_context(f"op-{mine}", f"silo-operator-{mine}", stack.nats_url or "")
    op = await Client.connect(stack.nats_url, timeout=5, context=str(context))
    try:
        assert await op.instance_list(mine) == []
        await op.instance_create(mine, "web", "app", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        for call in (
            op.instance_list(theirs),
            op.instance_list(None),
            op.instance("show", theirs, "web", "db"),
            op.instance("start", theirs, "web", "db"),
            op.instance("stop", theirs, "web", "db"),
            op.instance("delete", theirs, "web", "db"),
            op.sled_list(),
            op.faults("accounting"),
            op.call(
                subjects.command(mine, "instance", "list"), InstanceList(silo=theirs)
            ),  # refused by the service
        ):
            with pytest.raises(bus.CommandError) as refused:
                await call
            assert refused.value.code == "forbidden", refused.value
    finally:
        await op.close()
    assert (await client.instance("show", theirs, "web", "db"))["state"] == "stopped"


# --- fault injection and simulator control ----------------------------------------------------------------

EVERYONE = [i.name for i in PROBED]


def _with_silo_operator(stack: Stack, silo: str) -> None:
    assert stack.security is not None and stack.nats is not None
    if f"silo-operator-{silo}" not in stack.security.store.identities:
        stack.security.add(identities.silo_operator(silo))
    stack.security.server_conf()
    stack.nats.reload()


async def _refused(stack: Stack, name: str, subject: str, body: Any) -> bool:
    nc = await connect_as(stack, name)
    try:
        await bus.request(nc, subject, body, source="x", timeout=5)
        return False
    except bus.CommandError as e:
        return e.code == "forbidden"
    finally:
        await nc.close()


async def test_fault_injection_answers_the_test_identity_only(stack: Stack) -> None:
    _with_silo_operator(stack, "acme")
    refused = [
        n for n in EVERYONE if await _refused(stack, n, subjects.faults("accounting"), ServiceFaults())
    ]
    assert set(EVERYONE) - set(refused) == {"test"}


async def test_simulator_control_answers_the_simulator_operator_only(stack: Stack) -> None:
    _with_silo_operator(stack, "acme")
    ghost = SimSledFreeze(sled_id="sled-999")  # names no sled: an allowed sender gets not_found, no change
    for subject, body in (
        (subjects.sim_control("sled.list"), SimSledList()),
        (subjects.sim_control("sled.freeze"), ghost),
    ):
        refused = [n for n in EVERYONE if await _refused(stack, n, subject, body)]
        assert set(EVERYONE) - set(refused) == {"simulator-operator", "console", "test"}, subject


async def test_fault_injection_is_off_unless_enabled() -> None:
    s = make_stack("no-faults", RACKPLANE_FAULTS="0", RACKPLANE_SLEDS="1")
    try:
        s.start()
        c = await Client.connect(s.nats_url, timeout=3)
        try:
            with pytest.raises(bus.CommandError) as off:
                await c.faults("accounting")
            assert off.value.code == "unavailable"
        finally:
            await c.close()
    finally:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


# --- TLS --------------------------------------------------------------------------------------------------


async def test_a_stack_behind_tls() -> None:
    s = make_stack("tls", RACKPLANE_TLS="1", RACKPLANE_SLEDS="2")
    try:
        s.start()
        assert s.nats_url and s.nats_url.startswith("tls://") and s.security is not None
        context = s.security.write_context("tls", "test", s.nats_url)
        c = await Client.connect(timeout=5, context=str(context))
        try:
            await eventually(lambda: _has_sleds(c, 2), timeout=20)
            silo = unique("silo")
            await c.silo_create(silo)
            await c.project_create(silo, "web")
            await c.instance_create(silo, "web", "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
            await c.instance("start", silo, "web", "vm")
            await wait_state(c, silo, "web", "vm", "running")
        finally:
            await c.close()
        plain = s.nats_url.replace("tls://", "nats://")
        with pytest.raises(ConnectionError):  # no CA: the server's certificate is not trusted
            await bus.connect(plain, "no-ca", retry_for=2, seed_file=s.security.seed("test"))
    finally:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


async def _has_sleds(c: Client, n: int) -> bool:
    return len(await c.sled_list()) >= n


# --- the documented matrix --------------------------------------------------------------------------------


def test_docs_show_the_generated_matrix() -> None:
    """docs/security.md holds `python -m deploy.identities matrix`'s output between its markers."""
    text = (ROOT / "docs" / "security.md").read_text()
    begin, end = "<!-- matrix: begin -->\n", "<!-- matrix: end -->"
    assert begin in text and end in text
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    assert shown == identities.matrix(), "docs/security.md is stale: run `python -m deploy.identities matrix`"


async def test_rackctl_check_runs_with_the_auditor_identity(stack: Stack, db: Any) -> None:
    """The broker's checks (consumers, inventories, pool events) need nothing but the auditor's reads: a
    missing grant would make one of them fail (time out) instead of coming back clean."""
    from rackctl.invariants import check

    auditor = await connect_as(stack, "auditor")
    try:
        js = auditor.jetstream(timeout=5)

        async def clean() -> bool:
            async with db.acquire() as conn:
                return not await check(conn, at_rest=True, js=js)

        await eventually(clean, timeout=20)
    finally:
        await auditor.close()


async def test_add_a_sled_then_rotate_its_credential(bare: tuple[Nats, BrokerSecurity]) -> None:
    """docs/security.md's procedures: `add-sled` and a reload let a new sled in; `rotate` and a reload
    shut its old key out."""
    server, security = bare
    folder = security.store.dir
    new = identities.next_sled_id(security.store)
    identities.main(["add-sled", str(folder)])
    security.store = identities.Store.load(folder)
    assert new in security.store.identities
    server.reload()

    async def reports(seed: str) -> None:
        nc = await bus.connect(
            server.url, new, retry_for=3, seed_file=seed, inbox_prefix=subjects.inbox_prefix(new)
        )
        try:
            await nc.jetstream(timeout=2).publish(subjects.sled_report(new, "inventory"), b"{}")
        finally:
            await nc.close()

    old_seed = security.store.seed_file(new).read_bytes()
    await reports(security.seed(new))
    identities.main(["rotate", str(folder), new])
    assert security.store.seed_file(new).read_bytes() != old_seed
    server.reload()
    await reports(security.seed(new))
    stale = folder / "stale.nk"
    stale.write_bytes(old_seed)
    with pytest.raises(ConnectionError, match="refused"):
        await reports(str(stale))


def test_a_sled_without_a_credential_cannot_join(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.sled_agent import identity
    from shared.config import Settings

    monkeypatch.setenv("RACKPLANE_SLED_NKEYS", str(tmp_path))
    folder = Settings.from_env().sled_nkeys
    (tmp_path / "sled-0.nk").write_text("seed")
    assert identity.seed_file("sled-0", folder) == tmp_path / "sled-0.nk"
    with pytest.raises(identity.NoCredential, match="add-sled"):
        identity.seed_file("sled-1", folder)
