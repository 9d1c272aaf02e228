"""docs/subjects.md stays true to the code: every stream, subject pattern and schema is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared import subjects
from shared.messages import registry

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


def test_every_error_code_is_documented(doc: str) -> None:
    """Codes raised anywhere in the code (BadMessage, CommandError and its subclasses) are in the doc."""
    code = _code()
    raised = set(re.findall(r"(?:BadMessage|CommandError)\(\s*\"([a-z_]+)\"", code))
    raised |= set(re.findall(r"super\(\).__init__\(\"([a-z_]+)\"", code))
    assert {"malformed", "forbidden", "not_found", "conflict"} <= raised  # the patterns still match
    missing = sorted(c for c in raised if f"`{c}`" not in doc)
    assert not missing, f"error codes missing from {DOC.name}: {missing}"


def test_dead_letter_headers_are_documented(doc: str) -> None:
    headers = set(re.findall(r"\"(Rp-Dlq-[A-Za-z]+)\"", (ROOT / "shared" / "bus.py").read_text()))
    assert headers, "no Rp-Dlq-* header found in shared/bus.py"
    missing = sorted(h for h in headers if f"`{h}`" not in doc)
    assert not missing, f"dead-letter headers missing from {DOC.name}: {missing}"


def test_documented_shapes_match_the_builders(doc: str) -> None:
    """The subject shapes the doc gives are the ones shared/subjects.py builds."""
    assert subjects.command(None, "silo", "list") == "rp.cmd._fleet.silo.list"
    assert subjects.command("acme", "instance", "start") == "rp.cmd.acme.instance.start"
    assert subjects.command_pattern("instance") == "rp.cmd.*.instance.*"
    assert subjects.sled_command("sled-0", "vmm.ensure") == "rp.sled.sled-0.cmd.vmm.ensure"
    assert subjects.sled_report("sled-0", "vmm") == "rp.sled.sled-0.report.vmm"
    assert subjects.provision_delta("acme", "web") == "rp.acct.delta.acme.web"
    assert subjects.event(None, "sled", "changed") == "rp.evt._fleet.sled.changed"
    assert subjects.dead_letter("accounting", "accounting-deltas") == "rp.dlq.accounting.accounting-deltas"
    assert subjects.stats("recovery") == "rp.svc.recovery.stats"
    assert subjects.sim_control("faults.set") == "rp.sim.faults.set"
    for shape in (
        "rp.cmd.<silo|_fleet>.<resource>.<verb>",
        "rp.sled.<sled>.cmd.<verb>",
        "rp.sled.<sled>.report.vmm|inventory",
        "rp.acct.delta.<silo>.<project>",
        "rp.evt.<silo|_fleet>.<resource>.<what>",
        "rp.dlq.<service>.<consumer>",
        "rp.svc.<service>.stats",
        "rp.sim.<verb>",
    ):
        assert shape in doc, f"subject shape {shape} is not in {DOC.name}"
