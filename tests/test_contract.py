"""The contract as data (docs/schemas/, docs/asyncapi.yaml) stays true to the code, and old messages stay
readable: every committed example is replayed against today's readers. The AsyncAPI document describes
the whole conversation: every request's reply and its error shape, the dead letters and the headers their
filer really writes, the security scheme, and the schema format of every payload (issue 30);
tests/test_asyncapi_parser.py has the official parser read it."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from deploy import schemas
from deploy.stack import Stack
from rackctl.client import Client
from services.instance_manager.views import instance_events
from shared import contract
from shared.messages import (
    BadMessage,
    Envelope,
    InstanceChangedV2,
    InstanceView,
    ProvisionOutcome,
    decode,
    decode_one,
    registry,
    schema_of,
)
from shared.topology import subjects
from tests.conftest import JetStreamAs
from tests.test_bad_input import raw_envelope
from tests.test_cli import assert_ok, rackctl
from tests.test_dlq import _bad_delta

ROOT = Path(__file__).resolve().parent.parent
OWN = {"reply", "dead-letter"}
"""The document's messages that are no registered schema: the answer to every request, and a dead letter."""


def _doc() -> dict[str, Any]:
    return yaml.safe_load(schemas.ASYNCAPI.read_text())


def test_the_committed_schemas_and_asyncapi_document_match_the_code() -> None:
    assert schemas.drift() == [], "run `make schemas` and commit what it writes"


def test_every_schema_and_version_has_a_kept_example() -> None:
    missing = [
        f"{s} v{v}" for s, v in registry() if not (schemas.EXAMPLES / contract.schema_file(s, v)).exists()
    ]
    assert not missing, f"run `make schemas` to write their examples: {missing}"


@pytest.mark.parametrize("path", sorted(schemas.EXAMPLES.glob("*.json")), ids=lambda p: p.stem)
def test_every_kept_example_is_read_by_todays_readers(path: Path) -> None:
    env, body = decode(path.read_bytes())
    assert (env.schema_, env.version) == tuple(json.loads(path.read_text())[k] for k in ("schema", "version"))
    one_env, one_body = decode_one(path.read_bytes(), type(body))  # a stream consumer's one-pass read
    assert one_body == body and isinstance(one_env, Envelope)
    assert one_env.model_dump(exclude={"data"}) == env.model_dump(exclude={"data"})


def test_a_one_pass_read_refuses_what_the_general_read_refuses_and_says_the_same() -> None:
    """A consumer of one model reads envelope and body in one pass (`decode_one`); whatever that pass
    refuses is read the general way, so a dead letter's reason is the same either way."""
    outcome = json.loads((schemas.EXAMPLES / "rp.evt.provision.outcome.v1.json").read_text())
    start = json.loads((schemas.EXAMPLES / "rp.cmd.instance.start.v1.json").read_text())
    bad = [
        b"not json",
        json.dumps({**outcome, "version": 7}).encode(),
        json.dumps({**outcome, "schema": "rp.evt.nothing"}).encode(),
        json.dumps({**outcome, "data": {**outcome["data"], "generation": "2"}}).encode(),
        json.dumps({**outcome, "data": {**outcome["data"], "reason": "a\u0000b"}}).encode(),
        json.dumps({**outcome, "source": ""}).encode(),
        json.dumps(start).encode(),  # another schema than the one read
    ]
    for raw in bad:
        with pytest.raises(BadMessage) as general:
            decode(raw, ProvisionOutcome)
        with pytest.raises(BadMessage) as one:
            decode_one(raw, ProvisionOutcome)
        assert (one.value.code, one.value.reason) == (general.value.code, general.value.reason), raw
    tolerated = {**outcome, "data": {**outcome["data"], "added_later": 1}}  # events read tolerantly
    assert (
        decode_one(json.dumps(tolerated).encode(), ProvisionOutcome)[1]
        == decode(json.dumps(tolerated).encode(), ProvisionOutcome)[1]
    )


def test_the_asyncapi_document_names_a_channel_for_every_schema() -> None:
    doc = _doc()
    assert doc["asyncapi"] == "3.0.0"
    listed = {m for ch in doc["channels"].values() for m in ch["messages"]}
    assert listed == {f"{s}.v{v}" for s, v in registry()} | OWN
    for ch in doc["channels"].values():
        for param in [t[1:-1] for t in (ch["address"] or "").split(".") if t.startswith("{")]:
            assert param in ch["parameters"], ch


