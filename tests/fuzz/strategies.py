"""Hostile messages for the fuzz suite, drawn by hypothesis from the published models.

A message is aimed at one subject an identity may publish on, and is one of:
- valid: a body drawn from its model's JSON Schema, wrapped in a correct envelope;
- forged: a valid body whose ids and names are swapped for real ones of the running rack (another sled's
  VMM, another silo's instance...), so that only the services' own checks stand in its way;
- mutated: a valid body with one field replaced by a hostile value (a number past any bigint, a
  negative one, control characters, a huge string, the wrong type), an unknown field added, or a field
  dropped;
- a near miss: a forged body with one field written in a JSON type its reader must refuse although a
  lax reader would take it (`"2"`, `true` or `2.0` for an integer, `1` or `"true"` for a boolean), or a
  string holding a NUL that PostgreSQL cannot store: it must be refused (`invalid`), never served;
- a broken envelope: an unknown schema, an unsupported version, a missing or mistyped envelope field;
- garbage: random bytes, truncated JSON, or a payload near or past the broker's max_payload.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from hypothesis import strategies as st

from shared.messages import Model, registry, schema_of

MAX_PAYLOAD = 1024 * 1024
"""nats-server's default max_payload: a message past it never reaches a service."""


@dataclass
class Real:
    """Ids and names of the running rack, for forgeries."""

    uuids: list[str] = field(default_factory=list)
    silos: list[str] = field(default_factory=list)
    projects: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    sleds: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Shot:
    """One message to send: where, what, and how it was made (for the report)."""

    subject: str
    payload: bytes
    kind: str
    schema: str | None


@functools.cache
def bodies(model: type[Model]) -> st.SearchStrategy[dict[str, Any]]:
    """Valid bodies of `model`, drawn from its JSON Schema (the one `make schemas` would publish)."""
    schema = model.model_json_schema()
    return from_schema(schema, schema.get("$defs", {}))


