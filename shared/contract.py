"""The contract as data: every channel (shared/topology/routes.py says who sends and receives what on each),
every message's JSON Schema and one example of it, the schema of every request's reply, the dead-letter
channel with its headers, the security scheme, and the AsyncAPI 3.0 document that holds them all, which a
consumer in any language can generate code from.

docs/subjects.md explains the contract to people; this module states it for programs. `make schemas`
(`python -m deploy.schemas`) writes it to docs/schemas/ and docs/asyncapi.yaml; tests/test_contract.py
fails when the committed files drift from the code, and tests/test_asyncapi_parser.py when the official
AsyncAPI parser finds an error or a warning in them.
"""

from __future__ import annotations

import re
from typing import Any

from shared.bus import DLQ_TRUNCATED, MSG_ID
from shared.messages import Envelope, Model, Reply, registry
from shared.messages.base import read_body
from shared.topology import subjects
from shared.topology.routes import OPERATORS as OPERATORS
from shared.topology.routes import Channel as Channel
from shared.topology.routes import Kind as Kind
from shared.topology.routes import channels as channels
from shared.topology.routes import versions as versions

REPLY_FILE = "reply.json"
"""The schema of every request's answer (`shared.messages.Reply`): no envelope, so no `.v<n>` in its name
(readers of docs/schemas/ pick messages' schemas by `<schema>.v<version>.json`)."""
SCHEMA_FORMAT = "application/schema+json;version=2020-12"
"""What every payload schema is written in (AsyncAPI's default would be its own, a draft-07 superset)."""

PARAMETERS = {
    "silo": f"a silo's name, or `{subjects.FLEET}` for fleet-wide commands and events",
    "sled": "a sled's id",
    "project": "a project's name within the silo",
    "instance": "an instance's id (it decides the partition the delta is kept in)",
    "service": "a service's name: " + ", ".join(subjects.SERVICES),
    "consumer": (
        "the durable consumer that gave up, or the one name the durables of a partitioned stream file under "
        f"(`{subjects.DELTA_DEAD_LETTERS}`)"
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
