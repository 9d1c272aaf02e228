"""The subject scheme, in one place. docs/subjects.md explains it; tests/test_subjects.py keeps both true.

Subjects are shaped so that broker permissions can confine a client by prefix:
a sled agent to `rp.sled.<its id>.>`, a silo operator to `rp.cmd.<silo>.>` and `rp.evt.<silo>.>`.
"""

from __future__ import annotations

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
    tokens = stored.split(".")
    if tokens[:3] == ["rp", "acct", "part"] and len(tokens) == 7:
        return provision_delta(*tokens[4:])
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


def stats(service: str) -> str:
    """A service's counters (request/reply): `rp.svc.<service>.stats`."""
    return f"rp.svc.{service}.stats"


SERVICES = ("sled-agent", "instance-manager", "accounting", "recovery")
"""Every service, by the name it calls itself (the `<service>` token of `rp.svc` and `rp.dlq` subjects)."""


def faults(service: str) -> str:
    """A service's fault injection (request/reply): `rp.svc.<service>.faults`. Testing only."""
    return f"rp.svc.{service}.faults"


def inbox_prefix(identity: str) -> str:
    """An identity's private reply inbox (`nats.connect(inbox_prefix=...)`): its permissions let it, and
    no one else, read the replies sent there (deploy/identities.py)."""
    return f"_INBOX_{identity}"


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
