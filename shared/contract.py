"""The contract as data: every channel (subject), what travels on it, who sends and who receives it.

docs/subjects.md explains the contract to people; this module states it for programs. `make schemas`
(`python -m shared.contract`) writes from it, and from the pydantic models, one JSON Schema per message
schema and version (docs/schemas/), the schema of every request's reply (docs/schemas/reply.json), and an
AsyncAPI 3.0 document (docs/asyncapi.yaml), which a consumer in any language can generate code from:
both halves of every request/reply, the dead-letter channel with its headers, and the security scheme.
tests/test_contract.py fails when the committed files drift from the code, and
tests/test_asyncapi_parser.py when the official AsyncAPI parser finds an error or a warning in them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from shared import subjects
from shared.bus import DLQ_TRUNCATED, MSG_ID
from shared.messages import Envelope, Model, Reply, registry
from shared.messages.base import read_body

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "docs" / "schemas"
ASYNCAPI = ROOT / "docs" / "asyncapi.yaml"
REPLY_FILE = "reply.json"
"""The schema of every request's answer (`shared.messages.Reply`): no envelope, so no `.v<n>` in its name
(readers of docs/schemas/ pick messages' schemas by `<schema>.v<version>.json`)."""
SCHEMA_FORMAT = "application/schema+json;version=2020-12"
"""What every payload schema is written in (AsyncAPI's default would be its own, a draft-07 superset)."""

OPERATORS = ("rackctl",)
Kind = Literal["request", "stream"]


@dataclass(frozen=True)
class Channel:
    address: str
    """The subject, with `{parameters}` for its variable tokens."""
    kind: Kind
    """`request`: request/reply (the receiver answers on the sender's inbox); `stream`: a JetStream stream."""
    schemas: tuple[str, ...]
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    description: str
    versions: tuple[int, ...] = (1,)
    """The schema versions that travel here. A request's channel takes every version (the envelope says
    which); an event's later version has a channel, and a subject, of its own (`subjects.event`)."""

    @property
    def parameters(self) -> list[str]:
        return [t[1:-1] for t in self.address.split(".") if t.startswith("{")]


PARAMETERS = {
    "silo": f"a silo's name, or `{subjects.FLEET}` for fleet-wide commands and events",
    "sled": "a sled's id",
    "project": "a project's name within the silo",
    "instance": "an instance's id (it decides the partition the delta is kept in)",
    "service": "a service's name: " + ", ".join(subjects.SERVICES),
    "consumer": (
        "the durable consumer that gave up, or the one name the durables of a partitioned stream file under "
        "(`accounting-deltas`)"
    ),
}

DLQ_HEADERS: dict[str, tuple[str, bool]] = {
    MSG_ID: ("`dlq:<uuid>`, new for every filing (no one can file a letter first under its id)", True),
    "Rp-Dlq-Reason": ("why, at most 1000 characters: `<code>: <reason>`, a refusal, or a failure", True),
    "Rp-Dlq-Subject": ("the subject the message was stored under", True),
    "Rp-Dlq-Stream": ("the stream it was stored in", True),
    "Rp-Dlq-Sequence": ("its sequence in that stream", True),
    "Rp-Dlq-Consumer": ("the durable consumer that gave up on it", True),
    DLQ_TRUNCATED: (
        "only when the body did not fit beside these headers: the whole body's size in bytes (the letter "
        "keeps its beginning: it can be read, not replayed)",
        False,
    ),
}
"""The headers `bus.Consumer._dead_letter` writes on a letter, with whether every letter has it
(tests/test_contract.py checks them against the code and against a real letter)."""

SECURITY = {
    "nkey": {
        "type": "asymmetricEncryption",
        "description": (
            "Every sled, service, operator and subscriber is a NATS user of its own, authenticated by an "
            "nkey: an Ed25519 key pair whose public key the broker knows; the client signs the nonce the "
            "server sends with its seed (the private key, which never leaves it). The broker then allows it "
            "only its own subjects (docs/security.md); it reads replies only on its own inbox, "
            "`_INBOX_<identity>.>` (nats.py `inbox_prefix`, nats.js `inboxPrefix`). A rackctl context "
            "(`.rackplane/contexts/<name>.json`) names the seed file, the URL and the CA."
        ),
    },
}
"""How a client proves who it is. NATS's nkeys are a signature with a private key, not a password, a
certificate or a token: AsyncAPI's `asymmetricEncryption` is the scheme that says so."""

EVENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rp.evt.silo.created": (("instance-manager",), ("accounting",)),
    "rp.evt.project.created": (("instance-manager",), ("accounting",)),
    "rp.evt.instance.changed": (("instance-manager",), ("recovery",)),
    "rp.evt.provision.outcome": (("accounting",), ("instance-manager",)),
    "rp.evt.usage.changed": (("accounting",), ()),
    "rp.evt.pool.changed": (("instance-manager",), ()),
    "rp.evt.sled.changed": (("instance-manager",), ("recovery",)),
    "rp.evt.silo.deleted": (("instance-manager",), ()),
    "rp.evt.project.deleted": (("instance-manager",), ()),
}
"""Each event: who publishes it, and which of rackplane's services consume it (anyone else may follow)."""