def test_every_request_reply_operation_has_a_reply_on_the_requesters_inbox() -> None:
    """Both halves of every request/reply: the sender's and the receiver's operation name the reply, on a
    channel whose address is the request's reply subject (null: known only when the request is made), and
    its message is the one `reply` every server sends."""
    doc = _doc()
    requests = {contract._name(ch.address) for ch in contract.channels() if ch.kind == "request"}
    assert len(requests) >= 26
    inbox = doc["channels"][contract.REPLY_CHANNEL]
    assert inbox["address"] is None and "_INBOX_<identity>" in inbox["description"]
    assert set(inbox["messages"]) == {"reply"}
    for name, op in doc["operations"].items():
        channel = op["channel"]["$ref"].removeprefix("#/channels/")
        if channel not in requests:
            assert "reply" not in op, name  # a stream's messages are answered by no one
            continue
        assert op["reply"] == {"$ref": "#/components/replies/reply"}, name
    with_reply = {
        op["channel"]["$ref"].removeprefix("#/channels/")
        for op in doc["operations"].values()
        if "reply" in op
    }
    assert with_reply == requests
    assert doc["components"]["replies"]["reply"] == {
        "channel": {"$ref": f"#/channels/{contract.REPLY_CHANNEL}"},
        "messages": [{"$ref": f"#/channels/{contract.REPLY_CHANNEL}/messages/reply"}],
    }
    reply = doc["components"]["messages"]["reply"]
    assert reply["payload"] == {
        "schemaFormat": contract.SCHEMA_FORMAT,
        "schema": {"$ref": "schemas/reply.json"},
    }


def test_the_reply_schema_is_the_reply_model_and_states_the_error_shape() -> None:
    schema = json.loads((schemas.SCHEMAS / contract.REPLY_FILE).read_text())
    assert schema == contract.reply_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["required"] == ["ok"] and set(schema["properties"]) == {"ok", "data", "error"}
    error = schema["$defs"]["ReplyError"]
    assert error["required"] == ["code", "message"] and error["type"] == "object"
    validator = jsonschema.Draft202012Validator(schema)
    for example in schema["examples"]:
        validator.validate(example)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"ok": False, "error": {"code": "not_found"}})  # an error says why, in words


async def test_every_answer_a_service_sends_is_valid_against_the_reply_schema(client: Client) -> None:
    """Real answers, raw off the wire: one carried out, one refused, one to a message that is no envelope."""
    validator = jsonschema.Draft202012Validator(
        json.loads((schemas.SCHEMAS / contract.REPLY_FILE).read_text()),
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    )
    nosuch = f"nosuch-{uuid.uuid4().hex[:8]}"
    asked = {
        "ok": (subjects.command(None, "silo", "list"), raw_envelope("rp.cmd.silo.list", 1, {})),
        "not_found": (
            subjects.command(nosuch, "silo", "show"),
            raw_envelope("rp.cmd.silo.show", 1, {"silo": nosuch}),
        ),
        "malformed": (subjects.command(None, "silo", "list"), b"{not json"),
    }
    for expect, (subject, payload) in asked.items():
        answer = json.loads((await client.nc.request(subject, payload, timeout=5)).data)
        validator.validate(answer)
        assert answer["ok"] if expect == "ok" else answer["error"]["code"] == expect, answer


def test_every_payload_says_it_is_json_schema_2020_12() -> None:
    doc = _doc()
    for name, message in doc["components"]["messages"].items():
        if name == "dead-letter":
            continue  # its body is whatever was stored: no schema
        payload = message["payload"]
        assert payload["schemaFormat"] == contract.SCHEMA_FORMAT, name
        file = schemas.ASYNCAPI.parent / payload["schema"]["$ref"]
        assert json.loads(file.read_text())["$schema"] == "https://json-schema.org/draft/2020-12/schema", name


