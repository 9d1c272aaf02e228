"""The subject scheme, in one place: every subject is built, and read back, here. docs/subjects.md
explains it; tests/test_subjects.py keeps both true.

Subjects are shaped so that broker permissions can confine a client by prefix:
a sled agent to `rp.sled.<its id>.>`, a silo operator to `rp.cmd.<silo>.>` and `rp.evt.<silo>.>`.
"""

from __future__ import annotations

import re

FLEET = "_fleet"
"""The silo token of fleet-wide commands and events. Names start with a letter, so none collides."""

# Streams: name -> subjects it captures.
SLED_CMD_STREAM = "SLED_CMD"
SLED_REPORT_STREAM = "SLED_REPORT"
PROVISION_STREAM = "PROVISION"
EVENTS_STREAM = "EVENTS"
DLQ_STREAM = "DLQ"

STREAMS: dict[str, list[str]] = {
    SLED_CMD_STREAM: ["rp.sled.*.cmd.>"],
    SLED_REPORT_STREAM: ["rp.sled.*.report.>"],
    PROVISION_STREAM: ["rp.acct.delta.*.*.*"],
    EVENTS_STREAM: ["rp.evt.>"],
    DLQ_STREAM: ["rp.dlq.>"],
}


DELTA_PARTITIONS = 4
"""Provisioning deltas are spread over this many partitions by instance (the broker's partition function),
each consumed by its own durable, so that batches of different partitions apply side by side."""

TRANSFORMS: dict[str, tuple[str, str]] = {
    PROVISION_STREAM: (
        "rp.acct.delta.*.*.*",
        f"rp.acct.part.{{{{partition({DELTA_PARTITIONS},3)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}",
    ),
}
"""Stream -> (published subjects, stored subject): a delta published on `rp.acct.delta.<silo>.<project>.
<instance>` is stored as `rp.acct.part.<partition>.<silo>.<project>.<instance>`, the partition a hash of
the instance id, so one instance's deltas always share a partition and keep their order."""


def command(silo: str | None, resource: str, verb: str) -> str:
    """Operator command (request/reply): `rp.cmd.<silo|_fleet>.<resource>.<verb>`."""
    return f"rp.cmd.{silo or FLEET}.{resource}.{verb}"


def command_scope(silo: str) -> str:
    """Every command on one silo's subjects (`*`: every silo's): `rp.cmd.<silo>.>`."""
    return f"rp.cmd.{silo}.>"


def under(prefix: str) -> str:
    """Every subject below `prefix`: `<prefix>.>`."""
    return f"{prefix}.>"


def command_pattern(resource: str, verb: str = "*") -> str:
    """What the owning service subscribes to, for every silo."""
    return f"rp.cmd.*.{resource}.{verb}"


def sled_command(sled_id: str, verb: str) -> str:
    """Command to one sled (JetStream): `rp.sled.<sled>.cmd.<verb>`."""
    return f"rp.sled.{sled_id}.cmd.{verb}"


def sled_report(sled_id: str, kind: str) -> str:
    """Report from one sled (JetStream): `rp.sled.<sled>.report.<kind>`, kind is `vmm` or `inventory`."""
    return f"rp.sled.{sled_id}.report.{kind}"


def provision_delta(silo: str, project: str, instance: object) -> str:
    """Provisioning delta (JetStream), consumed by accounting: `rp.acct.delta.<silo>.<project>.<instance>`."""
    return f"rp.acct.delta.{silo}.{project}.{instance}"


def delta_partition(partition: int | str) -> str:
    """One partition of the stored deltas: `rp.acct.part.<partition>.<silo>.<project>.<instance>`."""
    return f"rp.acct.part.{partition}.>"


DELTA_DEAD_LETTERS = "accounting-deltas"
"""The name every partition files its dead letters under: `rp.dlq.accounting.accounting-deltas`."""


def delta_durable(partition: int | str) -> str:
    """accounting's durable consumer of one partition."""
    return f"accounting-deltas-{partition}"


def event(silo: str | None, resource: str, what: str, version: int = 1) -> str:
    """Durable event anyone may follow: `rp.evt.<silo|_fleet>.<resource>.<what>`, and for a later version
    of its schema `rp.evt.<silo|_fleet>.<resource>.<what>.v<version>`: each version on a subject of its
    own, so that a reader filtering on the subject it knows never receives a version it cannot read."""
    base = f"rp.evt.{silo or FLEET}.{resource}.{what}"
    return base if version == 1 else f"{base}.v{version}"


def event_pattern(silo: str | None) -> str:
    """Every event of one silo (`rp.evt.<silo>.>`), or with None every event (`rp.evt.>`)."""
    return f"rp.evt.{silo}.>" if silo else "rp.evt.>"


SUBSCRIBERS_API = "$JS.rackplane.API"
"""Where the subscribers' account reaches rackplane's JetStream API: only to source EVENTS into the
subscribers' streams (deploy/identities.py imports and exports it; no user of that account may send there)."""


