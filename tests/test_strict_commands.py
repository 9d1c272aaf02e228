"""Strict commands (issue 29): integers are integers and booleans booleans on the wire, and no string
holds what PostgreSQL cannot store (NUL), refused where it enters with an `invalid` reply naming the
field, never an `internal` error from the database."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from deploy import identities
from deploy.stack import Stack
from rackctl.client import Client
from shared import contract
from shared.messages import BadMessage, Reply, decode, registry
from shared.messages.base import storable
from shared.topology import subjects
from tests.conftest import GiB, connect_as, new_project

pytestmark = pytest.mark.timeout(60)


def wire(schema: str, data: Any, version: int = 1, **envelope: Any) -> bytes:
    """A message as any sender may write it, by hand: JSON, UUIDs and times as strings."""
    env = {
        "schema": schema,
        "version": version,
        "id": str(uuid.uuid4()),
        "source": "test",
        "time": datetime.now(UTC).isoformat(),
        "data": data,
        **envelope,
    }
    return json.dumps(env).encode()


@dataclass
class Tenant:
    """A silo and a project on the session stack, and its attackers: the fleet operator and the silo's
    own operator, each with its own credential."""

    silo: str
    project: str
    fleet: Any
    operator: Any


@pytest.fixture(scope="module")
async def tenant(stack: Stack, client: Client) -> AsyncIterator[Tenant]:
    silo, proj = await new_project(client, "strict")
    assert stack.security is not None and stack.nats is not None
    stack.security.add(identities.silo_operator(silo))
    stack.nats.reload()
    fleet, operator = (
        await connect_as(stack, "fleet-operator"),
        await connect_as(stack, f"silo-operator-{silo}"),
    )
    yield Tenant(silo, proj, fleet, operator)
    await fleet.close()
    await operator.close()


async def ask(nc: Any, silo: str, resource: str, verb: str, data: dict[str, Any]) -> Reply:
    raw = await nc.request(
        subjects.command(silo, resource, verb), wire(f"rp.cmd.{resource}.{verb}", data), timeout=10
    )
    return Reply.model_validate_json(raw.data)


def refused(reply: Reply, field: str) -> str:
    assert not reply.ok and reply.error is not None, reply
    assert reply.error["code"] == "invalid", reply.error
    assert reply.error["message"].split(": ")[1] == field, reply.error
    return reply.error["message"]


SHAPE = {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": GiB}


@pytest.mark.parametrize(
    ("resource", "verb", "body", "field"),
    [
        ("instance", "create", {**SHAPE, "vcpus": "2"}, "vcpus"),
        ("instance", "create", {**SHAPE, "vcpus": True}, "vcpus"),
        ("instance", "create", {**SHAPE, "ram_bytes": float(GiB)}, "ram_bytes"),
        ("instance", "create", {**SHAPE, "require_pool": "true"}, "require_pool"),
        ("instance", "create", {**SHAPE, "require_pool": 1}, "require_pool"),
        ("instance", "list", {"limit": "2"}, "limit"),
        ("instance", "list", {"limit": True}, "limit"),
        ("pool", "resize", {"size": "3"}, "size"),
        ("usage", "history", {"buckets": False}, "buckets"),
    ],
)
async def test_a_number_or_boolean_in_the_wrong_json_type_is_invalid(
    tenant: Tenant, resource: str, verb: str, body: dict[str, Any], field: str
) -> None:
    """As the fleet operator, on `_fleet`: a lax reader took `"2"` and `true` as 2 and 1."""
    names = {"silo": tenant.silo}
    if verb not in ("list", "history"):
        names |= {"project": tenant.project, "name": "vm"}
    reply = await ask(tenant.fleet, subjects.FLEET, resource, verb, {**names, **body})
    message = refused(reply, field)
    assert "valid integer" in message or "valid boolean" in message, message


async def test_the_same_command_with_json_types_is_served(tenant: Tenant) -> None:
    """Strictness refuses only the wrong JSON types: the command above, written right, is served."""
    body = {"silo": tenant.silo, "project": tenant.project, "name": "vm", **SHAPE}
    created = await ask(tenant.fleet, subjects.FLEET, "instance", "create", body)
    assert created.ok, created.error
    listed = await ask(tenant.fleet, subjects.FLEET, "instance", "list", {"silo": tenant.silo, "limit": 2})
    assert listed.ok and [i["name"] for i in listed.data["items"]] == ["vm"], listed


@pytest.mark.parametrize(
    ("resource", "verb", "body", "field"),
    [
        ("project", "list", {"after": "\x00"}, "after"),
        ("project", "list", {"after": "p\x00q"}, "after"),
        ("instance", "list", {"after": "a/b\x00/c"}, "after"),
        ("pool", "list", {"after": "\x00/\x00/\x00"}, "after"),
        ("project", "create", {"name": "p\x00"}, "name"),
        ("instance", "start", {"project": "p", "name": "vm\x00"}, "name"),
    ],
)
async def test_a_nul_in_a_cursor_or_name_is_invalid_not_a_database_error(
    tenant: Tenant, resource: str, verb: str, body: dict[str, Any], field: str
) -> None:
    """As the silo's operator, on its silo's subjects: the cursor reached PostgreSQL, which answered
    CharacterNotInRepertoire, and the reply was `internal`."""
    refused(await ask(tenant.operator, tenant.silo, resource, verb, {"silo": tenant.silo, **body}), field)


def strings(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Where `value` (a message body, as JSON) holds a string."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in strings(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in strings(v, (*path, i))]
    return []


def with_nul(value: Any, path: tuple[str | int, ...]) -> Any:
    if not path:
        return value + "\x00"
    head, *rest = path
    out = list(value) if isinstance(value, list) else dict(value)
    out[head] = with_nul(value[head], tuple(rest))  # type: ignore[index]
    return out


def every_string_field() -> list[tuple[str, int, tuple[str | int, ...]]]:
    out = []
    for (schema, version), model in sorted(registry().items()):
        data = contract.example(schema, version, model)["data"]
        out += [(schema, version, path) for path in strings(data)]
    return out


def test_every_string_field_of_every_message_refuses_nul() -> None:
    """One rule at the boundary (messages.base), not one per command: a NUL in any string of any body,
    nested ones and a dictionary's keys included, makes the message `invalid`, naming where it was."""
    fields = every_string_field()
    assert len(fields) > 50  # every message's examples hold strings: names, UUIDs, times
    for schema, version, path in fields:
        model = registry()[(schema, version)]
        data = contract.example(schema, version, model)["data"]
        decode(wire(schema, data, version))  # the example as it is is read
        with pytest.raises(BadMessage) as refusal:
            decode(wire(schema, with_nul(data, path), version))
        assert refusal.value.code == "invalid", (schema, path, refusal.value.reason)
        where = ".".join(str(p) for p in path)
        assert f"v{version}: {where}: " in refusal.value.reason, (schema, path, refusal.value.reason)


