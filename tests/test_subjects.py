"""docs/subjects.md stays true to the code: every stream, subject pattern, schema, schema field and durable
consumer is documented."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from shared import topology
from shared.messages import registry
from shared.topology import subjects

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "subjects.md"
CODE_DIRS = ("shared", "services", "rackctl")


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def _code() -> str:
    return "\n".join(p.read_text() for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")))


@pytest.mark.parametrize("stream", sorted(subjects.STREAMS))
def test_every_stream_and_its_subjects_are_documented(doc: str, stream: str) -> None:
    assert f"`{stream}`" in doc, f"stream {stream} is not in {DOC.name}"
    for pattern in subjects.STREAMS[stream]:
        assert f"`{pattern}`" in doc, f"subject pattern {pattern} of stream {stream} is not in {DOC.name}"


def test_every_schema_is_documented(doc: str) -> None:
    missing = sorted(f"{name} v{version}" for name, version in registry() if f"`{name}`" not in doc)
    assert not missing, f"schemas missing from {DOC.name}: {missing}"


def _fields(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[str]:
    """The field names of a model and of every model nested in it (lists and optionals included)."""
    if model in seen:
        return set()
    seen.add(model)
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or name)
        stack: list[typing.Any] = [info.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                names |= _fields(t, seen)
            stack.extend(typing.get_args(t))
    return names


def test_every_schema_field_is_documented(doc: str) -> None:
    missing = sorted(
        f"{name}.{field}"
        for (name, _), model in registry().items()
        for field in _fields(model, set())
        if f"`{field}`" not in doc
    )
    assert not missing, f"schema fields missing from {DOC.name}: {missing}"


def test_every_command_subject_is_documented(doc: str) -> None:
    """Each `rp.cmd.<resource>.<verb>` schema has its subject `rp.cmd.<silo>.<resource>.<verb>` documented."""
    commands = sorted(name for name, _ in registry() if name.startswith("rp.cmd."))
    assert commands
    missing = [
        name
        for name in commands
        if not re.search(r"`rp\.cmd\.[^.`]+\." + re.escape(name.removeprefix("rp.cmd.")) + "`", doc)
    ]
    assert not missing, f"command subjects missing from {DOC.name}: {missing}"


def test_every_durable_consumer_is_documented(doc: str) -> None:
    """Every durable of the topology (a `{...}` stands for a documented `<token>`; the partitions' durables
    are a range, documented by its first and its last)."""
    durables = {d.name for d in topology.DURABLES if d not in topology.ACCOUNTING_DELTAS[1:-1]}
    assert "recovery-sleds" in durables  # still as named
    durables.add(subjects.sled_durable("{sled}"))
    missing = []
    for d in sorted(durables):
        pattern = re.sub(r"\\\{[^}]*\\\}", "<[a-z_]+>", re.escape(d))
        if not re.search(f"`{pattern}`", doc):
            missing.append(d)
    assert not missing, f"durable consumers missing from {DOC.name}: {missing}"


def test_every_error_code_is_documented(doc: str) -> None:
    """Codes raised anywhere in the code (BadMessage, CommandError and its subclasses) are in the doc."""
    code = _code()
    raised = set(re.findall(r"(?:BadMessage|CommandError)\(\s*\"([a-z_]+)\"", code))
    raised |= set(re.findall(r"super\(\).__init__\(\"([a-z_]+)\"", code))
    assert {"malformed", "forbidden", "not_found", "conflict"} <= raised  # the patterns still match
    missing = sorted(c for c in raised if f"`{c}`" not in doc)
    assert not missing, f"error codes missing from {DOC.name}: {missing}"


def test_dead_letter_headers_are_documented(doc: str) -> None:
    headers = set(
        re.findall(r"\"(Rp-Dlq-[A-Za-z]+)\"", (ROOT / "shared" / "bus" / "deadletter.py").read_text())
    )
    assert headers, "no Rp-Dlq-* header found in shared/bus/deadletter.py"
    missing = sorted(h for h in headers if f"`{h}`" not in doc)
    assert not missing, f"dead-letter headers missing from {DOC.name}: {missing}"


def test_documented_shapes_match_the_builders(doc: str) -> None:
    """The subject shapes the doc gives are the ones shared/topology/subjects.py builds."""
    assert subjects.command(None, "silo", "list") == "rp.cmd._fleet.silo.list"
    assert subjects.command("acme", "instance", "start") == "rp.cmd.acme.instance.start"
    assert subjects.command_pattern("instance") == "rp.cmd.*.instance.*"
    assert subjects.sled_command("sled-0", "vmm.ensure") == "rp.sled.sled-0.cmd.vmm.ensure"
    assert subjects.sled_report("sled-0", "vmm") == "rp.sled.sled-0.report.vmm"
    assert subjects.provision_delta("acme", "web", "i-1") == "rp.acct.delta.acme.web.i-1"
    assert subjects.event(None, "sled", "changed") == "rp.evt._fleet.sled.changed"
    assert subjects.dead_letter("accounting", "accounting-deltas") == "rp.dlq.accounting.accounting-deltas"
    assert subjects.stats("recovery") == "rp.svc.recovery.stats"
    assert subjects.sim_control("faults.set") == "rp.sim.faults.set"
    for shape in (
        "rp.cmd.<silo|_fleet>.<resource>.<verb>",
        "rp.sled.<sled>.cmd.<verb>",
        "rp.sled.<sled>.report.vmm|inventory",
        "rp.acct.delta.<silo>.<project>.<instance>",
        "rp.evt.<silo|_fleet>.<resource>.<what>",
        "rp.dlq.<service>.<consumer>",
        "rp.svc.<service>.stats",
        "rp.sim.<verb>",
    ):
        assert shape in doc, f"subject shape {shape} is not in {DOC.name}"


@pytest.mark.parametrize(
    ("subject", "template"),
    [
        (subjects.command("acme", "instance", "start"), subjects.command("{silo}", "instance", "start")),
        (subjects.command(None, "vmm", "lost"), subjects.command("{silo}", "vmm", "lost")),
        (subjects.sled_command("sled-3", "vmm.ensure"), subjects.sled_command("{sled}", "vmm.ensure")),
        (subjects.sled_report("sled-3", "inventory"), subjects.sled_report("{sled}", "inventory")),
        (
            subjects.provision_delta("acme", "web", "i-1"),
            subjects.provision_delta("{silo}", "{project}", "{instance}"),
        ),
        ("rp.acct.part.2.acme.web.i-1", "rp.acct.part.{partition}.{silo}.{project}.{instance}"),
        (subjects.event("acme", "instance", "changed"), subjects.event("{silo}", "instance", "changed")),
        (subjects.event(None, "sled", "changed"), subjects.event("{silo}", "sled", "changed")),
        (subjects.event("acme", "instance", "changed", 2), "rp.evt.{silo}.instance.changed.v2"),
        (subjects.stats("accounting"), subjects.stats("accounting")),
        (subjects.dead_letter("accounting", "x"), subjects.dead_letter("accounting", "x")),
        (subjects.sim_control("sled.reboot"), subjects.sim_control("sled.reboot")),
    ],
)
def test_a_subject_template_names_its_variable_tokens(subject: str, template: str) -> None:
    """Span names and metric attributes use the template: the shape the subject functions make, with the
    silo, sled, project, instance and partition named instead of given."""
    assert subjects.template(subject) == template
