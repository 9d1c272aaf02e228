"""rackctl: the operator's command line for rackplane.

Every command is one function registered with `@command("group verb", ...)`; the parser is built from
that table, so a new command group (pool, sim, chaos, check...) is only new functions, not parser code.

Contract for scripts: exit 0 on success, 1 when the control plane refuses, fails or times out (one line
on stderr: `rackctl: error: ...`), 2 on a usage error; `--json` prints the reply data and nothing else.
Set RACKCTL_LOG=DEBUG to see library logs on stderr (silent by default so errors stay one line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, NoReturn

import nats.errors
from pydantic import ValidationError

from rackctl.client import Client
from rackctl.output import Progress, print_fields, print_json, print_table
from rackctl.sizes import format_size, parse_size
from shared import bus, telemetry
from shared.config import DEFAULT_NATS_URL
from shared.messages import NAME_PATTERN, AutoRestart, InstanceCreate, Model, Quota

PROG = "rackctl"
DEFAULT_TIMEOUT = 60.0
_NAME = re.compile(NAME_PATTERN)


class UsageError(Exception):
    """A mistake in the command line found after parsing (exit 2, like argparse's own errors)."""


class Failure(Exception):
    """The command ran but did not get what it asked for: a failed instance, a wait that timed out."""


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
        if not _NAME.fullmatch(part):
            raise argparse.ArgumentTypeError(
                f"invalid {kind.lower()} name {part!r} in {text!r}: a name is 1 to 63 lowercase letters, "
                "digits or '-', starting with a letter"
            )
    return parts


def silo_path(text: str) -> str:
    return _path(text, ("SILO",))[0]


def project_path(text: str) -> tuple[str, str]:
    silo, project = _path(text, ("SILO", "PROJECT"))
    return silo, project


def instance_path(text: str) -> Ref:
    return Ref(*_path(text, ("SILO", "PROJECT", "INSTANCE")))


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


# --- the command table -----------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a command runs with: its arguments, a lazily connected client, and its own deadline."""

    args: argparse.Namespace
    started: float = field(default_factory=time.monotonic)
    _client: Client | None = None

    async def client(self) -> Client:
        """Connect on first use, so that usage errors are reported before (and without) any network."""
        if self._client is None:
            self._client = await Client.connect(self.args.nats, timeout=self.args.timeout)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()

    @property
    def remaining(self) -> float:
        return self.started + self.args.timeout - time.monotonic()

    def emit(self, data: Any, human: Callable[[Any], None]) -> None:
        """The reply as JSON with --json, else as people read it."""
        if getattr(self.args, "json", False):
            print_json(data)
        else:
            human(data)


Runner = Callable[[Ctx], Awaitable[None]]
Option = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    help: str
    run: Runner
    options: tuple[Option, ...]


COMMANDS: dict[tuple[str, ...], Command] = {}
GROUPS: dict[str, str] = {
    "silo": "silos: tenants, with their quotas",
    "project": "projects inside a silo",
    "instance": "VM instances: create, start, stop, delete, inspect",
    "sled": "the sleds of the rack",
}


def command(words: str, help: str, *options: Option) -> Callable[[Runner], Runner]:
    """Register `run` as `rackctl <words>`, with the arguments that `options` add to its parser."""

    def register(run: Runner) -> Runner:
        key = tuple(words.split())
        COMMANDS[key] = Command(key, help, run, options)
        return run

    return register


def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the reply data as JSON, and nothing else")


def wait_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait", action="store_true", help="block until the target state (bounded by --timeout)"
    )


def instance_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance", type=instance_path, metavar="SILO/PROJECT/INSTANCE")


def scope_args(p: argparse.ArgumentParser, exclusive: bool) -> None:
    target = p.add_mutually_exclusive_group() if exclusive else p
    target.add_argument("--silo", type=silo_path, metavar="SILO")
    target.add_argument("--project", type=project_path, metavar="SILO/PROJECT")


# --- silos and projects ----------------------------------------------------------------------------------


def _quota_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", type=silo_path, metavar="SILO")
    p.add_argument("--cpus", type=count, metavar="N", help="vCPU quota (default: none)")
    p.add_argument("--ram", type=size, metavar="SIZE", help="RAM quota, e.g. 64GiB (default: none)")
    p.add_argument("--storage", type=size, metavar="SIZE", help="disk quota, e.g. 1TiB (default: none)")