def from_schema(s: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy for the JSON Schema subset pydantic writes for rackplane's models."""
    if "$ref" in s:
        return st.deferred(lambda: from_schema(defs[s["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in s:
        return st.one_of(*(from_schema(x, defs) for x in s["anyOf"]))
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if "const" in s:
        return st.just(s["const"])
    kind = s.get("type")
    if kind == "object":
        required = set(s.get("required", []))
        props = {k: from_schema(v, defs) for k, v in s.get("properties", {}).items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if kind == "array":
        return st.lists(from_schema(s.get("items", {}), defs), max_size=min(s.get("maxItems", 4), 4))
    if kind == "integer":
        return st.integers(s.get("minimum", -(2**63)), s.get("maximum", 2**63 - 1))
    if kind == "number":
        low = s.get("minimum", s.get("exclusiveMinimum"))
        return st.floats(
            low, s.get("maximum"), allow_nan=False, allow_infinity=False, exclude_min="exclusiveMinimum" in s
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "string":
        if s.get("format") == "uuid":
            return st.uuids().map(str)
        if s.get("format") == "date-time":
            return st.datetimes(timezones=st.just(UTC)).map(lambda d: d.isoformat())
        if "pattern" in s:
            return st.from_regex(s["pattern"], fullmatch=True)
        return st.text(min_size=s.get("minLength", 0), max_size=min(s.get("maxLength", 30), 30))
    return st.just(None)


HOSTILE: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=2**63, max_value=2**80),
    st.integers(min_value=-(2**80), max_value=-1),
    st.just(2**62 + 1),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=31), min_size=1, max_size=20),
    st.text(min_size=1, max_size=8).map(lambda t: t * 5000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.just("../../etc/passwd"),
    st.just("rp.cmd.*.>"),
)


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    how = draw(st.sampled_from(["replace", "add", "drop"] if out else ["add"]))
    if how == "replace":
        out[draw(st.sampled_from(sorted(out)))] = draw(HOSTILE)
    elif how == "add":
        out[draw(st.text(min_size=1, max_size=12))] = draw(HOSTILE)
    else:
        del out[draw(st.sampled_from(sorted(out)))]
    return out


def json_types(s: dict[str, Any], defs: dict[str, Any]) -> set[str]:
    """The JSON types a field's schema allows (empty: any)."""
    if "$ref" in s:
        return json_types(defs[s["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in s:
        return set().union(*(json_types(x, defs) for x in s["anyOf"]))
    if "type" in s:
        return {s["type"]}
    values = s.get("enum", [s["const"]] if "const" in s else [])
    return {{str: "string", bool: "boolean", int: "integer", float: "number"}[type(v)] for v in values}


def misses(types: set[str], value: Any) -> list[Any]:
    """Values a field of these JSON types must refuse although each is close to a valid one."""
    out: list[Any] = []
    if types == {"integer"} or types == {"integer", "null"}:
        n = value if isinstance(value, int) and not isinstance(value, bool) else 2
        out += [str(n), True, float(n)]
    if types == {"boolean"} or types == {"boolean", "null"}:
        out += [1, 0, "true"]
    if types == {"number"} or types == {"number", "null"}:
        out += ["1.5", True]
    if "string" in types and isinstance(value, str):
        out += [value[: len(value) // 2] + "\x00" + value[len(value) // 2 :]]
        if not types & {"integer", "number"}:
            out += [7]
    return out


@st.composite
def near_miss(draw: st.DrawFn, model: type[Model], body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` with one field a near miss (see the module's docstring); None if it has no such field."""
    schema = model.model_json_schema()
    props, defs = schema.get("properties", {}), schema.get("$defs", {})
    choices = {k: misses(json_types(props[k], defs), v) for k, v in body.items() if k in props}
    choices = {k: v for k, v in choices.items() if v}
    if not choices:
        return None
    key = draw(st.sampled_from(sorted(choices)))
    return {**body, key: draw(st.sampled_from(choices[key]))}


@st.composite
def forged(draw: st.DrawFn, body: dict[str, Any], real: Real) -> dict[str, Any]:
    """Swap ids and names for real ones: the body names things that exist, but not as its sender may."""
    out = dict(body)
    pools = {"silo": real.silos, "project": real.projects, "name": real.names, "sled_id": real.sleds}
    for key, value in out.items():
        if pools.get(key):
            out[key] = draw(st.sampled_from(pools[key]))
        elif key.endswith("_id") and isinstance(value, str) and real.uuids and _is_uuid(value):
            out[key] = draw(st.sampled_from(real.uuids))
    return out


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def envelope(schema: str, version: int, data: Any, override: dict[str, Any] | None = None) -> dict[str, Any]:
    env = {
        "schema": schema,
        "version": version,
        "id": str(uuid.uuid4()),
        "source": "fuzz",
        "time": datetime.now(UTC).isoformat(),
        "data": data,
    }
    env.update(override or {})
    return env


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def shots(draw: st.DrawFn, subject: str, models: list[type[Model]], real: Real) -> Shot:
    """One hostile message for `subject`, whose schemas are `models` (another schema now and then)."""
    everything = sorted(registry().values(), key=lambda m: schema_of(m))
    model = draw(st.sampled_from(models)) if draw(st.integers(0, 9)) else draw(st.sampled_from(everything))
    schema, version = schema_of(model)
    body = draw(bodies(model))
    kinds = [
        "valid",
        "forged",
        "forged",
        "mutated",
        "mutated",
        "near miss",
        "near miss",
        "envelope",
        "garbage",
    ]
    kind = draw(st.sampled_from(kinds))
    missed = draw(near_miss(model, draw(forged(body, real)))) if kind == "near miss" else None
    if kind == "near miss" and missed is None:
        kind = "mutated"  # a body with no field that has a near miss (an empty one)
    if missed is not None:
        payload = _json(envelope(schema, version, missed))
    elif kind == "valid":
        payload = _json(envelope(schema, version, body))
    elif kind == "forged":
        payload = _json(envelope(schema, version, draw(forged(body, real))))
    elif kind == "mutated":
        payload = _json(envelope(schema, version, draw(mutated(body))))
    elif kind == "envelope":
        broken = draw(
            st.sampled_from(
                [
                    {"schema": f"{schema}.nope"},
                    {"version": draw(st.sampled_from([0, 2, 99, -1, 2**70]))},
                    {"id": "not-a-uuid"},
                    {"time": "yesterday"},
                    {"source": ""},
                    {"data": draw(HOSTILE)},
                    {"schema": None},
                ]
            )
        )
        payload = _json(envelope(schema, version, body, broken))
    else:
        payload = draw(
            st.one_of(
                st.binary(min_size=0, max_size=200),
                st.just(_json(envelope(schema, version, body))[: draw(st.integers(1, 40))]),
                st.just(b"{" * 5000),
                st.integers(MAX_PAYLOAD - 2048, MAX_PAYLOAD + 4096).map(lambda n: b'{"data": "' + b"x" * n),
            )
        )
    return Shot(subject, payload, kind, schema)
