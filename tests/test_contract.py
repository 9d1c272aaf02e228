"""The contract as data (docs/schemas/, docs/asyncapi.yaml) stays true to the code, and old messages stay
readable: every committed example is replayed against today's readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.instance_manager.app import instance_events
from shared import contract, subjects
from shared.messages import BadMessage, InstanceChangedV2, InstanceView, decode, registry, schema_of


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
    by_schema = {(s, v): ch for ch in contract.channels() for s in ch.schemas for v in ch.versions}
    fill = {"silo": "acme", "sled": "sled-7", "project": "web", "service": "accounting"}

    def address(schema: str, version: int = 1) -> str:
        a = by_schema[schema, version].address
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
    assert address("rp.evt.instance.changed", 2) == subjects.event("acme", "instance", "changed", version=2)
    assert address("rp.evt.instance.changed", 2) == "rp.evt.acme.instance.changed.v2"


def _view(**changes: object) -> InstanceView:
    example = json.loads((contract.EXAMPLES / "rp.evt.instance.changed.v1.json").read_text())
    return InstanceView.model_validate({**example["data"]["instance"], "silo": "acme", **changes})


def test_instance_manager_sends_v2_on_its_subject_and_v1_beside_it_in_the_window() -> None:
    """The one function that makes an instance's events: v2 on `rp.evt.<silo>.instance.changed.v2` with
    the id `instance:<id>:<generation>:v2`, and v1 as before while RACKPLANE_EVENT_V1 is on."""
    v = _view(sled_id="sled-1", vmm_boot_number=3)
    sent = {subject: (body, key) for subject, body, key in instance_events(v, v1=True)}
    assert set(sent) == {"rp.evt.acme.instance.changed", "rp.evt.acme.instance.changed.v2"}
    v2, v2_key = sent["rp.evt.acme.instance.changed.v2"]
    assert schema_of(v2) == ("rp.evt.instance.changed", 2) and v2_key == f"instance:{v.id}:{v.generation}:v2"
    v1, v1_key = sent["rp.evt.acme.instance.changed"]
    assert schema_of(v1) == ("rp.evt.instance.changed", 1) and v1_key == f"instance:{v.id}:{v.generation}"
    assert v1.model_dump() == v2.model_dump(), "both versions say the same"
    assert [s for s, _, _ in instance_events(v, v1=False)] == ["rp.evt.acme.instance.changed.v2"]


def test_the_v2_example_is_kept_and_read_and_v2_requires_the_boot_numbers() -> None:
    kept = contract.EXAMPLES / "rp.evt.instance.changed.v2.json"
    _, body = decode(kept.read_bytes())
    assert isinstance(body, InstanceChangedV2) and body.instance.vmm_boot_number is not None
    example = json.loads(kept.read_text())
    for field in ("vmm_boot_number", "target_vmm_boot_number"):
        missing = json.loads(kept.read_text())
        del missing["data"]["instance"][field]
        with pytest.raises(BadMessage, match=field) as e:
            decode(json.dumps(missing).encode())
        assert e.value.code == "invalid"
        v1 = {**missing, "version": 1}
        decode(json.dumps(v1).encode())  # v1 lets it out: why this is a new version
    placed_without_boot = json.loads(json.dumps(example))
    placed_without_boot["data"]["instance"].update(sled_id="sled-1", vmm_boot_number=None)
    with pytest.raises(BadMessage, match="vmm_boot_number is required with a sled_id"):
        decode(json.dumps(placed_without_boot).encode())


def test_v1_and_v2_of_the_instance_event_each_have_a_channel_in_asyncapi() -> None:
    doc = yaml.safe_load(contract.ASYNCAPI.read_text())
    chans = {ch["address"]: set(ch["messages"]) for ch in doc["channels"].values()}
    assert chans["rp.evt.{silo}.instance.changed"] == {"rp.evt.instance.changed.v1"}
    assert chans["rp.evt.{silo}.instance.changed.v2"] == {"rp.evt.instance.changed.v2"}
    ops = doc["operations"]
    for name in ("rp-evt-silo-instance-changed", "rp-evt-silo-instance-changed-v2"):
        assert ops[f"{name}.send"]["x-rackplane-senders"] == ["instance-manager"]
        assert ops[f"{name}.receive"]["x-rackplane-receivers"] == ["recovery"]


def test_events_are_read_tolerantly_and_commands_strictly() -> None:
    event = json.loads((contract.EXAMPLES / "rp.evt.provision.outcome.v1.json").read_text())
    event["data"]["added_later"] = "an optional field a newer producer sends"
    decode(json.dumps(event).encode())
    command = json.loads((contract.EXAMPLES / "rp.cmd.instance.start.v1.json").read_text())
    command["data"]["added_later"] = 1
    with pytest.raises(BadMessage, match="added_later"):
        decode(json.dumps(command).encode())
