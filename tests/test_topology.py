"""The topology (shared/topology/) is the one place where streams, subjects and durables are spelled, and it
is consistent: every durable is granted to its owner alone, read by its owner, and filters on a subject of
its stream."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import identities
from shared import topology
from shared.messages import registry
from shared.topology import routes, subjects

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("services", "shared", "rackctl", "deploy")
TOPOLOGY = ROOT / "shared" / "topology"
SUBJECT_PREFIXES = ("rp.", "$JS.", "_INBOX", "subscribers.deliver")
"""How a subject literal begins: rackplane's, the JetStream API's, an inbox, the subscribers' deliveries."""
API_PIECE = re.compile(r"\$JS\b|(^|\.)(CONSUMER|STREAM|ACK|FC)\.")
"""A JetStream API subject's tokens anywhere in a literal, as an f-string that builds one spells them."""


NOT_TOPOLOGY = {
    ("rackctl/commands/subscriber.py", "EVENTS"): "a column header: the events a subscriber's stream holds",
}
"""Literals that read like a name of the topology's but say something else, each with why."""


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes (prose, which may name a durable or a subject to explain it)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string literal of a module (the literal parts of f-strings too), docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    prose = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node.lineno, node.value


def spelled(text: str) -> str | None:
    """What the literal spells that only the topology may: a durable's name, a stream's, a subject."""
    durables = {d.name for d in topology.DURABLES}
    schemas = {schema for schema, _ in registry()}
    if text in durables or text.startswith((subjects.SLED_DURABLE_PREFIX, subjects.DELTA_DEAD_LETTERS)):
        return "a durable's name"
    if text in subjects.STREAMS or text.startswith(subjects.subscriber_stream("")):
        return "a stream's name"
    if text.startswith(SUBJECT_PREFIXES) and text not in schemas:
        return "a subject"
    if API_PIECE.search(text):  # a piece of an f-string that builds one: f"{prefix}.CONSUMER.MSG.NEXT.{s}"
        return "a piece of a JetStream API subject"
    return None


def literals() -> list[str]:
    out = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(TOPOLOGY):
                continue
            where = str(path.relative_to(ROOT))
            for line, text in _strings(path):
                if (what := spelled(text)) is not None and (where, text) not in NOT_TOPOLOGY:
                    out.append(f"{where}:{line}: {text!r} spells {what}")
    return out


def test_no_durable_stream_or_subject_is_spelled_outside_the_topology() -> None:
    found = literals()
    assert not found, "spell these through shared/topology/ instead:\n" + "\n".join(found)


def test_the_grep_sees_what_it_looks_for() -> None:
    """The search would find each kind of literal (a test that finds nothing must be able to)."""
    assert spelled("recovery-sleds") == "a durable's name"
    assert spelled("sled-agent-") == "a durable's name"
    assert spelled("EVENTS") == "a stream's name"
    assert spelled("rp.cmd.*.vmm.>") == "a subject"
    assert spelled("$JS.API.CONSUMER.CREATE.") == "a subject"
    assert spelled("rp.cmd.silo.create") is None  # a schema's name: the message's kind, not its subject
    assert spelled("recovery") is None


def _within_stream(filter_subject: str, stream: str) -> bool:
    """Whether a subject the filter takes (its wildcards filled in) is one the stream stores."""
    stored = list(subjects.STREAMS[stream])
    if (transform := subjects.TRANSFORMS.get(stream)) is not None:
        stored.append(re.sub(r"\{\{[^}]*\}\}", "*", transform[1]))
    example = filter_subject.replace("*", "x").replace(">", "x.x.x")
    return any(subjects.matches(example, p) for p in stored)


@pytest.mark.parametrize("d", [*topology.DURABLES, topology.sled("sled-7")], ids=lambda d: d.name)
def test_each_durable_filters_within_its_stream_and_is_granted_to_its_owner_alone(
    d: topology.Durable,
) -> None:
    assert _within_stream(d.filter_subject, d.stream), d
    create = topology.jsapi.consumer_create(d.stream, d.name, d.filter_subject)
    everyone = [*identities.standard(sleds=8, silos=["acme"], test=True), identities.subscriber("billing")]
    holders = [i.name for i in everyone if create in i.grants.publish]
    owner = "sled-7" if d.owner == topology.SLED_AGENT else d.owner
    assert holders == [owner], f"{d.name} is granted to {holders}, owned by {d.owner}"


def test_durable_names_are_unique_and_stream_readers_are_their_owners() -> None:
    names = [d.name for d in topology.DURABLES]
    assert len(names) == len(set(names))
    for ch in routes.channels():
        if ch.kind == "stream" and not ch.address.startswith(subjects.sled_command("{sled}", "")):
            (schema,) = ch.schemas
            assert ch.receivers == routes.readers(schema), ch.address


def test_sled_durable_reads_only_its_own_orders() -> None:
    d = topology.sled("sled-7")
    assert d.name == subjects.sled_durable("sled-7")
    assert subjects.matches(subjects.sled_command("sled-7", "vmm.ensure"), d.filter_subject)
    assert not subjects.matches(subjects.sled_command("sled-8", "vmm.ensure"), d.filter_subject)


def test_parse_helpers_read_back_what_the_builders_make() -> None:
    assert subjects.parse_sled_report(subjects.sled_report("sled-3", "inventory")) == ("sled-3", "inventory")
    assert subjects.parse_delta(subjects.provision_delta("acme", "web", "i-1")) == ("acme", "web", "i-1")
    stored = subjects.delta_partition(2).removesuffix(">") + "acme.web.i-1"
    assert subjects.parse_delta(stored) == ("acme", "web", "i-1")
    assert subjects.parse_event(subjects.event("acme", "instance", "changed", 2)) == (
        "acme",
        "instance.changed",
        2,
    )
    assert subjects.parse_event(subjects.event(None, "sled", "changed")) == (
        subjects.FLEET,
        "sled.changed",
        1,
    )
    assert subjects.parse_dead_letter(subjects.dead_letter("accounting", "x")) == ("accounting", "x")
    assert subjects.parse_dead_letter(subjects.event("acme", "silo", "created")) is None
    with pytest.raises(ValueError):
        subjects.parse_delta(subjects.event("acme", "silo", "created"))