def subscriber_delivery(name: str) -> str:
    """Where the broker delivers, across accounts, the events it sources into a subscriber's stream."""
    return f"subscribers.deliver.{name}"


def subscriber_stream(name: str) -> str:
    """A subscriber's own stream, `EVENTS-<name>`: the broker sources into it, from EVENTS, the events the
    subscriber may see (deploy/subscribers.py), and every consumer on it is the subscriber's."""
    return f"{EVENTS_STREAM}-{name}"


SLED_DURABLE_PREFIX = "sled-agent-"


def sled_durable(sled_id: str) -> str:
    """The durable consumer through which one sled reads its orders on SLED_CMD."""
    return f"{SLED_DURABLE_PREFIX}{sled_id}"


def dead_letter(service: str, consumer: str) -> str:
    return f"rp.dlq.{service}.{consumer}"


REPLAYABLE = tuple(p for stream, pats in STREAMS.items() if stream != DLQ_STREAM for p in pats)
"""Where a dead letter's message may be published again: every stream's subjects but the DLQ's."""


def replay_subject(stored: str) -> str:
    """The subject to publish a dead letter's message on, from the subject it was stored under
    (`Rp-Dlq-Subject`): a delta is stored under its partition (`rp.acct.part.<n>.<silo>.<project>.
    <instance>`), which no one may publish on, and is sent again as it was first sent."""
    try:
        return provision_delta(*parse_delta(stored))
    except ValueError:
        return stored


def sim_control(verb: str) -> str:
    """Simulator control (request/reply): `rp.sim.<verb>`. Test and operator tooling only."""
    return f"rp.sim.{verb}"


def sled_claim_error(subject: str, body: object) -> str | None:
    """A sled speaks only for itself: a report naming another sled than its subject's is refused, so that
    permissions confining a sled agent to `rp.sled.<id>.>` cannot be bypassed through the body."""
    token = subject.split(".")[2]
    claimed = getattr(body, "sled_id", token)
    return (
        None
        if claimed == token
        else f"forbidden: report for sled {claimed!r} sent on the subject of {token!r}"
    )


def command_error(subject: str, schema: str) -> str | None:
    """A command travels on its own subject, so that permissions granted per verb cannot be bypassed:
    schema `rp.cmd.<resource>.<verb>` on `rp.cmd.<silo>.<resource>.<verb>`, schema `rp.sled.vmm.<verb>` on
    `rp.sled.<sled>.cmd.vmm.<verb>`, schema `rp.sim.<verb>` on `rp.sim.<verb>` itself."""
    tokens = subject.split(".")
    if schema.startswith("rp.cmd."):
        wanted, where = schema.removeprefix("rp.cmd."), "rp.cmd.<silo>."
        got = ".".join(tokens[3:])
    elif schema.startswith("rp.sled.vmm.") and tokens[3:4] == ["cmd"]:
        wanted, where = schema.removeprefix("rp.sled."), "rp.sled.<sled>.cmd."
        got = ".".join(tokens[4:])
    elif schema.startswith("rp.sim."):
        wanted, where, got = schema, "", subject
    else:
        return None
    return None if got == wanted else f"{schema} sent on {subject}: it belongs on {where}{wanted}"


def silo_of(subject: str) -> str:
    """The silo token of a command or event subject."""
    return subject.split(".")[2]


# --- reading subjects back: the one place that knows which token is which ------------------------------


def parse_command(subject: str) -> tuple[str, str, str]:
    """(silo, resource, verb) of `rp.cmd.<silo|_fleet>.<resource>.<verb>`; the verb may have dots."""
    tokens = subject.split(".", 4)
    if len(tokens) != 5 or tokens[:2] != ["rp", "cmd"]:
        raise ValueError(f"not a command subject: {subject!r}")
    return tokens[2], tokens[3], tokens[4]


def parse_sled_report(subject: str) -> tuple[str, str]:
    """(sled, kind) of `rp.sled.<sled>.report.<kind>`."""
    tokens = subject.split(".")
    if len(tokens) < 5 or tokens[:2] != ["rp", "sled"] or tokens[3] != "report":
        raise ValueError(f"not a sled report subject: {subject!r}")
    return tokens[2], ".".join(tokens[4:])


def parse_delta(subject: str) -> tuple[str, str, str]:
    """(silo, project, instance) of a provisioning delta, as published (`rp.acct.delta.<silo>.<project>.
    <instance>`) or as stored under its partition (`rp.acct.part.<n>.<silo>.<project>.<instance>`)."""
    tokens = subject.split(".")
    if tokens[:3] == ["rp", "acct", "part"] and len(tokens) == 7:
        return tokens[4], tokens[5], tokens[6]
    if tokens[:3] == ["rp", "acct", "delta"] and len(tokens) == 6:
        return tokens[3], tokens[4], tokens[5]
    raise ValueError(f"not a provisioning delta subject: {subject!r}")


