"""Follow rackplane's events as a third party would: a durable pull consumer that checks every message
against the published JSON Schemas (docs/schemas/), not against rackplane's code.

    python consume.py [--context FILE] [--schemas DIR] [--count N]

It needs only nats-py and jsonschema. It connects as a subscriber (the context file that `make run` writes
for `events-reader`, or `rackctl subscriber add` for another: `{"url", "nkey", "ca", "identity", "stream",
"silo"}`), which may use any consumer of its own stream (`EVENTS-<identity>`) filtered within its scope
(`rp.evt.>`, or `rp.evt.<silo>.>` for a silo's subscriber) and nothing else; it reads its replies on its
private inbox `_INBOX_<identity>`. Its durable is named after the identity; a restart resumes where it
left off. Each valid event is printed (in the newest version of its schema that
it has: an older copy of the same change is acknowledged unread), one line each, then acknowledged; one
that fails its schema, or whose schema and version have no file here, is reported on stderr and
terminated (kept by the broker, never redelivered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
from pathlib import Path
from typing import Any

import jsonschema
import nats
import nats.errors
from nats.js import api

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def load_schemas(folder: Path) -> dict[tuple[str, int], Any]:
    """Every `<schema>.v<version>.json` of the folder, as a validator keyed by (schema, version)."""
    out = {}
    for path in sorted(folder.glob("*.v*.json")):
        name, _, version = path.name.removesuffix(".json").rpartition(".v")
        schema = json.loads(path.read_text())
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        out[(name, int(version))] = cls(schema)
    return out


def check(schemas: dict[tuple[str, int], Any], data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the message, None) if it is valid against the schema of its own schema and version, else
    (None, why)."""
    try:
        message = json.loads(data)
        key = (message["schema"], message["version"])
    except (ValueError, KeyError, TypeError):
        return None, "not a JSON envelope with a schema and a version"
    validator = schemas.get(key)
    if validator is None:
        return None, f"no published schema {key[0]} v{key[1]} here (a newer producer? update the schemas)"
    error = jsonschema.exceptions.best_match(validator.iter_errors(message))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the message)"
        return None, f"{key[0]} v{key[1]}: {where}: {error.message}"
    return message, None


def superseded(schemas: dict[tuple[str, int], Any], message: dict[str, Any]) -> bool:
    """Whether a newer version of this message's schema is published: while rackplane sends both versions
    of a change (its deprecation window, docs/subjects.md "Versions"), a reader follows the newest it
    knows and acknowledges the older copy unread. (It assumes every producer sends the newest version: see
    the README on a rolling upgrade from the release before v2.)"""
    return any(name == message["schema"] and v > message["version"] for name, v in schemas)


def summary(subject: str, message: dict[str, Any]) -> str:
    data = message["data"]
    if isinstance(data.get("instance"), dict):
        v = data["instance"]
        what = f"{v['silo']}/{v['project']}/{v['name']} {v['state']} (generation {v['generation']})"
    else:
        what = json.dumps(data, sort_keys=True)
    return f"{message['time']}  {subject}  {what}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    home = Path(os.environ.get("RACKPLANE_HOME") or REPO / ".rackplane")
    parser.add_argument("--context", type=Path, default=home / "contexts" / "events-reader.json")
    parser.add_argument("--schemas", type=Path, default=REPO / "docs" / "schemas")
    parser.add_argument("--count", type=int, help="stop after this many events (default: never)")
    a = parser.parse_args()

    context = json.loads(a.context.read_text())
    schemas = load_schemas(a.schemas)
    options: dict[str, Any] = {"inbox_prefix": f"_INBOX_{context['identity']}"}
    if context.get("nkey"):
        options["nkeys_seed"] = context["nkey"]
    if context.get("ca"):
        options["tls"] = ssl.create_default_context(cafile=context["ca"])

    async def on_error(e: Exception) -> None:  # one line, not nats-py's traceback, when the broker is away
        print(f"nats: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    nc = await nats.connect(
        context["url"],
        name="events-consumer-example",
        error_cb=on_error,
        max_reconnect_attempts=-1,
        **options,
    )
    js = nc.jetstream()
    stream, durable = context.get("stream") or "EVENTS", context["identity"]
    subject = f"rp.evt.{context['silo']}.>" if context.get("silo") else "rp.evt.>"
    config = api.ConsumerConfig(
        name=durable,  # the create request then names the filter, as a subscriber's grant asks
        durable_name=durable,
        filter_subject=subject,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.NEW,  # when first created; afterwards it resumes where it was
        ack_wait=30,
    )
    sub = await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
    print(f"following {subject} as {durable} (durable {durable} on {stream})", file=sys.stderr, flush=True)
    seen = 0
    try:
        while a.count is None or seen < a.count:
            try:
                msgs = await sub.fetch(16, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            for msg in msgs:
                message, why = check(schemas, msg.data)
                if message is None:
                    print(f"refused {msg.subject}: {why}", file=sys.stderr, flush=True)
                    await msg.term()
                    continue
                if superseded(schemas, message):
                    await msg.ack_sync()
                    continue
                print(summary(msg.subject, message), flush=True)
                await msg.ack_sync()
                seen += 1
    finally:
        await nc.drain()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
