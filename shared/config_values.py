"""The kinds of value a setting takes (durations, flags, ports, sled shapes...), each refusing a bad value
with what it expects, and the one line a refused value becomes (`one_line`): shared/config.py declares
every setting with them."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, Field, ValidationError
from pydantic_settings import NoDecode

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_DURATION_FORMS = "seconds or a duration such as 90s, 30m, 12h or 7d"


class ConfigError(ValueError):
    """A setting whose value it cannot have; the message names the variable, and the process stops."""


def parse_duration(text: str) -> float:
    """`text` in seconds: a number of seconds, or a duration such as 90s, 30m, 12h, 7d, 2w; -1 if neither."""
    m = _DURATION.fullmatch(text.strip().lower())
    return float(m[1]) * _UNITS[m[2] or "s"] if m else -1.0


def _seconds(raw: Any, *, zero: bool) -> Any:
    if not isinstance(raw, str):
        return raw
    seconds = parse_duration(raw)
    if seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"expected {'' if zero else 'positive '}{_DURATION_FORMS}")
    return seconds


Duration = Annotated[float, BeforeValidator(lambda v: _seconds(v, zero=False)), Field(gt=0)]
"""Seconds above zero: a number of seconds, or a number with s, m, h, d or w."""
Delay = Annotated[float, BeforeValidator(lambda v: _seconds(v, zero=True)), Field(ge=0)]
"""Like `Duration`, zero allowed (no wait at all)."""


_FLAGS = {
    **dict.fromkeys(("1", "on", "true", "yes"), True),
    **dict.fromkeys(("0", "off", "false", "no"), False),
}


def _flag(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.strip().lower() not in _FLAGS:
        raise ValueError("expected 1 or 0 (on/off, true/false, yes/no)")
    return _FLAGS[raw.strip().lower()]


Flag = Annotated[bool, BeforeValidator(_flag)]
"""On or off: 1, on, true, yes or 0, off, false, no (any case)."""


def _shapes(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        shapes = [tuple(int(n) for n in shape.split(":")) for shape in raw.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise ValueError("expected VCPUS:RAM_GIB pairs, comma-separated, such as 64:256,32:128")
    return shapes


def _points(raw: Any) -> Any:
    return frozenset(p.strip() for p in raw.split(",") if p.strip()) if isinstance(raw, str) else raw


def _traces(raw: str) -> str:
    if raw in ("none", "console", "otlp") or (raw.startswith("file:") and len(raw) > 5):
        return raw
    raise ValueError("expected none, console, otlp or file:PATH")


def _port(raw: Any) -> int:
    text = str(raw).strip()
    if not text.isdigit() or int(text) > 65535:
        raise ValueError("expected a port number from 0 to 65535")
    return int(text)


def _log_format(raw: str) -> str:
    if raw.strip().lower() in ("text", "json"):
        return raw.strip().lower()
    raise ValueError("expected text or json")


def _level(raw: str) -> str:
    if raw.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        return raw.upper()
    raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")


Shapes = Annotated[list[tuple[int, int]] | None, NoDecode, BeforeValidator(_shapes)]
"""Sled capacities, `VCPUS:RAM_GIB` comma-separated."""
CrashPoints = Annotated[frozenset[str], NoDecode, BeforeValidator(_points)]
"""Names, comma-separated."""
Traces = Annotated[str, BeforeValidator(_traces)]
Port = Annotated[int, BeforeValidator(_port)]
LogFormat = Annotated[str, BeforeValidator(_log_format)]
LogLevel = Annotated[str, BeforeValidator(_level)]


def setting(name: str, default: Any, about: str, shown: str | None = None, **bounds: Any) -> Any:
    """A field read from the variable `name`; `shown` is the default as the docs' table shows it, and
    `bounds` are pydantic's (ge=0...)."""
    extra = {"shown_default": shown} if shown is not None else None
    return Field(default, validation_alias=name, description=about, json_schema_extra=extra, **bounds)


def one_line(e: ValidationError) -> str:
    """The first bad variable, its value and what it expects."""
    err = e.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:  # raised by a model validator, already naming its variable
        return msg
    name = str(err["loc"][0])  # the variable: every field is read by its alias
    if err["type"] == "literal_error":
        msg = msg.replace("Input should be", "expected")
    return f"{name}={err['input']!r}: {msg[0].lower()}{msg[1:]}"


M = TypeVar("M", bound=BaseModel)


def read(model: type[M]) -> M:
    """`model` read from the environment; a bad value raises `ConfigError` naming its variable."""
    try:
        return model()
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None


def markdown_table(model: type[BaseModel]) -> str:
    """Every variable of `model` (its fields made with `setting`) as a markdown table: variable, default,
    meaning."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for field in model.model_fields.values():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        rows.append(
            f"| `{field.validation_alias}` | {extra.get('shown_default') or _shown(field.default)} | "
            f"{field.description} |"
        )
    return "\n".join(rows) + "\n"


def _shown(default: Any) -> str:
    if default is None:
        return "(none)"
    if isinstance(default, float):
        return f"`{default:g}` s"
    return f"`{default}`"