def parse_event(subject: str) -> tuple[str, str, int]:
    """(silo, event, version) of `rp.evt.<silo>.<resource>.<what>[.v<version>]`: `event` is
    `<resource>.<what>`, the same for every version of its schema."""
    tokens = subject.split(".")
    if len(tokens) < 4 or tokens[:2] != ["rp", "evt"]:
        raise ValueError(f"not an event subject: {subject!r}")
    version = 1
    if len(tokens) > 4 and re.fullmatch(r"v\d+", tokens[-1]):
        version, tokens = int(tokens[-1][1:]), tokens[:-1]
    return tokens[2], ".".join(tokens[3:]), version


def parse_dead_letter(subject: str) -> tuple[str, str] | None:
    """(service, consumer) of `rp.dlq.<service>.<consumer>`, or None for any other subject."""
    tokens = subject.split(".")
    if len(tokens) != 4 or tokens[:2] != ["rp", "dlq"]:
        return None
    return tokens[2], tokens[3]


def sled_of_durable(durable: str) -> str | None:
    """The sled whose durable this is (`sled-agent-<sled>`), or None."""
    sled = durable.removeprefix(SLED_DURABLE_PREFIX)
    return sled if sled != durable and sled else None


def matches(subject: str, pattern: str) -> bool:
    """Whether `subject` falls under `pattern` (`*` one token, `>` one or more), as the broker decides."""
    s, p = subject.split("."), pattern.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(s) == len(p)


def sled_verb(schema: str) -> str:
    """What follows `cmd.` in a sled command's subject, from its schema: `vmm.stop` for `rp.sled.vmm.stop`."""
    return schema.removeprefix("rp.sled.")


def schema_parts(schema: str, kind: str) -> tuple[str, str]:
    """(resource, verb) of a command's schema (`kind` "cmd": `rp.cmd.<resource>.<verb>`), or (resource,
    what) of an event's (`kind` "evt": `rp.evt.<resource>.<what>`)."""
    prefix = f"rp.{kind}."
    if not schema.startswith(prefix) or schema.count(".") != 3:
        raise ValueError(f"not an rp.{kind} schema: {schema!r}")
    resource, verb = schema.removeprefix(prefix).split(".")
    return resource, verb


def service_control(service: str, what: str) -> str:
    """A service's own requests (request/reply): `rp.svc.<service>.<what>`."""
    return f"rp.svc.{service}.{what}"


def stats(service: str) -> str:
    """A service's counters (request/reply): `rp.svc.<service>.stats`."""
    return service_control(service, "stats")


SERVICES = ("sled-agent", "instance-manager", "accounting", "recovery")
"""Every service, by the name it calls itself (the `<service>` token of `rp.svc` and `rp.dlq` subjects)."""


def faults(service: str) -> str:
    """A service's fault injection (request/reply): `rp.svc.<service>.faults`. Testing only."""
    return service_control(service, "faults")


def inbox_prefix(identity: str) -> str:
    """An identity's private reply inbox (`nats.connect(inbox_prefix=...)`): its permissions let it, and
    no one else, read the replies sent there (deploy/identities.py)."""
    return f"_INBOX_{identity}"


def inbox_identity(head: str) -> str | None:
    """The identity whose private inbox this is (the first token of a reply subject, `_INBOX_<identity>`),
    or None for any other (nats-py's default, `_INBOX`, names no one)."""
    prefix = inbox_prefix("")
    return head.removeprefix(prefix) if head.startswith(prefix) else None


def is_service_control(subject: str) -> bool:
    """Whether `subject` is a service's own request (`rp.svc.<service>.<what>`: stats, faults)."""
    return subject.startswith("rp.svc.")


# --- templates: a subject with its variable tokens named, for span names and low-cardinality attributes --

_SHAPES: tuple[str, ...] = (
    command("{silo}", "*", "*"),
    sled_command("{sled}", ">"),
    sled_report("{sled}", ">"),
    provision_delta("{silo}", "{project}", "{instance}"),
    delta_partition("{partition}").removesuffix(">")
    + provision_delta("{silo}", "{project}", "{instance}").removeprefix("rp.acct.delta."),
    event_pattern("{silo}"),
)
"""The shapes of subjects whose tokens name a silo, a sled, a project, an instance or a partition, made
by the functions above: `{name}` is a variable token, `*` a token kept as it is, `>` the rest kept."""


def template(subject: str) -> str:
    """`subject` with its variable tokens named, e.g. `rp.sled.{sled}.cmd.vmm.ensure` for
    `rp.sled.sled-3.cmd.vmm.ensure`; a subject of no such shape (stats, dead letters, the simulator's)
    has none, and is its own template."""
    tokens = subject.split(".")
    for shape in _SHAPES:
        parts = shape.split(".")
        if parts[-1] == ">" and len(tokens) >= len(parts):
            parts = parts[:-1] + ["*"] * (len(tokens) - len(parts) + 1)
        if len(parts) != len(tokens):
            continue
        if all(want[0] == "{" or want in ("*", got) for want, got in zip(parts, tokens, strict=True)):
            return ".".join(want if want[0] == "{" else got for want, got in zip(parts, tokens, strict=True))
    return subject
