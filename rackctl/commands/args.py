"""The arguments commands share: what a path, a size or a count may be, and the options several commands take.

Each type refuses a bad value while parsing, as argparse refuses its own (exit 2, one clear line).
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

from rackctl.commands.base import UsageError
from rackctl.sizes import parse_size
from shared.config import parse_duration
from shared.messages import NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)
NAME_MAX = 63
POOL_NAME_MAX = 56
"""A pool's name is shorter than other names (`messages.PoolName`): its VMs are named `<pool>-<6 hex>`."""


# --- names -----------------------------------------------------------------------------------------------


class Ref(NamedTuple):
    silo: str
    project: str
    name: str

    def __str__(self) -> str:
        return "/".join(self)


def _path(text: str, shape: tuple[str, ...]) -> list[str]:
    """Split a `SILO/PROJECT/...` path, refusing a wrong segment count or an invalid name, clearly."""
    parts = text.split("/")
    if len(parts) != len(shape):
        raise argparse.ArgumentTypeError(f"invalid path {text!r}: expected {'/'.join(shape)}")
    for kind, part in zip(shape, parts, strict=True):
        longest = POOL_NAME_MAX if kind == "POOL" else NAME_MAX
        if not _NAME.fullmatch(part) or len(part) > longest:
            which = "a pool name" if kind == "POOL" else "a name"
            raise argparse.ArgumentTypeError(
                f"invalid {kind.lower()} name {part!r} in {text!r}: {which} is 1 to {longest} lowercase "
                "letters, digits or '-', starting with a letter"
            )
    return parts


def silo_path(text: str) -> str:
    return _path(text, ("SILO",))[0]


def project_path(text: str) -> tuple[str, str]:
    silo, project = _path(text, ("SILO", "PROJECT"))
    return silo, project


def scope_path(text: str) -> tuple[str, str | None]:
    """`SILO` or `SILO/PROJECT`: (silo, project or None)."""
    if "/" in text:
        return project_path(text)
    return silo_path(text), None


def instance_path(text: str) -> Ref:
    return Ref(*_path(text, ("SILO", "PROJECT", "INSTANCE")))


def pool_path(text: str) -> Ref:
    return Ref(*_path(text, ("SILO", "PROJECT", "POOL")))


def sled_name(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid sled id {text!r}: expected a sled id such as sled-0")
    return text


# --- numbers ---------------------------------------------------------------------------------------------


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected a whole number")
    return int(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected a positive number of seconds")
    return value


def ago(text: str) -> float:
    """How long ago, in seconds: `90s`, `30m`, `12h`, `7d`, `2w`, or a number of seconds (above 0)."""
    value = parse_duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid length of time {text!r}: expected seconds or a duration such as 90s, 30m, 12h or 7d"
        )
    return value


def duration(text: str) -> float:
    """Seconds, zero included (zero turns a fault off)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: expected a number of seconds, 0 or more"
        )
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"invalid probability {text!r}: expected a number from 0 to 1")
    return value


# --- shared options --------------------------------------------------------------------------------------


def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the reply data as JSON, and nothing else")


def wait_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true", help="block until the target state (bounded by --timeout)")


def instance_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance", type=instance_path, metavar="SILO/PROJECT/INSTANCE")


def pool_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("pool", type=pool_path, metavar="SILO/PROJECT/POOL")


def sled_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("sled", type=sled_name, metavar="SLED_ID")


def scope_args(p: argparse.ArgumentParser, exclusive: bool = False) -> None:
    """--silo and/or --project; with `exclusive`, at most one of them."""
    target = p.add_mutually_exclusive_group() if exclusive else p
    target.add_argument("--silo", type=silo_path, metavar="SILO", help="only this silo")
    target.add_argument("--project", type=project_path, metavar="SILO/PROJECT", help="only this project")


def scope(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(silo, project) from --silo and --project; --project names its silo, which must agree."""
    silo: str | None = args.silo
    if args.project is None:
        return silo, None
    p_silo, project = args.project
    if silo is not None and silo != p_silo:
        raise UsageError(f"--silo {silo} and --project {p_silo}/{project} name different silos")
    return p_silo, project