def _quota_text(q: dict[str, int | None] | None) -> str:
    if not q or all(v is None for v in q.values()):
        return "no quota"
    return ", ".join(
        f"{label} {'unlimited' if v is None else fmt(v)}"
        for label, v, fmt in (
            ("vCPUs", q.get("vcpus"), str),
            ("RAM", q.get("ram_bytes"), format_size),
            ("storage", q.get("disk_bytes"), format_size),
        )
    )


@command("silo create", "create a silo, optionally with quotas", _quota_options, json_flag)
async def silo_create(ctx: Ctx) -> None:
    a = ctx.args
    quota = _validated(
        Quota, {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--storage"},
        vcpus=a.cpus, ram_bytes=a.ram, disk_bytes=a.storage,
    )  # fmt: skip
    data = await (await ctx.client()).silo_create(a.name, quota)
    ctx.emit(data, lambda d: print(f"created silo {d['name']} ({_quota_text(d['quota'])})"))


@command("silo list", "list silos and their quotas", json_flag)
async def silo_list(ctx: Ctx) -> None:
    def human(silos: list[dict[str, Any]]) -> None:
        rows = []
        for s in silos:
            q = s.get("quota") or {}
            ram, disk = q.get("ram_bytes"), q.get("disk_bytes")
            rows.append((s["name"], q.get("vcpus"), _size_or_none(ram), _size_or_none(disk)))
        print_table(("SILO", "VCPU QUOTA", "RAM QUOTA", "STORAGE QUOTA"), rows)

    ctx.emit(await (await ctx.client()).silo_list(), human)


@command(
    "project create",
    "create a project in a silo",
    lambda p: p.add_argument("project", type=project_path, metavar="SILO/PROJECT"),
    json_flag,
)
async def project_create(ctx: Ctx) -> None:
    silo, name = ctx.args.project
    data = await (await ctx.client()).project_create(silo, name)
    ctx.emit(data, lambda d: print(f"created project {d['silo']}/{d['name']}"))


@command(
    "project list",
    "list the projects of a silo",
    lambda p: p.add_argument("silo", type=silo_path, metavar="SILO"),
    json_flag,
)
async def project_list(ctx: Ctx) -> None:
    def human(projects: list[dict[str, Any]]) -> None:
        print_table(("PROJECT", "ID"), [(f"{p['silo']}/{p['name']}", p["id"]) for p in projects])

    ctx.emit(await (await ctx.client()).project_list(ctx.args.silo), human)


# --- instances -------------------------------------------------------------------------------------------


def _create_options(p: argparse.ArgumentParser) -> None:
    instance_arg(p)
    p.add_argument("--cpus", type=count, metavar="N", required=True, help="vCPUs")
    p.add_argument("--ram", type=size, metavar="SIZE", required=True, help="RAM, e.g. 4GiB")
    p.add_argument("--disk", type=size, metavar="SIZE", required=True, help="boot disk, e.g. 10GiB")
    p.add_argument(
        "--auto-restart",
        choices=[a.value for a in AutoRestart],
        default=AutoRestart.best_effort.value,
        help="restart the instance if its VMM fails (default: best_effort)",
    )


@command("instance create", "create a (stopped) instance", _create_options, json_flag)
async def instance_create(ctx: Ctx) -> None:
    a, ref = ctx.args, ctx.args.instance
    body = _validated(
        InstanceCreate, {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--disk"},
        silo=ref.silo, project=ref.project, name=ref.name,
        vcpus=a.cpus, ram_bytes=a.ram, disk_bytes=a.disk, auto_restart=a.auto_restart,
    )  # fmt: skip
    data = await (await ctx.client()).instance_create(
        ref.silo,
        ref.project,
        ref.name,
        vcpus=body.vcpus,
        ram_bytes=body.ram_bytes,
        disk_bytes=body.disk_bytes,
        auto_restart=body.auto_restart,
    )
    ctx.emit(data, lambda v: print(f"created instance {ref}: {_shape(v)} ({v['state']})"))


@command("instance show", "show one instance", instance_arg, json_flag)
async def instance_show(ctx: Ctx) -> None:
    ctx.emit(await (await ctx.client()).instance("show", *ctx.args.instance), _print_instance)