def test_the_dead_letter_channel_names_every_header_the_filer_writes() -> None:
    doc = _doc()
    [channel] = [ch for ch in doc["channels"].values() if (ch["address"] or "").startswith("rp.dlq.")]
    assert channel["address"] == subjects.dead_letter("{service}", "{consumer}")
    assert subjects.DLQ_STREAM in channel["description"]
    assert set(channel["parameters"]) == {"service", "consumer"}
    headers = doc["components"]["messages"]["dead-letter"]["headers"]
    written = set(
        re.findall(r"\"(Rp-Dlq-[A-Za-z]+)\"", (ROOT / "shared" / "bus" / "deadletter.py").read_text())
    )
    assert len(written) >= 6, "the pattern still matches the filer's headers"
    assert set(headers["properties"]) == written | {"Nats-Msg-Id"}
    assert set(headers["required"]) == set(headers["properties"]) - {"Rp-Dlq-Truncated"}
    ops = {
        n: op for n, op in doc["operations"].items() if op["channel"]["$ref"].endswith(contract.DLQ_CHANNEL)
    }
    assert {op["action"] for op in ops.values()} == {"send", "receive"}


async def test_a_real_dead_letter_carries_the_headers_the_document_names(
    stack: Stack, jetstream_as: JetStreamAs
) -> None:
    letter, _, _ = await _bad_delta(stack, jetstream_as)
    r = await rackctl(stack, "dlq", "show", str(letter["seq"]), "--json")
    assert_ok(r)
    sent = set(r.json()["headers"])
    headers = _doc()["components"]["messages"]["dead-letter"]["headers"]
    assert set(headers["required"]) <= sent <= set(headers["properties"]), sent


def test_the_security_scheme_is_the_nkey_and_every_server_asks_for_it() -> None:
    doc = _doc()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["nkey"]["type"] == "asymmetricEncryption"
    assert "nkey" in schemes["nkey"]["description"] and "_INBOX_<identity>" in schemes["nkey"]["description"]
    servers = doc["servers"]
    assert {s["protocol"] for s in servers.values()} == {"nats"}
    assert "TLS=1" in servers["local-tls"]["description"]
    for server in servers.values():
        assert server["security"] == [{"$ref": "#/components/securitySchemes/nkey"}]


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
    assert address("rp.cmd.silo.delete") == subjects.command(None, "silo", "delete")  # its body names no silo
    assert address("rp.sled.vmm.ensure") == subjects.sled_command("sled-7", "vmm.ensure")
    assert address("rp.sled.inventory") == subjects.sled_report("sled-7", "inventory")
    assert address("rp.acct.delta") == subjects.provision_delta("acme", "web", "{instance}")
    assert address("rp.evt.instance.changed") == subjects.event("acme", "instance", "changed")
    assert address("rp.evt.sled.changed") == subjects.event(None, "sled", "changed")
    assert address("rp.svc.stats") == subjects.stats("accounting")
    assert address("rp.evt.instance.changed", 2) == subjects.event("acme", "instance", "changed", version=2)
    assert address("rp.evt.instance.changed", 2) == "rp.evt.acme.instance.changed.v2"


def _view(**changes: object) -> InstanceView:
    example = json.loads((schemas.EXAMPLES / "rp.evt.instance.changed.v1.json").read_text())
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
    kept = schemas.EXAMPLES / "rp.evt.instance.changed.v2.json"
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
    doc = yaml.safe_load(schemas.ASYNCAPI.read_text())
    chans = {ch["address"]: set(ch["messages"]) for ch in doc["channels"].values()}
    assert chans["rp.evt.{silo}.instance.changed"] == {"rp.evt.instance.changed.v1"}
    assert chans["rp.evt.{silo}.instance.changed.v2"] == {"rp.evt.instance.changed.v2"}
    ops = doc["operations"]
    for name in ("rp-evt-silo-instance-changed", "rp-evt-silo-instance-changed-v2"):
        assert ops[f"{name}.send"]["x-rackplane-senders"] == ["instance-manager"]
        assert ops[f"{name}.receive"]["x-rackplane-receivers"] == ["recovery"]


def test_events_are_read_tolerantly_and_commands_strictly() -> None:
    event = json.loads((schemas.EXAMPLES / "rp.evt.provision.outcome.v1.json").read_text())
    event["data"]["added_later"] = "an optional field a newer producer sends"
    decode(json.dumps(event).encode())
    command = json.loads((schemas.EXAMPLES / "rp.cmd.instance.start.v1.json").read_text())
    command["data"]["added_later"] = 1
    with pytest.raises(BadMessage, match="added_later"):
        decode(json.dumps(command).encode())