ORDERS = (
    "rp.cmd.vmm.lost",
    "rp.cmd.vmm.stuck",
    "rp.cmd.vmm.zombie",
    "rp.cmd.instance.restart",
    "rp.cmd.instance.settle",
)
"""Recovery's orders to instance-manager (conditions: refused as stale when what they saw has moved)."""
FLEET_ONLY = (
    *ORDERS,
    "rp.cmd.silo.create",
    "rp.cmd.silo.delete",
    "rp.cmd.silo.list",
    "rp.cmd.silo.limits",
    "rp.cmd.sled.list",
    "rp.cmd.sled.expunge",
)
"""Commands whose bodies name no silo: they travel on `_fleet` only."""


def _command(schema: str) -> Channel:
    resource, verb = schema.removeprefix("rp.cmd.").split(".")
    receiver = "accounting" if resource == "usage" else "instance-manager"
    sender = ("recovery",) if schema in ORDERS else OPERATORS
    silo = subjects.FLEET if schema in FLEET_ONLY else "{silo}"
    return Channel(
        f"rp.cmd.{silo}.{resource}.{verb}",
        "request",
        (schema,),
        sender,
        (receiver,),
        f"{'recovery orders' if schema in ORDERS else 'operator command'}: {resource} {verb}",
    )


def versions() -> dict[str, tuple[int, ...]]:
    """Every registered schema, with its versions in order."""
    out: dict[str, list[int]] = {}
    for schema, version in sorted(registry()):
        out.setdefault(schema, []).append(version)
    return {s: tuple(vs) for s, vs in out.items()}


def channels() -> list[Channel]:
    """Every channel, derived from the registered schemas (so a new schema or version cannot be left out).

    A request carries its version in the envelope and is answered `unsupported_version` by a server that
    does not know it, so every version shares its subject. A stream message is read by consumers that
    filter on subjects: each version of an event has its own, so that a reader of v1 never receives v2."""
    out: list[Channel] = []
    for schema, vs in versions().items():
        ch = replace(_channel(schema), versions=vs)
        if ch.kind == "request":
            out.append(ch)
        elif schema.startswith("rp.evt."):
            out += [
                replace(ch, address=_versioned(ch.address, v), versions=(v,), description=_described(ch, v))
                for v in vs
            ]
        elif vs != (1,):
            raise ValueError(
                f"schema {schema} v{vs[-1]} needs a subject of its own: add it to shared/contract.py"
            )
        else:
            out.append(ch)
    return out


def _versioned(address: str, version: int) -> str:
    return address if version == 1 else f"{address}.v{version}"


def _described(ch: Channel, version: int) -> str:
    return ch.description if version == 1 else f"{ch.description}; version {version}"


