"""The contract as data (docs/schemas/, docs/asyncapi.yaml) stays true to the code, and old messages stay
readable: every committed example is replayed against today's readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shared import contract, subjects
from shared.messages import BadMessage, decode, registry


def test_the_committed_schemas_and_asyncapi_document_match_the_code() -> None:
    assert contract.drift() == [], "run `make schemas` and commit what it writes"


def test_every_schema_and_version_has_a_kept_example() -> None:
    missing = [
        f"{s} v{v}" for s, v in registry() if not (contract.EXAMPLES / contract.schema_file(s, v)).exists()
    ]
    assert not missing, f"run `make schemas` to write their examples: {missing}"


@pytest.mark.parametrize("path", sorted(contract.EXAMPLES.glob("*.json")), ids=lambda p: p.stem)
def test_every_kept_example_is_read_by_todays_readers(path: Path) -> None:
    env, _ = decode(path.read_bytes())
    assert (env.schema_, env.version) == tuple(json.loads(path.read_text())[k] for k in ("schema", "version"))


def test_the_asyncapi_document_names_a_channel_for_every_schema() -> None:
    doc = yaml.safe_load(contract.ASYNCAPI.read_text())
    assert doc["asyncapi"] == "3.0.0"
    listed = {m for ch in doc["channels"].values() for m in ch["messages"]}
    assert listed == {f"{s}.v{v}" for s, v in registry()}
    for ch in doc["channels"].values():
        for param in [t[1:-1] for t in ch["address"].split(".") if t.startswith("{")]:
            assert param in ch["parameters"], ch


def test_channel_addresses_are_the_subjects_the_code_uses() -> None:
    by_schema = {s: ch for ch in contract.channels() for s in ch.schemas}
    fill = {"silo": "acme", "sled": "sled-7", "project": "web", "service": "accounting"}

    def address(schema: str) -> str:
        a = by_schema[schema].address
        for k, v in fill.items():
            a = a.replace(f"{{{k}}}", v)
        return a

    assert address("rp.cmd.instance.start") == subjects.command("acme", "instance", "start")
    assert address("rp.cmd.vmm.lost") == subjects.command(None, "vmm", "lost")
    assert address("rp.sled.vmm.ensure") == subjects.sled_command("sled-7", "vmm.ensure")
    assert address("rp.sled.inventory") == subjects.sled_report("sled-7", "inventory")
    assert address("rp.acct.delta") == subjects.provision_delta("acme", "web", "{instance}")
    assert address("rp.evt.instance.changed") == subjects.event("acme", "instance", "changed")
    assert address("rp.evt.sled.changed") == subjects.event(None, "sled", "changed")
    assert address("rp.svc.stats") == subjects.stats("accounting")


def test_events_are_read_tolerantly_and_commands_strictly() -> None:
    event = json.loads((contract.EXAMPLES / "rp.evt.provision.outcome.v1.json").read_text())
    event["data"]["added_later"] = "an optional field a newer producer sends"
    decode(json.dumps(event).encode())
    command = json.loads((contract.EXAMPLES / "rp.cmd.instance.start.v1.json").read_text())
    command["data"]["added_later"] = 1
    with pytest.raises(BadMessage, match="added_later"):
        decode(json.dumps(command).encode())