def test_a_nul_in_the_envelope_or_a_list_of_strings_is_refused_too() -> None:
    model = registry()[("rp.cmd.silo.create", 1)]
    data = contract.example("rp.cmd.silo.create", 1, model)["data"]
    with pytest.raises(BadMessage) as refusal:
        decode(wire("rp.cmd.silo.create", data, source="te\x00st"))
    assert refusal.value.code == "malformed" and "source" in refusal.value.reason
    with pytest.raises(ValueError, match="U\\+0000 at 1"):
        storable({"key": ["ok", ("x\x00",)]})
    with pytest.raises(ValueError, match="U\\+D800 at 0"):
        storable({"\ud800": 1})


def test_the_envelope_is_strict_and_uuids_and_times_still_arrive_as_strings() -> None:
    """JSON has no UUID or time type: strictness keeps them as strings in their format, and only those."""
    order = {"instance_id": str(uuid.uuid4()), "generation": 3}
    env, body = decode(wire("rp.cmd.instance.restart", order))
    assert body.instance_id == uuid.UUID(order["instance_id"]) and body.generation == 3  # type: ignore[attr-defined]
    assert isinstance(env.time, datetime)
    for bad in ({"version": "1"}, {"version": True}, {"time": 1_700_000_000}):
        with pytest.raises(BadMessage) as refusal:
            decode(wire("rp.cmd.instance.restart", order, **bad))
        assert refusal.value.code == "malformed", bad
    with pytest.raises(BadMessage) as refusal:
        decode(wire("rp.cmd.instance.restart", {**order, "generation": "3"}))
    assert refusal.value.code == "invalid" and "generation" in refusal.value.reason