def _channel(schema: str) -> Channel:
    """The channel of one schema, at its first version."""
    if schema.startswith("rp.cmd."):
        return _command(schema)
    if schema.startswith("rp.sled.vmm.") and schema != "rp.sled.vmm.report":
        verb = schema.removeprefix("rp.sled.")
        return Channel(
            f"rp.sled.{{sled}}.cmd.{verb}",
            "stream",
            (schema,),
            ("instance-manager",),
            ("sled-agent",),
            f"a command to one sled: {verb} (stream {subjects.SLED_CMD_STREAM})",
        )
    if schema in ("rp.sled.vmm.report", "rp.sled.inventory"):
        kind = "vmm" if schema == "rp.sled.vmm.report" else "inventory"
        readers = ("instance-manager",) if kind == "vmm" else ("instance-manager", "recovery")
        return Channel(
            f"rp.sled.{{sled}}.report.{kind}",
            "stream",
            (schema,),
            ("sled-agent",),
            readers,
            f"a sled's {kind} report (stream {subjects.SLED_REPORT_STREAM})",
        )
    if schema == "rp.acct.delta":
        return Channel(
            "rp.acct.delta.{silo}.{project}.{instance}",
            "stream",
            (schema,),
            ("instance-manager",),
            ("accounting",),
            f"a provisioning delta (stream {subjects.PROVISION_STREAM}, by partition of instance)",
        )
    if schema.startswith("rp.evt."):
        resource, what = schema.removeprefix("rp.evt.").split(".")
        silo = "_fleet" if resource == "sled" else "{silo}"
        senders, receivers = EVENTS[schema]
        return Channel(
            f"rp.evt.{silo}.{resource}.{what}",
            "stream",
            (schema,),
            senders,
            receivers,
            f"event: {resource} {what} (stream {subjects.EVENTS_STREAM}; anyone may follow it)",
        )
    if schema.startswith("rp.sim."):
        return Channel(schema, "request", (schema,), OPERATORS, ("sled-agent",), "simulator control")
    if schema.startswith("rp.svc."):
        what = schema.removeprefix("rp.svc.")
        return Channel(
            f"rp.svc.{{service}}.{what}",
            "request",
            (schema,),
            OPERATORS,
            subjects.SERVICES,
            f"a service's {what}",
        )
    raise ValueError(f"schema {schema} has no channel: add it to shared/contract.py")


# --- JSON Schema --------------------------------------------------------------------------------------


def schema_file(schema: str, version: int) -> str:
    return f"{schema}.v{version}.json"


ID_MEANING = (
    "a UUID naming this message (also its Nats-Msg-Id); a command sent again because its reply did not come "
    "keeps it, and the service answers the copy as it answered the first, applying it once"
)


def json_schema(schema: str, version: int, model: type[Model]) -> dict[str, Any]:
    """The whole message, envelope and body, as one standalone JSON Schema (draft 2020-12)."""
    body = model.model_json_schema()
    defs = body.pop("$defs", {})
    envelope = Envelope.model_json_schema(by_alias=True)
    props = dict(envelope["properties"])
    props["id"] = {**props["id"], "description": ID_MEANING}
    props["schema"] = {"const": schema, "description": "the message's schema"}
    props["version"] = {"const": version, "description": "the schema's version"}
    props["data"] = {"$ref": f"#/$defs/{model.__name__}"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:rackplane:schema:{schema}:v{version}",
        "title": f"{schema} v{version}",
        "description": (model.__doc__ or "").strip(),
        "type": "object",
        "properties": props,
        "required": envelope["required"],
        "additionalProperties": False,
        "$defs": {model.__name__: body, **defs},
        "examples": [example(schema, version, model)],
    }


EXAMPLES = SCHEMAS / "examples"
"""One example message per schema and version, written once and never rewritten: the compatibility test
replays every one of them against today's readers, so a change that breaks an old reader's messages fails
even after the schemas are written anew."""


# --- examples -----------------------------------------------------------------------------------------

