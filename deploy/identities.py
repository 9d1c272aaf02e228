"""Who may do what on the bus: every NATS identity, its permissions, its nkey, and the server's config.

Each sled, service and operator is a NATS user identified by an nkey (an Ed25519 key pair: the server
holds only the public key, the client signs the server's nonce with its seed). This module is the one
place where permissions are defined; it writes

- `<dir>/<identity>.nk`: the identity's seed (mode 0600), the credential handed to that one client;
- `<dir>/identities.json`: which identities exist (name, kind, parameter), so that the config can be
  written again after a sled or a silo operator is added;
- `<dir>/auth.conf`: the `accounts` block of nats-server's config, every user with its permissions
  (included by the server config: `include "auth.conf"`).

    python -m deploy.identities init DIR [--sleds 32] [--silo acme ...] [--test]
    python -m deploy.identities add-sled DIR [SLED_ID]       # then reload the server (SIGHUP)
    python -m deploy.identities add-silo-operator DIR SILO   # likewise
    python -m deploy.identities rotate DIR NAME              # a new seed for NAME; then reload
    python -m deploy.identities remove DIR NAME              # NAME and its seed gone; then reload
    python -m deploy.identities matrix                       # the permission matrix, in Markdown

docs/security.md explains the model; its matrix is this module's output (tests/test_security.py
compares them).
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from shared import topology
from shared.messages import NAME_PATTERN
from shared.topology import Durable, jsapi, routes, subjects

ACCOUNT = "RACKPLANE"
SUBSCRIBERS = "SUBSCRIBERS"
"""The account of the services that follow the events (subscribers) and of the one identity that makes
their streams: apart from rackplane's, so that nothing a subscriber does on the bus (a push consumer that
delivers anywhere, a publish) reaches a subject of rackplane's. The broker sources the events into it
across the accounts (`Store.config`)."""
SUBSCRIBER_ADMIN = "subscriber-admin"
SERVICES = ("instance-manager", "accounting", "recovery", "simulator")
"""Identities of the service processes (`simulator` is the sled-agent process's own connection)."""
OPERATORS = (
    "stream-admin",
    "fleet-operator",
    "simulator-operator",
    "auditor",
    "console",
    "test",
    "dlq-admin",
    SUBSCRIBER_ADMIN,
)
TEST = "test"
"""The identity of the tests and of fault injection: made only where asked for (`standard(test=True)`: the
test fixtures, `make run FAULTS=1`), never by a plain `make run` or compose."""
DEFAULT_SLEDS = 32
"""Sled identities made up front: the simulator's sleds, and room for `rp.sim.sled.add`."""
SLED_ID = re.compile(r"^sled-[0-9]{1,6}$")
JS_INFO = jsapi.INFO
RECOVERY_ORDERS = (
    subjects.command_pattern("vmm", ">"),
    subjects.command_pattern("instance", "restart"),
    subjects.command_pattern("instance", "settle"),
)
"""Commands only recovery sends: denied to every operator, whatever else they may send."""


@dataclass(frozen=True)
class Grants:
    """Subjects an identity may publish to and subscribe on (deny beats allow), and whether it may
    answer requests (`allow_responses`: publish once on the reply subject of a request it received)."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    responses: bool = False

    def __or__(self, other: Grants) -> Grants:
        def merge(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(a + b))

        return Grants(
            merge(self.publish, other.publish),
            merge(self.subscribe, other.subscribe),
            merge(self.publish_deny, other.publish_deny),
            merge(self.subscribe_deny, other.subscribe_deny),
            self.responses or other.responses,
        )


def consume(d: Durable) -> Grants:
    """Create (with exactly its filter), inspect, pull from and ack one durable consumer, and nothing else.

    The create subject carries the filter (`$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>`, which
    the server checks against the config's), so the durable cannot be re-pointed at others' messages."""
    return Grants(
        publish=(
            jsapi.consumer_create(d.stream, d.name, d.filter_subject),
            jsapi.consumer("INFO", d.stream, d.name),
            jsapi.consumer("MSG.NEXT", d.stream, d.name),
            jsapi.ack(d.stream, d.name),
        )
    )


def consume_own(service: str) -> Grants:
    """Every fixed durable the service owns (shared/topology/durables.py)."""
    return functools.reduce(operator.or_, (consume(d) for d in topology.owned_by(service)), Grants())


def serves(*patterns: str) -> Grants:
    """Answer requests on these subjects."""
    return Grants(subscribe=patterns, responses=True)


def service_common(service: str) -> Grants:
    """Every service: its stats, its fault injection, and its dead letters."""
    return serves(subjects.stats(service), subjects.faults(service)) | Grants(
        publish=(JS_INFO, subjects.dead_letter(service, ">"))
    )


def sled_grants(sled_id: str) -> Grants:
    durable = topology.sled(sled_id)
    return consume(durable) | Grants(
        publish=(JS_INFO, subjects.sled_report(sled_id, ">"), durable.dead_letter_subject)
    )


def service_grants(name: str) -> Grants:
    if name == "instance-manager":
        return (
            service_common(name)
            | serves(
                *(subjects.command_pattern(r) for r in ("silo", "project", "instance", "sled", "vmm", "pool"))
            )
            | consume_own(name)
            | Grants(
                publish=(
                    subjects.sled_command("*", ">"),
                    subjects.provision_delta("*", "*", "*"),
                    *routes.events_sent_by(name),
                )
            )
        )
    if name == "accounting":
        return (
            service_common(name)
            | serves(subjects.command_pattern("usage"))
            | consume_own(name)
            | Grants(publish=tuple(routes.events_sent_by(name)))
        )
    if name == "recovery":
        return (
            service_common(name)
            | consume_own(name)
            | Grants(
                publish=(
                    subjects.command(None, "vmm", ">"),
                    subjects.command(None, "instance", "restart"),
                    subjects.command(None, "instance", "settle"),
                )
            )
        )
    if name == "simulator":  # the sled-agent process's own connection; each sled has one of its own
        return service_common("sled-agent") | serves(subjects.sim_control(">"))
    raise ValueError(f"no service {name!r}")


def durables_of(stream: str) -> tuple[str, ...]:
    """Every durable consumer of the services' on `stream` (shared/topology/durables.py)."""
    return tuple(d.name for d in topology.on_stream(stream))


def follow_events(filter_subject: str) -> Grants:
    """Follow the events under `filter_subject` from any point, through short-lived consumers of one's own.

    The consumer is named (`$JS.API.CONSUMER.CREATE.EVENTS.<name>.<filter>`: the server checks that the
    filter of the subject is the config's), so the grant holds the reader to its filter. A create request
    naming an existing consumer updates it, though, filter included: the durables of the services and of
    are denied by name, so no follower can re-point or drain them."""
    stream = subjects.EVENTS_STREAM
    durables = durables_of(stream)
    return Grants(
        publish=(
            JS_INFO,
            jsapi.consumer_create(stream, "*", filter_subject),
            jsapi.consumer("MSG.NEXT", stream, "*"),
        ),
        publish_deny=tuple(
            deny
            for d in durables
            for deny in (jsapi.consumer_create(stream, d, ">"), jsapi.consumer("MSG.NEXT", stream, d))
        ),
    )


def subscriber_grants(name: str, silo: str | None) -> Grants:
    """A subscriber's: every consumer on its own stream (`subjects.subscriber_stream`), which holds only the
    events of its scope, durable or ordered, created only with a filter within that scope (the filter is in
    the create subject, which the server checks against the config's); its stream's info and messages by
    sequence. Nothing on EVENTS itself, so no subscriber can read, drain or re-point another's consumers."""
    stream = subjects.subscriber_stream(name)
    return Grants(
        publish=(
            JS_INFO,
            jsapi.stream("INFO", stream),
            jsapi.stream("MSG.GET", stream),
            jsapi.consumer_create(stream, "*", subjects.event_pattern(silo)),
            jsapi.consumer("INFO", stream, "*"),
            jsapi.consumer("DELETE", stream, "*"),
            jsapi.consumer("NAMES", stream),
            jsapi.consumer("LIST", stream),
            jsapi.consumer("MSG.NEXT", stream, "*"),
            jsapi.ack(stream),
        ),
        publish_deny=(subjects.under(subjects.SUBSCRIBERS_API), jsapi.flow_control(subjects.EVENTS_STREAM)),
    )


def subscriber_streams_admin(names: Iterable[str]) -> Grants:
    """The subscriber administrator's rights: the subscribers' streams made, read and deleted by name, as
    `rackctl subscriber add` and `remove` do (deploy/subscribers.py); never updated, so a stream's source
    filter, a subscriber's scope, is fixed when it is made. Sourcing from EVENTS is the broker's, for the
    account: this identity may not send on rackplane's API (`subjects.SUBSCRIBERS_API`) either."""
    return Grants(
        publish_deny=(subjects.under(subjects.SUBSCRIBERS_API), jsapi.flow_control(subjects.EVENTS_STREAM)),
        publish=(
            JS_INFO,
            *(
                jsapi.stream(verb, subjects.subscriber_stream(n))
                for n in names
                for verb in ("INFO", "CREATE", "DELETE")
            ),
        ),
    )


def silo_operator_grants(silo: str) -> Grants:
    return Grants(
        publish=(subjects.command_scope(silo),),
        publish_deny=RECOVERY_ORDERS,
        subscribe=(subjects.event_pattern(silo),),
    ) | follow_events(subjects.event_pattern(silo))


AUDITED_STREAMS = (
    subjects.EVENTS_STREAM,
    subjects.SLED_REPORT_STREAM,
    subjects.SLED_CMD_STREAM,
    subjects.DLQ_STREAM,
)
"""What the auditor reads: events, what the sleds said, what they were ordered, and the dead letters."""
AUDITOR = Grants(
    publish=(
        JS_INFO,
        jsapi.streams("NAMES"),
        jsapi.streams("LIST"),
        jsapi.stream("INFO", "*"),
        jsapi.stream("MSG.GET", "*"),
        jsapi.consumer("NAMES", "*"),
        jsapi.consumer("LIST", "*"),
        jsapi.consumer("INFO", "*", "*"),
        subjects.stats("*"),
    )
)
"""It reads messages by sequence (`rackctl/stored.py`) and creates no consumer: a create request naming
an existing consumer updates it, filter included, whatever the create subject, so a reader with a create
grant could re-point a service's durable."""
FLEET_OPERATOR = Grants(
    publish=(subjects.command_scope("*"), subjects.stats("*")),
    publish_deny=RECOVERY_ORDERS,
    subscribe=(subjects.event_pattern(None),),
) | follow_events(subjects.event_pattern(None))
SIMULATOR_OPERATOR = Grants(publish=(subjects.sim_control(">"),))
FAULT_INJECTOR = Grants(publish=(subjects.faults("*"),))
STREAM_VERBS = ("INFO", "CREATE", "UPDATE")
STREAM_ADMIN = Grants(
    publish=(
        JS_INFO,
        *(jsapi.stream(verb, name) for name in subjects.STREAMS for verb in STREAM_VERBS),
    )
)
"""Creates and updates the streams deploy defines (`subjects.STREAMS`), each by name, and nothing else: no
other stream, no consumer (none to create, update, delete or read through), no message. An update that
changes a stream's limits cannot be told from deploy's own by its subject: see docs/security.md."""
TEST_CONSUMERS = Grants(
    publish=(
        *(
            grant
            for stream in (subjects.EVENTS_STREAM, subjects.PROVISION_STREAM)
            for grant in (
                jsapi.consumer("DURABLE.CREATE", stream, "*"),
                jsapi.consumer_create(stream, "*", ">"),
                jsapi.consumer("DELETE", stream, "*"),
                jsapi.consumer("MSG.NEXT", stream, "*"),
                jsapi.ack(stream),
            )
        ),
        # ordered consumers on the streams the auditor reads (the plain create subject refuses a durable)
        *(jsapi.consumer_create(stream) for stream in AUDITED_STREAMS),
        *(jsapi.flow_control(stream) for stream in AUDITED_STREAMS),
    )
)
"""Tests follow EVENTS, read deltas and dead letters through consumers of their own (a test identity only:
operators never may)."""
DLQ_ADMIN = Grants(
    publish=(
        JS_INFO,
        jsapi.stream("INFO", subjects.DLQ_STREAM),
        jsapi.stream("MSG.GET", subjects.DLQ_STREAM),
        jsapi.stream("MSG.DELETE", subjects.DLQ_STREAM),
        *(jsapi.stream("MSG.GET", s) for s in subjects.STREAMS if s != subjects.DLQ_STREAM),
        *subjects.REPLAYABLE,
    )
)
"""Reads, replays and deletes dead letters. Replaying publishes on every subject a dead letter can come
from (`subjects.REPLAYABLE`: every stream's but the DLQ's), so this identity can say what any sled or
service says: it is for the operator on call, kept apart from the console's (docs/operations.md). It reads
the message a letter names from its stream, by sequence, since a replay sends that, never the letter's
body, which its filer wrote (rackctl/dead_letters/)."""
NEVER = tuple(jsapi.stream(verb, name) for name in subjects.STREAMS for verb in ("DELETE", "PURGE"))
"""Denied to every identity: rackplane's streams are created and updated by deploy, and never deleted or
purged (a subscriber's own stream is deleted with the subscriber, by the subscriber administrator)."""


def operator_grants(name: str) -> Grants:
    console = FLEET_OPERATOR | SIMULATOR_OPERATOR | AUDITOR
    return {
        "stream-admin": STREAM_ADMIN,
        "fleet-operator": FLEET_OPERATOR,
        "simulator-operator": SIMULATOR_OPERATOR,
        "auditor": AUDITOR,
        "console": console,
        "test": console | FAULT_INJECTOR | TEST_CONSUMERS,
        "dlq-admin": DLQ_ADMIN,
        SUBSCRIBER_ADMIN: subscriber_streams_admin(()),
    }[name]


@dataclass(frozen=True)
class Identity:
    name: str
    kind: str
    """sled, service, silo-operator, subscriber or operator."""
    param: str = ""
    """The sled's id, the service's name, the silo (a silo operator's; a subscriber's, or "" for the
    fleet's), the operator's role."""

    @property
    def grants(self) -> Grants:
        g = {
            "sled": lambda: sled_grants(self.param),
            "service": lambda: service_grants(self.param),
            "silo-operator": lambda: silo_operator_grants(self.param),
            "subscriber": lambda: subscriber_grants(self.name, self.param or None),
            "operator": lambda: operator_grants(self.param),
        }[self.kind]()
        return g | Grants(subscribe=(subjects.under(subjects.inbox_prefix(self.name)),), publish_deny=NEVER)

    @property
    def inbox(self) -> str:
        return subjects.inbox_prefix(self.name)

    @property
    def account(self) -> str:
        return SUBSCRIBERS if self.kind == "subscriber" or self.name == SUBSCRIBER_ADMIN else ACCOUNT


def sled(sled_id: str) -> Identity:
    if not SLED_ID.match(sled_id):
        raise ValueError(f"a sled id is sled-<number>, not {sled_id!r}")
    return Identity(sled_id, "sled", sled_id)


def silo_operator(silo: str) -> Identity:
    if not re.match(NAME_PATTERN, silo):
        raise ValueError(f"not a silo name: {silo!r}")
    return Identity(f"silo-operator-{silo}", "silo-operator", silo)


RESERVED = re.compile(r"^(silo-operator-|sled-)")
"""Name prefixes of the identities a rack makes itself: no subscriber takes one."""
EVENTS_READER = "events-reader"
"""The fleet subscriber every rack has (`make run` writes its context): examples/ follow it."""


def subscriber(name: str, silo: str | None = None) -> Identity:
    """A service following the events: the whole fleet's, or with `silo` only that silo's."""
    if not re.match(NAME_PATTERN, name) or RESERVED.match(name) or name in SERVICES + OPERATORS:
        raise ValueError(
            f"a subscriber's name is lowercase letters, digits and '-' (not a service's, an operator's, a "
            f"sled's or a silo operator's): not {name!r}"
        )
    if silo is not None and not re.match(NAME_PATTERN, silo):
        raise ValueError(f"not a silo name: {silo!r}")
    return Identity(name, "subscriber", silo or "")


def standard(sleds: int = DEFAULT_SLEDS, silos: Iterable[str] = (), *, test: bool = False) -> list[Identity]:
    """The identities of a rack: services, operators, `sleds` sleds, the named silos' operators and the
    events reader; the test identity only with `test` (a credential that may inject faults exists only where
    it is used)."""
    return [
        *(Identity(s, "service", s) for s in SERVICES),
        *(Identity(o, "operator", o) for o in OPERATORS if test or o != TEST),
        subscriber(EVENTS_READER),
        *(sled(f"sled-{i}") for i in range(sleds)),
        *(silo_operator(s) for s in silos),
    ]


# --- the folder of credentials ---------------------------------------------------------------------------


@dataclass
class Store:
    """A folder of identities: their seeds, the list of them, and the server config they make."""

    dir: Path
    identities: dict[str, Identity] = field(default_factory=dict)

    @property
    def manifest(self) -> Path:
        return self.dir / "identities.json"

    @property
    def auth_conf(self) -> Path:
        return self.dir / "auth.conf"

    @property
    def sleds_dir(self) -> Path:
        """The sleds' seeds, apart from the others: the folder handed to the sled agent (the simulator)."""
        return self.dir / "sleds"

    def seed_file(self, name: str) -> Path:
        identity = self.identities.get(name)
        return (self.sleds_dir if identity and identity.kind == "sled" else self.dir) / f"{name}.nk"

    @classmethod
    def load(cls, dir: Path) -> Store:
        store = cls(dir)
        for row in json.loads(store.manifest.read_text()):
            store.identities[row["name"]] = Identity(row["name"], row["kind"], row["param"])
        return store

    @classmethod
    def init(cls, dir: Path, identities: Iterable[Identity]) -> Store:
        """Make the folder (or complete it: existing seeds are kept) and write the server config."""
        store = cls.load(dir) if (dir / "identities.json").exists() else cls(dir)
        for identity in identities:  # what a rack is made of is as given (a release may change a kind)
            store.identities[identity.name] = identity
        store.write()
        return store

    def add(self, identity: Identity) -> Path:
        self.identities[identity.name] = identity
        self.write()
        return self.seed_file(identity.name)

    def remove(self, name: str) -> None:
        """Forget `name` and delete its seed: the server refuses its key once it reloads its config."""
        seed = self.seed_file(name)
        if self.identities.pop(name, None) is not None:
            seed.unlink(missing_ok=True)
            self.write()

    def rotate(self, name: str) -> Path:
        """A new key pair for `name`: the old seed stops working once the server reloads its config."""
        if name not in self.identities:
            raise KeyError(f"no identity {name!r} in {self.dir}")
        self.seed_file(name).unlink(missing_ok=True)
        self.write()
        return self.seed_file(name)

    def write(self) -> None:
        self.sleds_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        for name in self.identities:
            path = self.seed_file(name)
            if not path.exists():
                seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(seed + b"\n")
        rows = [{"name": i.name, "kind": i.kind, "param": i.param} for i in self.identities.values()]
        _replace(self.manifest, json.dumps(rows, indent=1) + "\n")
        _replace(self.auth_conf, self.config())

    def public_key(self, name: str) -> str:
        seed = bytearray(self.seed_file(name).read_bytes().strip())
        return nkeys.from_seed(seed).public_key.decode()

    def subscribers(self) -> list[Identity]:
        return [i for i in self.identities.values() if i.kind == "subscriber"]

    def grants(self, identity: Identity) -> Grants:
        """An identity's grants in this rack: the subscriber administrator's name the subscribers' streams."""
        if identity.name == SUBSCRIBER_ADMIN:
            return identity.grants | subscriber_streams_admin(s.name for s in self.subscribers())
        return identity.grants

    def config(self) -> str:
        """The `accounts` block: rackplane's account and the subscribers', each with JetStream and its
        users. Rackplane's exports to the subscribers' only what sourcing EVENTS takes: creating a consumer
        on EVENTS and answering its flow control (services no subscriber may call: `subscriber_grants`), and
        the subjects it delivers on. Without the flow-control replies the copies stop after a few
        megabytes, the consumer waiting for an answer that never crosses."""

        def users(account: str) -> str:
            return "".join(
                _user_conf(i.name, self.grants(i), self.public_key(i.name))
                for i in self.identities.values()
                if i.account == account
            )

        create = jsapi.consumer_create(subjects.EVENTS_STREAM, ">")
        deliver = subjects.subscriber_delivery(">")
        api = subjects.SUBSCRIBERS_API
        flow = jsapi.flow_control(subjects.EVENTS_STREAM)
        return (
            "# Written by deploy/identities.py from identities.json: do not edit (regenerate instead).\n"
            f"accounts {{\n  {ACCOUNT} {{\n    jetstream: enabled\n    users: [\n{users(ACCOUNT)}    ]\n"
            f"    exports: [\n      {{service: {json.dumps(create)}, accounts: [{SUBSCRIBERS}]}}\n"
            f"      {{service: {json.dumps(flow)}, accounts: [{SUBSCRIBERS}]}}\n"
            f"      {{stream: {json.dumps(deliver)}, accounts: [{SUBSCRIBERS}]}}\n    ]\n  }}\n"
            f"  {SUBSCRIBERS} {{\n    jetstream: enabled\n    users: [\n{users(SUBSCRIBERS)}    ]\n"
            f"    imports: [\n      {{service: {{account: {ACCOUNT}, subject: {json.dumps(create)}}}, "
            f"to: {json.dumps(create.replace(jsapi.API, api, 1))}}}\n"
            f"      {{service: {{account: {ACCOUNT}, subject: {json.dumps(flow)}}}}}\n"
            f"      {{stream: {{account: {ACCOUNT}, subject: {json.dumps(deliver)}}}}}\n    ]\n  }}\n}}\n"
        )


def _replace(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


def _subject_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def _user_conf(name: str, g: Grants, public_key: str) -> str:
    publish = f"allow: {_subject_list(g.publish)}" + (f", deny: {_subject_list(g.publish_deny)}")
    subscribe = f"allow: {_subject_list(g.subscribe)}" + (
        f", deny: {_subject_list(g.subscribe_deny)}" if g.subscribe_deny else ""
    )
    responses = ", allow_responses: true" if g.responses else ""
    return (
        f"      # {name}\n"
        f"      {{nkey: {public_key}, permissions: {{publish: {{{publish}}}, "
        f"subscribe: {{{subscribe}}}{responses}}}}}\n"
    )


# --- the permission matrix, for docs/security.md ---------------------------------------------------------


def matrix() -> str:
    """Every kind of identity and its grants, in Markdown, from the same definitions as the config
    (one example of each per-sled and per-silo identity: `sled-7`, `silo-operator-acme`)."""
    examples = [
        *(Identity(s, "service", s) for s in SERVICES),
        sled("sled-7"),
        silo_operator("acme"),
        subscriber("billing"),
        subscriber("acme-dashboard", "acme"),
        *(Identity(o, "operator", o) for o in OPERATORS),
    ]
    out = []
    for i in examples:
        g = i.grants
        out.append(f"#### `{i.name}`\n")
        for label, items in (
            ("publish", g.publish),
            ("never publish", g.publish_deny),
            ("subscribe", g.subscribe),
            ("never subscribe", g.subscribe_deny),
        ):
            if items:
                out.append(f"- {label}: " + ", ".join(f"`{s}`" for s in items))
        out.append(f"- answers requests (`allow_responses`): {'yes' if g.responses else 'no'}\n")
    return "\n".join(out)


def next_sled_id(store: Store) -> str:
    numbers = [int(i.param.removeprefix("sled-")) for i in store.identities.values() if i.kind == "sled"]
    return f"sled-{max(numbers, default=-1) + 1}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.identities", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="make the identities of a rack and the server's auth.conf")
    p.add_argument("dir", type=Path)
    p.add_argument("--sleds", type=int, default=DEFAULT_SLEDS)
    p.add_argument("--silo", action="append", default=[], help="make an operator for this silo")
    p.add_argument("--test", action="store_true", help="also the test identity (tests, fault injection)")
    p = sub.add_parser("add-sled", help="a credential for a new sled (then reload the server)")
    p.add_argument("dir", type=Path)
    p.add_argument("sled_id", nargs="?")
    p = sub.add_parser("add-silo-operator", help="a credential for a silo's operator (then reload)")
    p.add_argument("dir", type=Path)
    p.add_argument("silo")
    p = sub.add_parser("remove", help="forget an identity and delete its seed (then reload)")
    p.add_argument("dir", type=Path)
    p.add_argument("name")
    p = sub.add_parser("rotate", help="a new key pair for an identity (then reload)")
    p.add_argument("dir", type=Path)
    p.add_argument("name")
    sub.add_parser("matrix", help="print the permission matrix (Markdown)")
    a = parser.parse_args(argv)
    if a.command == "matrix":
        sys.stdout.write(matrix())
        return
    if a.command == "init":
        store = Store.init(a.dir, standard(a.sleds, a.silo, test=a.test))
        if not a.test:  # one made by an earlier `--test` goes: the broker refuses it after a reload
            store.remove(TEST)
        print(f"{len(store.identities)} identities in {a.dir}; server config: {store.auth_conf}")
        return
    store = Store.load(a.dir)
    if a.command == "add-sled":
        path = store.add(sled(a.sled_id or next_sled_id(store)))
    elif a.command == "add-silo-operator":
        path = store.add(silo_operator(a.silo))
    elif a.command == "remove":
        store.remove(a.name)
        print(f"removed {a.name}; server config: {store.auth_conf}; reload the server to apply it")
        return
    else:
        path = store.rotate(a.name)
    print(f"credential: {path}")
    print(f"server config: {store.auth_conf}; reload the server to apply it (nats-server --signal reload)")


if __name__ == "__main__":
    main()