EXAMPLE_UUID = "00000000-0000-4000-8000-000000000001"
EXAMPLE_TIME = "2026-12-01T00:00:00Z"
EXAMPLE_OVERRIDES: dict[tuple[str, int], dict[str, Any]] = {
    ("rp.cmd.vmm.lost", 1): {"vmm_boot": 1, "sled_boot": 2},
    ("rp.cmd.vmm.lost", 2): {"sled_boot": 2},
    ("rp.cmd.instance.create", 1): {"vcpus": 2, "ram_bytes": 2**32, "disk_bytes": 2**34},
}
"""What the generic example of a schema gets wrong (its model checks fields against each other)."""


def _value(s: dict[str, Any], defs: dict[str, Any]) -> Any:
    """A small valid value of a JSON Schema, the same every time."""
    if "$ref" in s:
        return _value(defs[s["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in s:
        options = [o for o in s["anyOf"] if o.get("type") != "null"] or s["anyOf"]
        return _value(options[0], defs)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return s["enum"][0]
    kind = s.get("type")
    if kind == "object":
        props = s.get("properties", {})
        return {k: _value(props[k], defs) for k in s.get("required", [])}
    if kind == "array":
        return [_value(s.get("items", {}), defs) for _ in range(s.get("minItems", 0))]
    if kind == "integer":
        return max(s.get("minimum", 1), s.get("exclusiveMinimum", 0) + 1)
    if kind == "number":
        return float(s.get("minimum", 1))
    if kind == "boolean":
        return False
    if kind == "string":
        if s.get("format") == "uuid":
            return EXAMPLE_UUID
        if s.get("format") == "date-time":
            return EXAMPLE_TIME
        for candidate in ("example", "a", "x" * max(1, s.get("minLength", 1))):
            if "pattern" not in s or re.fullmatch(s["pattern"], candidate):
                return candidate
    raise ValueError(f"no example for {s}")


def example(schema: str, version: int, model: type[Model]) -> dict[str, Any]:
    """One valid message of `schema` at `version`, envelope and all, checked against its model."""
    body = model.model_json_schema()
    data = {**_value(body, body.get("$defs", {})), **EXAMPLE_OVERRIDES.get((schema, version), {})}
    read_body(model, data)  # an example that today's (strict) reader refuses is a bug here
    return {
        "schema": schema,
        "version": version,
        "id": EXAMPLE_UUID,
        "source": "example",
        "time": EXAMPLE_TIME,
        "data": data,
    }


# --- AsyncAPI -----------------------------------------------------------------------------------------


def reply_schema() -> dict[str, Any]:
    """The answer to every request (`bus.serve` sends a `Reply`), as a standalone JSON Schema 2020-12."""
    body = Reply.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:rackplane:schema:reply",
        **body,
        "title": "reply",
        "examples": [
            Reply(ok=True, data={"name": "acme"}).model_dump(mode="json"),
            Reply(ok=False, error={"code": "not_found", "message": "no silo acme"}).model_dump(mode="json"),
        ],
    }


def _name(address: str) -> str:
    return address.replace("{", "").replace("}", "").replace(".", "-")


def _payload(file: str) -> dict[str, Any]:
    return {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": f"schemas/{file}"}}


REPLY_CHANNEL = "reply-inbox"
DLQ_CHANNEL = _name(subjects.dead_letter("{service}", "{consumer}"))


def _replies() -> tuple[dict[str, Any], dict[str, Any]]:
    """The channel every answer travels on, and its message. The address is the request's reply subject,
    which NATS carries beside the message (not in a header or the payload, so no runtime expression can
    name it): AsyncAPI's null address, a channel known only when the request is made."""
    channel = {
        "address": None,
        "title": "a requester's inbox",
        "description": (
            "The reply subject the request named: the requester's inbox, `_INBOX_<identity>.<...>` for a "
            "rackplane identity. Every answer is a `reply`: `ok` with the command's `data`, or an `error` "
            "with a code and a message; a request that cannot be served is answered the same way, never "
            "with silence (unless no one serves its subject: NATS then answers 'no responders')."
        ),
        "messages": {"reply": {"$ref": "#/components/messages/reply"}},
    }
    message = {
        "name": "reply",
        "title": "reply",
        "summary": (Reply.__doc__ or "").strip().split("\n")[0],
        "contentType": "application/json",
        "payload": _payload(REPLY_FILE),
    }
    return channel, message


def _dead_letters() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The DLQ channel, its message (the stored message as it was, with the filer's headers), and its
    operations."""
    address = subjects.dead_letter("{service}", "{consumer}")
    senders = subjects.SERVICES  # each service's durable consumers file their own
    channel = {
        "address": address,
        "description": (
            f"a dead letter (stream {subjects.DLQ_STREAM}): a message a durable consumer can never handle, "
            "parked with the reason; nothing consumes it but operators (`rackctl dlq`)"
        ),
        "messages": {"dead-letter": {"$ref": "#/components/messages/dead-letter"}},
        "parameters": {p: {"description": PARAMETERS[p]} for p in ("service", "consumer")},
        "bindings": {"nats": {"bindingVersion": "0.1.0"}},
    }
    message = {
        "name": "dead-letter",
        "title": "dead letter",
        "summary": "a message its consumer gave up on, byte for byte as its stream stored it",
        "description": (
            "The body is the original message as it was stored (usually an envelope, but a message that did "
            "not decode is kept as it came), cut short when `Rp-Dlq-Truncated` says so; the headers say "
            "where it was and why it was given up on. Only the DLQ subject it was filed on is the broker's "
            "word: the headers are the filer's claims (`rackctl dlq` checks them)."
        ),
        "contentType": "application/octet-stream",
        "headers": {
            "type": "object",
            "properties": {h: {"type": "string", "description": d} for h, (d, _) in DLQ_HEADERS.items()},
            "required": [h for h, (_, always) in DLQ_HEADERS.items() if always],
        },
        "payload": {"description": "the original message's bytes"},
    }
    listed = [{"$ref": f"#/channels/{DLQ_CHANNEL}/messages/dead-letter"}]
    ops = {
        f"{DLQ_CHANNEL}.send": {
            "action": "send",
            "channel": {"$ref": f"#/channels/{DLQ_CHANNEL}"},
            "messages": listed,
            "summary": f"filed by {', '.join(senders)} (each service's durable consumers)",
            "x-rackplane-senders": list(senders),
        },
        f"{DLQ_CHANNEL}.receive": {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{DLQ_CHANNEL}"},
            "messages": listed,
            "summary": "read by operators (`rackctl dlq list`, `show`, `replay`, `purge`)",
            "x-rackplane-receivers": list(OPERATORS),
        },
    }
    return channel, message, ops


def asyncapi() -> dict[str, Any]:
    chans: dict[str, Any] = {}
    ops: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for (schema, version), model in sorted(registry().items()):
        messages[f"{schema}.v{version}"] = {
            "name": schema,
            "title": f"{schema} v{version}",
            "summary": (model.__doc__ or schema).strip().split("\n")[0],
            "contentType": "application/json",
            "headers": {
                "type": "object",
                "properties": {
                    MSG_ID: {"type": "string", "description": "dedupe id, derived from meaning"},
                    "traceparent": {"type": "string", "description": "W3C trace context"},
                },
            },
            "payload": _payload(schema_file(schema, version)),
        }
    reply_channel, messages["reply"] = _replies()
    replies = {
        "reply": {
            "channel": {"$ref": f"#/channels/{REPLY_CHANNEL}"},
            "messages": [{"$ref": f"#/channels/{REPLY_CHANNEL}/messages/reply"}],
        }
    }
    reply = {"$ref": "#/components/replies/reply"}
    for ch in channels():
        name = _name(ch.address)
        refs = {
            f"{s}.v{v}": {"$ref": f"#/components/messages/{s}.v{v}"} for s in ch.schemas for v in ch.versions
        }
        chans[name] = {
            "address": ch.address,
            "description": ch.description,
            "messages": refs,
            **(
                {"parameters": {p: {"description": PARAMETERS[p]} for p in ch.parameters}}
                if ch.parameters
                else {}
            ),
            "bindings": {"nats": {"bindingVersion": "0.1.0"}},
        }
        listed = [{"$ref": f"#/channels/{name}/messages/{m}"} for m in refs]
        ops[f"{name}.send"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": listed,
            "summary": f"sent by {', '.join(ch.senders)}"
            + (" (request/reply: the answer comes on the sender's inbox)" if ch.kind == "request" else ""),
            **({"reply": reply} if ch.kind == "request" else {}),
            "x-rackplane-senders": list(ch.senders),
        }
        ops[f"{name}.receive"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": listed,
            "summary": f"received by {', '.join(ch.receivers) or 'anyone who follows it'}"
            + (" (it answers on the sender's inbox)" if ch.kind == "request" else ""),
            **({"reply": reply} if ch.kind == "request" else {}),
            "x-rackplane-receivers": list(ch.receivers),
        }
    chans[DLQ_CHANNEL], messages["dead-letter"], dlq_ops = _dead_letters()
    ops.update(dlq_ops)
    chans[REPLY_CHANNEL] = reply_channel
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "rackplane",
            "version": "1",
            "description": (
                "The subjects of rackplane's control plane on NATS: operator commands and recovery's "
                "orders (request/reply), sled commands and reports, provisioning deltas and events "
                "(JetStream), and dead letters. Every message is an envelope {schema, version, id, source, "
                "time, data}, and every answer to a request a reply {ok, data, error}; every payload schema "
                "is JSON Schema 2020-12 (docs/schemas/). docs/subjects.md explains each."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "`make run`: the broker, plain text (`nats://`)",
                "security": [{"$ref": "#/components/securitySchemes/nkey"}],
            },
            "local-tls": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": (
                    "`make run TLS=1`: the same broker behind TLS only (`tls://` URLs); verify its "
                    "certificate against the CA in the context (`.rackplane/tls/ca.pem`)"
                ),
                "security": [{"$ref": "#/components/securitySchemes/nkey"}],
            },
        },
        "channels": chans,
        "operations": ops,
        "components": {"messages": messages, "replies": replies, "securitySchemes": SECURITY},
    }


# --- writing and checking the files ---------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """YAML without anchors and aliases (`&id001`, `*id001`), which some readers of AsyncAPI do not
    follow: a list two operations share is written out twice."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def rendered() -> dict[Path, str]:
    """Every file `make schemas` writes, with its content."""
    out = {
        SCHEMAS / schema_file(s, v): json.dumps(json_schema(s, v, m), indent=2, sort_keys=True) + "\n"
        for (s, v), m in sorted(registry().items())
    }
    out[SCHEMAS / REPLY_FILE] = json.dumps(reply_schema(), indent=2, sort_keys=True) + "\n"
    header = "# Written by `make schemas` (python -m shared.contract) from the code: do not edit.\n"
    out[ASYNCAPI] = header + yaml.dump(asyncapi(), Dumper=_Dumper, sort_keys=False, width=110)
    return out


def drift() -> list[str]:
    """What differs between the committed files and the code (empty: none)."""
    files = rendered()
    out = [
        f"{p.relative_to(ROOT)} is out of date"
        for p, text in files.items()
        if not p.exists() or p.read_text() != text
    ]
    out += [f"{p.relative_to(ROOT)} has no schema any more" for p in SCHEMAS.glob("*.json") if p not in files]
    return out


def main() -> None:
    EXAMPLES.mkdir(parents=True, exist_ok=True)
    for (s, v), m in sorted(registry().items()):
        kept = EXAMPLES / schema_file(s, v)
        if not kept.exists():
            kept.write_text(json.dumps(example(s, v, m), indent=2, sort_keys=True) + "\n")
    files = rendered()
    for stale in set(SCHEMAS.glob("*.json")) - set(files):
        stale.unlink()
    for path, text in files.items():
        path.write_text(text)
    where = f"{SCHEMAS.relative_to(ROOT)}/ and {ASYNCAPI.relative_to(ROOT)}"
    print(f"wrote {len(files) - 1} JSON Schemas to {where}")


if __name__ == "__main__":
    main()
