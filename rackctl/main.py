"""rackctl: the operator's command line for rackplane.

Every command is one function registered with `@command("group verb", ...)`; the parser is built from
that table, so a new command group (pool, sim, chaos, check...) is only new functions, not parser code.

Contract for scripts: exit 0 on success, 1 when the control plane refuses, fails or times out (one line
on stderr: `rackctl: error: ...`), 2 on a usage error (an irreversible command without `--yes` included);
`--json` prints the reply data and nothing else.
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
from typing import Any, NamedTuple, NoReturn, TypeVar

import asyncpg
import nats.errors
from nats.js import JetStreamContext
from pydantic import ValidationError

from rackctl import check as checker
from rackctl.client import Client
from rackctl.output import Progress, TableStream, print_fields, print_json, print_table
from rackctl.sizes import format_size, parse_size
from shared import bus, subjects, telemetry
from shared.config import DEFAULT_NATS_URL, check_database_url
from shared.messages import (
    NAME_PATTERN,
    AutoRestart,
    InstanceCreate,
    InstanceList,
    Model,
    Paged,
    PoolCreate,
    PoolResize,
    Quota,
    ServiceFaults,
    SimFaults,
    SimSledAdd,
    VmmState,
)

PROG = "rackctl"
DEFAULT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 5.0
_NAME = re.compile(NAME_PATTERN)
NAME_MAX = 63
POOL_NAME_MAX = 56
"""A pool's name is shorter than other names (`messages.PoolName`): its VMs are named `<pool>-<6 hex>`."""
M = TypeVar("M", bound=Model)


class UsageError(Exception):
    """A mistake in the command line found after parsing (exit 2, like argparse's own errors)."""


class Failure(Exception):
    """The command ran but did not get what it asked for: a failed instance, a wait that timed out."""


class Unconfirmed(Exception):
    """An irreversible command without `--yes`: refused before touching anything (exit 2, one line)."""


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


def instance_path(text: str) -> Ref:
    return Ref(*_path(text, ("SILO", "PROJECT", "INSTANCE")))


def pool_path(text: str) -> Ref:
    return Ref(*_path(text, ("SILO", "PROJECT", "POOL")))


def sled_name(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid sled id {text!r}: expected a sled id such as sled-0")
    return text


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
            limit = min(CONNECT_TIMEOUT, self.args.timeout)
            self._client = await Client.connect(
                self.args.nats, timeout=self.args.timeout, connect_within=limit, context=self.args.context
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):  # a broken connection must not hold the exit up
                await asyncio.wait_for(self._client.close(), 2.0)

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
    "instance": "VM instances: create, start, stop, migrate, delete, inspect",
    "pool": "warm pools: VMs booted ahead, handed to one customer each",
    "sled": "the sleds of the rack",
    "sim": "drive the sled simulator: reboot, freeze, partition, faults (testing only)",
    "sim sled": "add, list, reboot, freeze, thaw, partition, heal or remove simulated sleds (testing only)",
}
"""Help of each command group, by its words."""


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
        Quota,
        {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--storage"},
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.storage,
    )
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
    p.add_argument("--cpus", type=count, metavar="N", help="vCPUs (required without --from-pool)")
    p.add_argument("--ram", type=size, metavar="SIZE", help="RAM, e.g. 4GiB (required without --from-pool)")
    p.add_argument(
        "--disk", type=size, metavar="SIZE", help="boot disk, e.g. 10GiB (required without --from-pool)"
    )
    p.add_argument(
        "--auto-restart",
        choices=[a.value for a in AutoRestart],
        default=AutoRestart.best_effort.value,
        help="restart the instance if its VMM fails (default: best_effort)",
    )
    p.add_argument(
        "--from-pool",
        type=pool_path,
        metavar="SILO/PROJECT/POOL",
        help="take a running VM from this warm pool of the same project, with the pool's shape; if it has "
        "no idle VM, create and start a new one of that shape (and say so)",
    )
    p.add_argument(
        "--require-pool", action="store_true", help="with --from-pool: fail if the pool has no idle VM"
    )


_SHAPE_OPTIONS = {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--disk"}


@command(
    "instance create",
    "create a (stopped) instance; with --from-pool, take a running VM from a warm pool",
    _create_options,
    json_flag,
)
async def instance_create(ctx: Ctx) -> None:
    a, ref = ctx.args, ctx.args.instance
    shape = {"--cpus": a.cpus, "--ram": a.ram, "--disk": a.disk}
    if a.from_pool is not None:
        await _instance_from_pool(ctx, [option for option, value in shape.items() if value is not None])
        return
    if a.require_pool:
        raise UsageError("--require-pool needs --from-pool SILO/PROJECT/POOL")
    missing = [option for option, value in shape.items() if value is None]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)} (or --from-pool)")
    body = _validated(
        InstanceCreate,
        _SHAPE_OPTIONS,
        silo=ref.silo,
        project=ref.project,
        name=ref.name,
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.disk,
        auto_restart=a.auto_restart,
    )
    data = await (await ctx.client()).send(body)
    ctx.emit(data, lambda v: print(f"created instance {ref}: {_shape(v)} ({v['state']})"))


async def _instance_from_pool(ctx: Ctx, shape_given: list[str]) -> None:
    """`instance create --from-pool`: an idle VM of the pool, renamed, or a new one of its shape."""
    a, ref, pool = ctx.args, ctx.args.instance, ctx.args.from_pool
    if shape_given:
        raise UsageError(
            f"a VM from a pool has the pool's shape: {', '.join(shape_given)} not allowed with --from-pool"
        )
    if (pool.silo, pool.project) != (ref.silo, ref.project):
        raise UsageError(
            f"pool {pool} is not in project {ref.silo}/{ref.project}: "
            "a pool hands out VMs in its own project only"
        )
    data = await (await ctx.client()).instance_from_pool(
        ref.silo,
        ref.project,
        ref.name,
        pool.name,
        require=a.require_pool,
        auto_restart=AutoRestart(a.auto_restart),
    )

    def human(v: dict[str, Any]) -> None:
        if v.get("source") == "pool":
            print(f"created instance {ref} from pool {pool}: {_state_where(v)}")
        else:
            print(f"created instance {ref}: {_shape(v)} ({_state_where(v)})")
        if v.get("note"):
            print(f"note: {v['note']}")

    ctx.emit(data, human)


@command("instance show", "show one instance", instance_arg, json_flag)
async def instance_show(ctx: Ctx) -> None:
    ctx.emit(await (await ctx.client()).instance("show", *ctx.args.instance), _print_instance)


@command("instance list", "list instances of the fleet, a silo or a project", scope_args, json_flag)
async def instance_list(ctx: Ctx) -> None:
    silo, project = _scope(ctx.args)

    def row(v: dict[str, Any]) -> tuple[Any, ...]:
        return (
            _ref(v),
            v["state"],
            v.get("health"),
            v["vcpus"],
            format_size(v["ram_bytes"]),
            format_size(v["disk_bytes"]),
            v["sled_id"],
        )

    headers = ("INSTANCE", "STATE", "HEALTH", "VCPUS", "RAM", "DISK", "SLED")
    await _emit_pages(ctx, InstanceList(silo=silo, project=project), headers, row)


async def _emit_pages(
    ctx: Ctx, body: Paged, headers: tuple[str, ...], row: Callable[[dict[str, Any]], tuple[Any, ...]]
) -> None:
    """A list, page by page: a table that starts with the first page, or (--json) the whole list."""
    client = await ctx.client()
    if getattr(ctx.args, "json", False):
        print_json(await client.every(body))
        return
    table = TableStream(headers)
    async for page in client.pages(body):
        table.write([row(item) for item in page])
    table.close()


TARGETS: dict[str, str | None] = {"start": "running", "stop": "stopped", "delete": None}
"""The state each action's --wait waits for; None: until the instance is gone (show says not_found)."""


async def instance_action(verb: str, ctx: Ctx) -> None:
    """start, stop or delete; with --wait, only return once the instance got there."""
    ref: Ref = ctx.args.instance
    client = await ctx.client()
    data = await client.instance(verb, *ref)
    final = data
    if ctx.args.wait:
        final = await _wait_for(ctx, client, ref, data, TARGETS[verb]) or data

    def human(v: dict[str, Any]) -> None:
        state = "deleted" if ctx.args.wait and TARGETS[verb] is None else v["state"]
        where = f" on {v['sled_id']}" if state == "running" and v.get("sled_id") else ""
        took = f" ({time.monotonic() - ctx.started:.1f}s)" if ctx.args.wait else ""
        print(f"{ref}: {state}{where}{took}")

    ctx.emit(final, human)


for _verb, _target in TARGETS.items():
    command(
        f"instance {_verb}",
        f"{_verb} an instance" + (f" (--wait: until {_target})" if _target else " (--wait: until gone)"),
        instance_arg,
        wait_flag,
        json_flag,
    )(functools.partial(instance_action, _verb))


def _migrate_options(p: argparse.ArgumentParser) -> None:
    instance_arg(p)
    p.add_argument(
        "--to", type=sled_name, metavar="SLED_ID", help="the sled to move to (default: the least loaded)"
    )
    wait_flag(p)
    json_flag(p)


@command("instance migrate", "move a running instance to another sled without stopping it", _migrate_options)
async def instance_migrate(ctx: Ctx) -> None:
    ref: Ref = ctx.args.instance
    client = await ctx.client()
    moving = await client.instance_migrate(*ref, to_sled=ctx.args.to)
    final = moving
    if ctx.args.wait:
        final = await _wait_for(ctx, client, ref, moving, "running") or moving
        if final["active_vmm_id"] != moving["migration"]["target_vmm_id"]:
            raise Failure(f"{ref} did not move: {final.get('last_error') or 'no reason recorded'}")

    def human(v: dict[str, Any]) -> None:
        if v["state"] == "migrating":
            m = moving["migration"]
            to = m["target_sled_id"] or "a sled not chosen yet"
            print(f"{ref}: migrating from {m['source_sled_id']} to {to}")
        else:
            print(f"{ref}: {v['state']} on {v['sled_id']} ({time.monotonic() - ctx.started:.1f}s)")

    ctx.emit(final, human)


async def _wait_for(
    ctx: Ctx, client: Client, ref: Ref, view: dict[str, Any], target: str | None
) -> dict[str, Any] | None:
    """Poll the instance until it reaches `target` (or is gone, for None), fails, or the deadline passes.

    Polling `show` rather than following events keeps this correct whatever was missed in between; the
    simulated sleds answer in tens of milliseconds, so the first polls are quick and later ones back off.
    """
    progress = Progress(str(ref), started=ctx.started, enabled=not ctx.args.json)
    state = view["state"]
    polls = 0
    try:
        while True:
            if target is not None:
                if state == target:
                    return view
                _raise_if_failed(ref, view, target)
            remaining = ctx.remaining
            if remaining <= 0:
                goal = target or "gone"
                raise Failure(
                    f"timed out after {ctx.args.timeout:g}s waiting for {ref} to be {goal} (it is {state})"
                )
            progress.update(state)
            if polls:
                await asyncio.sleep(min(0.05 * 1.5**polls, 0.25, remaining))
            polls += 1
            client.timeout = max(min(ctx.args.timeout, ctx.remaining), 0.5)
            try:
                view = await client.instance("show", *ref)
            except bus.CommandError as e:
                if target is None and e.code == "not_found":
                    return None
                raise
            state = view["state"]
    finally:
        progress.clear()


def _raise_if_failed(ref: Ref, view: dict[str, Any], target: str) -> None:
    """Stop waiting when the instance cannot get there by itself: it failed, or its start was undone."""
    error = view.get("last_error")
    if view["state"] == "failed":
        raise Failure(f"{ref} failed: {error or 'no reason recorded'}")
    if target == "running" and view["state"] == "stopped" and error:
        raise Failure(f"{ref} did not start: {error}")


# --- warm pools ------------------------------------------------------------------------------------------


def _pool_create_options(p: argparse.ArgumentParser) -> None:
    pool_arg(p)
    p.add_argument("--size", type=count, metavar="N", required=True, help="how many idle VMs to keep booted")
    p.add_argument("--cpus", type=count, metavar="N", required=True, help="vCPUs of each VM")
    p.add_argument("--ram", type=size, metavar="SIZE", required=True, help="RAM of each VM, e.g. 4GiB")
    p.add_argument(
        "--disk", type=size, metavar="SIZE", required=True, help="boot disk of each VM, e.g. 10GiB"
    )


@command(
    "pool create",
    "create a warm pool: SIZE VMs of one shape kept booted in the project, each handed to one customer",
    _pool_create_options,
    json_flag,
)
async def pool_create(ctx: Ctx) -> None:
    a, ref = ctx.args, ctx.args.pool
    body = _validated(
        PoolCreate,
        {"size": "--size", **_SHAPE_OPTIONS},
        silo=ref.silo,
        project=ref.project,
        name=ref.name,
        size=a.size,
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.disk,
    )
    data = await (await ctx.client()).send(body)
    ctx.emit(data, lambda v: print(f"created pool {ref}: {_vms(v['target_size'])} of {_shape(v)}"))


@command("pool show", "show one warm pool: its shape, target size, and its VMs by state", pool_arg, json_flag)
async def pool_show(ctx: Ctx) -> None:
    ctx.emit(await (await ctx.client()).pool("show", *ctx.args.pool), _print_pool)


@command("pool list", "list the warm pools of the fleet, a silo or a project", scope_args, json_flag)
async def pool_list(ctx: Ctx) -> None:
    silo, project = _scope(ctx.args)

    def human(pools: list[dict[str, Any]]) -> None:
        rows = [
            (
                _ref(v),
                v["vcpus"],
                format_size(v["ram_bytes"]),
                format_size(v["disk_bytes"]),
                v["target_size"],
                v["idle"],
                v["provisioning"],
                v["handed_out"],
            )
            for v in pools
        ]
        headers = ("POOL", "VCPUS", "RAM", "DISK", "TARGET", "IDLE", "PROVISIONING", "HANDED OUT")
        print_table(headers, rows)

    ctx.emit(await (await ctx.client()).pool_list(silo, project), human)


def _pool_resize_options(p: argparse.ArgumentParser) -> None:
    pool_arg(p)
    p.add_argument("--size", type=count, metavar="N", required=True, help="the new number of idle VMs")


@command(
    "pool resize",
    "change how many idle VMs a warm pool keeps (it boots or retires VMs to match)",
    _pool_resize_options,
    json_flag,
)
async def pool_resize(ctx: Ctx) -> None:
    ref = ctx.args.pool
    body = _validated(
        PoolResize, {"size": "--size"}, silo=ref.silo, project=ref.project, name=ref.name, size=ctx.args.size
    )
    data = await (await ctx.client()).pool("resize", *ref, size=body.size)
    ctx.emit(data, lambda v: print(f"resized pool {ref}: target {_vms(v['target_size'])} ({_counts(v)})"))


@command(
    "pool delete",
    "delete a warm pool: its idle VMs are retired; the instances it handed out stay",
    pool_arg,
    json_flag,
)
async def pool_delete(ctx: Ctx) -> None:
    ref = ctx.args.pool
    data = await (await ctx.client()).pool("delete", *ref)

    def human(v: dict[str, Any]) -> None:
        kept = v["handed_out"]
        stay = "instance it handed out stays" if kept == 1 else "instances it handed out stay"
        print(f"deleted pool {ref}: its idle VMs are retired; the {kept} {stay}")

    ctx.emit(data, human)


def _print_pool(v: dict[str, Any]) -> None:
    print_fields(
        [
            ("pool", _ref(v)),
            ("id", v["id"]),
            ("state", f"{v['state']} (generation {v['generation']})"),
            ("shape", _shape(v)),
            ("target size", v["target_size"]),
            ("idle", v["idle"]),
            ("provisioning", v["provisioning"]),
            ("handed out", v["handed_out"]),
        ]
    )


def _vms(n: int) -> str:
    return f"{n} VM" + ("" if n == 1 else "s")


def _counts(v: dict[str, Any]) -> str:
    return f"{v['idle']} idle, {v['provisioning']} provisioning, {v['handed_out']} handed out"


# --- fleet -----------------------------------------------------------------------------------------------


@command("sled list", "list sleds, their capacity and what is reserved on them", json_flag)
async def sled_list(ctx: Ctx) -> None:
    def human(sleds: list[dict[str, Any]]) -> None:
        rows = [
            (
                s["id"],
                s["state"],
                f"{s['reserved_vcpus']}/{s['vcpus']}",
                f"{format_size(s['reserved_ram_bytes'])} / {format_size(s['ram_bytes'])}",
                s["vmms"],
                _ago(s.get("last_seen_at")),
            )
            for s in sleds
        ]
        print_table(("SLED", "STATE", "VCPUS USED", "RAM USED", "VMMS", "LAST SEEN"), rows)

    ctx.emit(await (await ctx.client()).sled_list(), human)


def _expunge_options(p: argparse.ArgumentParser) -> None:
    sled_arg(p)
    p.add_argument("--yes", action="store_true", help="confirm: expunging a sled cannot be undone")


@command(
    "sled expunge",
    "take a sled out of the rack for good: it is never used again and its instances fail "
    "(and restart elsewhere by policy); irreversible, so it needs --yes",
    _expunge_options,
    json_flag,
)
async def sled_expunge(ctx: Ctx) -> None:
    sled = ctx.args.sled
    if not ctx.args.yes:
        raise Unconfirmed(
            f"refusing to expunge {sled} without --yes: expunging is irreversible "
            "(the sled is never used again and its instances fail)"
        )

    def human(d: dict[str, Any]) -> None:
        n = d.get("vmms_failed", 0)
        print(f"expunged {d['id']}: {n} VMM{'' if n == 1 else 's'} failed; it will never be used again")

    ctx.emit(await (await ctx.client()).sled_expunge(sled), human)


# --- the simulator (testing only) ------------------------------------------------------------------------


@command(
    "sim sled list",
    "list simulated sleds: boot number and id, VMMs, frozen or partitioned, faults",
    json_flag,
)
async def sim_sled_list(ctx: Ctx) -> None:
    def human(sleds: list[dict[str, Any]]) -> None:
        rows = [
            (
                s["sled_id"],
                _sim_state(s),
                s.get("boot_number"),
                s.get("boot_id"),
                s["vcpus"],
                format_size(s["ram_bytes"]),
                s["vmms"],
                _faults_text(s.get("faults")),
            )
            for s in sleds
        ]
        print_table(("SLED", "STATE", "BOOT", "BOOT ID", "VCPUS", "RAM", "VMMS", "FAULTS"), rows)

    ctx.emit(await (await ctx.client()).sim_sled("list"), human)


def _sim_add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", type=count, metavar="N", help="vCPUs (default: 64)")
    p.add_argument("--ram", type=size, metavar="SIZE", help="RAM, e.g. 256GiB (default: 256GiB)")


@command("sim sled add", "add a simulated sled (it joins the rack at once)", _sim_add_options, json_flag)
async def sim_sled_add(ctx: Ctx) -> None:
    given = {"vcpus": ctx.args.cpus, "ram_bytes": ctx.args.ram}
    body = _validated(
        SimSledAdd,
        {"vcpus": "--cpus", "ram_bytes": "--ram"},
        **{k: v for k, v in given.items() if v is not None},
    )
    data = await (await ctx.client()).sim_sled("add", vcpus=body.vcpus, ram_bytes=body.ram_bytes)
    ctx.emit(
        data,
        lambda d: print(
            f"added {d['sled_id']}: {d['vcpus']} vCPUs, {format_size(d['ram_bytes'])} RAM "
            f"(boot id {d['boot_id']})"
        ),
    )


SIM_VERBS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "reboot": (
        "reboot a simulated sled: its VMMs are lost and it comes back on its next boot",
        lambda d: f"rebooted {d['sled_id']}: boot {d['boot_number']} (boot id {d['boot_id']})",
    ),
    "freeze": (
        "freeze a simulated sled: no inventory, reports or commands until thawed",
        lambda d: f"froze {d['sled_id']}: it answers nothing until thawed",
    ),
    "thaw": ("thaw a frozen simulated sled", lambda d: f"thawed {d['sled_id']}"),
    "partition": (
        "cut a simulated sled off the network until healed: nothing goes in or out, its VMMs go on running",
        lambda d: f"partitioned {d['sled_id']}: cut off until healed (its VMMs go on running)",
    ),
    "heal": ("end a simulated sled's partition", lambda d: f"healed {d['sled_id']}"),
    "remove": (
        "remove a sled from the simulator (the control plane still lists it: expunge it there)",
        lambda d: f"removed {d['sled_id']} from the simulator",
    ),
}
"""Simulator verbs that act on one sled: their help and what they print."""


async def sim_sled_action(verb: str, ctx: Ctx) -> None:
    data = await (await ctx.client()).sim_sled(verb, ctx.args.sled)
    ctx.emit(data, lambda d: print(SIM_VERBS[verb][1](d)))


for _verb, (_help, _) in SIM_VERBS.items():
    command(f"sim sled {_verb}", _help, sled_arg, json_flag)(functools.partial(sim_sled_action, _verb))


def _faults_options(p: argparse.ArgumentParser) -> None:
    sled_arg(p)
    p.add_argument(
        "--delay-state",
        choices=[s.value for s in VmmState],
        help="delay only reports of this VMM state (default: any state)",
    )
    p.add_argument("--delay-seconds", type=seconds, metavar="S", help="how long to hold each delayed report")
    p.add_argument("--delay-count", type=count, metavar="N", help="how many reports to delay")
    p.add_argument("--duplicate", type=count, metavar="N", help="send every report N extra times")
    p.add_argument("--drop-probability", type=probability, metavar="P", help="drop reports with chance P")
    p.add_argument(
        "--drop-commands", action="store_true", help="take commands but never act on them (no start/stop)"
    )
    p.add_argument("--fail-starts", action="store_true", help="every VMM that boots fails at once")


_FAULT_OPTIONS = {
    "delay_state": "--delay-state",
    "delay_seconds": "--delay-seconds",
    "delay_count": "--delay-count",
    "duplicate": "--duplicate",
    "drop_probability": "--drop-probability",
    "drop_commands": "--drop-commands",
    "fail_starts": "--fail-starts",
}


@command(
    "sim faults",
    "set the faults a simulated sled injects, replacing its current ones; with no fault options, clear them",
    _faults_options,
    json_flag,
)
async def sim_faults(ctx: Ctx) -> None:
    a = ctx.args
    if (a.delay_state is not None or a.delay_seconds is not None) and not a.delay_count:
        raise UsageError("--delay-state and --delay-seconds need --delay-count (how many reports to delay)")
    if a.delay_count and a.delay_seconds is None:
        raise UsageError("--delay-count needs --delay-seconds (how long to hold each report)")
    given = {key: getattr(a, key) for key in _FAULT_OPTIONS}
    faults = _validated(
        SimFaults,
        _FAULT_OPTIONS,
        sled_id=a.sled,
        **{k: v for k, v in given.items() if v not in (None, False)},
    )
    data = await (await ctx.client()).sim_faults(faults)

    def human(d: dict[str, Any]) -> None:
        text = _faults_text(d.get("faults"))
        print(f"{d['sled_id']}: faults {'cleared' if text is None else 'set: ' + text}")

    ctx.emit(data, human)


def _sim_state(s: dict[str, Any]) -> str:
    """`up`, or why the sled is silent: `frozen`, `partitioned` (or both: `frozen,partitioned`)."""
    silent = [state for state in ("frozen", "partitioned") if s.get(state)]
    return ",".join(silent) or "up"


def _faults_text(f: dict[str, Any] | None) -> str | None:
    """The faults a sled injects, in a few words; None when it injects none."""
    if not f:
        return None
    parts = []
    if f.get("delay_count"):
        which = f"{f['delay_state']} reports" if f.get("delay_state") else "reports"
        parts.append(f"delay next {f['delay_count']} {which} by {f.get('delay_seconds', 0):g}s")
    if f.get("duplicate"):
        parts.append(f"duplicate reports x{f['duplicate']}")
    if f.get("drop_probability"):
        parts.append(f"drop {f['drop_probability']:.0%} of reports")
    if f.get("drop_commands"):
        parts.append("drop commands")
    if f.get("fail_starts"):
        parts.append("fail starts")
    return ", ".join(parts) or None


@command(
    "usage",
    "resource usage of the fleet, a silo or a project, against quotas",
    lambda p: scope_args(p, exclusive=True),
    json_flag,
)
async def usage(ctx: Ctx) -> None:
    silo, project = _scope(ctx.args)

    def human(u: dict[str, Any]) -> None:
        used, quota = u["usage"], u.get("quota") or {}
        print(f"{u['scope']} {u['name']}" if u["scope"] != "fleet" else "fleet")
        print_table(
            ("", "USED", "QUOTA"),
            [
                (label, fmt(used[key]), None if quota.get(key) is None else fmt(quota[key]))
                for label, key, fmt in _RESOURCES
            ],
        )
        if u.get("children"):
            print()
            child = "SILO" if u["scope"] == "fleet" else "PROJECT"
            rows = [
                (c["name"], *(_used_of(c["usage"], c.get("quota"), key, fmt) for _, key, fmt in _RESOURCES))
                for c in u["children"]
            ]
            print_table((child, "VCPUS", "RAM", "STORAGE"), rows)

    ctx.emit(await (await ctx.client()).usage(silo, project), human)


_RESOURCES: tuple[tuple[str, str, Callable[[int], str]], ...] = (
    ("vCPUs", "vcpus", str),
    ("RAM", "ram_bytes", format_size),
    ("storage", "disk_bytes", format_size),
)


# --- fault injection and the invariant checker (testing and operations) ----------------------------------


def _chaos_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "service",
        choices=[*subjects.SERVICES, "status"],
        metavar="SERVICE",
        help=f"{', '.join(subjects.SERVICES)}; or `status`: the faults of every service",
    )
    delay = p.add_mutually_exclusive_group()
    delay.add_argument("--delay", type=duration, metavar="S", help="hold each outgoing message S seconds")
    delay.add_argument(
        "--delay-range",
        type=duration,
        nargs=2,
        metavar=("A", "B"),
        help="hold each outgoing message a random time from A to B seconds",
    )
    p.add_argument("--duplicate", type=count, metavar="N", help="send each outgoing message N more times")
    p.add_argument(
        "--bypass-dedupe",
        action="store_true",
        help="give each copy its own message id, so the consumers (not the broker) must drop it",
    )
    p.add_argument(
        "--reorder-window",
        type=count,
        metavar="W",
        help="hold up to W outgoing messages, release them shuffled",
    )
    p.add_argument(
        "--drop-first-attempt",
        action=argparse.BooleanOptionalAction,
        help="fail the first publish of each message, so that the sender's retry is what arrives",
    )
    p.add_argument(
        "--hold-acks",
        type=probability,
        metavar="P",
        help="leave each handled message unacked with chance P: JetStream redelivers it after its ack wait",
    )
    p.add_argument(
        "--hold-acks-count", type=count, metavar="K", help="leave the next K handled messages unacked"
    )
    p.add_argument(
        "--slow-handler",
        type=duration,
        metavar="S",
        help="sleep S seconds before handling each first delivery (longer than the ack wait: a redelivery "
        "arrives while it runs)",
    )
    p.add_argument(
        "--only",
        nargs="*",
        metavar="PREFIX",
        help="apply the faults only to subjects starting with one of these, e.g. rp.acct.delta. "
        "(with no prefix: every subject again)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="seed the random choices, for a repeatable run")
    p.add_argument("--clear", action="store_true", help="remove every fault first (alone: turn them all off)")


_CHAOS_OPTIONS = {
    "delay": "--delay",
    "duplicate": "--duplicate",
    "reorder": "--reorder-window",
    "drop_first_attempt": "--drop-first-attempt",
    "hold_acks": "--hold-acks",
    "slow_handler_seconds": "--slow-handler",
    "only": "--only",
    "seed": "--seed",
}


def _chaos_request(a: argparse.Namespace) -> ServiceFaults:
    """The `rp.svc.faults` body the options ask for; no option at all reads the faults and changes nothing."""
    fields: dict[str, Any] = {"clear": a.clear}
    if a.delay is not None:
        fields["delay"] = {"min_seconds": a.delay, "max_seconds": a.delay}
    elif a.delay_range is not None:
        fields["delay"] = {"min_seconds": a.delay_range[0], "max_seconds": a.delay_range[1]}
    if a.bypass_dedupe and not a.duplicate:
        raise UsageError("--bypass-dedupe needs --duplicate N (how many copies to send)")
    if a.duplicate is not None:
        fields["duplicate"] = {"copies": a.duplicate, "bypass_dedupe": a.bypass_dedupe}
    if a.reorder_window is not None:
        fields["reorder"] = {"window": a.reorder_window}
    if a.hold_acks is not None or a.hold_acks_count is not None:
        fields["hold_acks"] = {"probability": a.hold_acks or 0, "count": a.hold_acks_count or 0}
    given = {
        "drop_first_attempt": a.drop_first_attempt,
        "slow_handler_seconds": a.slow_handler,
        "only": a.only,
        "seed": a.seed,
    }
    fields.update({k: v for k, v in given.items() if v is not None})
    return _validated(ServiceFaults, _CHAOS_OPTIONS, **fields)


@command(
    "chaos",
    "inject faults into one service's messages (delay, duplicate, reorder, drop, hold acks, slow handler); "
    "the options given replace those faults, the others stay; with none, show them (testing only)",
    _chaos_options,
    json_flag,
)
async def chaos(ctx: Ctx) -> None:
    a = ctx.args
    body = _chaos_request(a)
    if a.service == "status" and body != ServiceFaults():
        raise UsageError("chaos status only shows the faults: set them with rackctl chaos SERVICE ...")
    client = await ctx.client()
    if a.service == "status":

        def table(replies: list[dict[str, Any]]) -> None:
            rows = [
                (
                    r["service"],
                    f"no answer ({r['error']})" if "error" in r else _chaos_text(r["faults"]) or "none",
                    _injected_text(r.get("counters") or {}),
                )
                for r in replies
            ]
            print_table(("SERVICE", "FAULTS", "INJECTED"), rows)

        ctx.emit(await client.faults_status(timeout=min(ctx.args.timeout, 2.0)), table)
        return

    def human(d: dict[str, Any]) -> None:
        text = _chaos_text(d["faults"])
        print(f"{d['service']}: {'no faults' if text is None else 'faults: ' + text}")
        if d.get("counters"):
            print(f"injected so far: {_injected_text(d['counters'])}")

    try:
        reply = await client.faults(a.service, body)
    except bus.CommandError as e:
        if e.code in ("forbidden", "unavailable"):
            raise Failure(f"{a.service}: {FAULTS_OFF} ({e.message})") from None
        raise
    ctx.emit(reply, human)


FAULTS_OFF = (
    "fault injection refused or off: the services take it only from the test identity, and only when "
    "started with it enabled (make run FAULTS=1)"
)


def _chaos_text(f: dict[str, Any]) -> str | None:
    """A service's faults in a few words; None when it injects none."""
    parts = []
    if (d := f.get("delay")) and d["max_seconds"]:
        same = d["min_seconds"] == d["max_seconds"]
        parts.append(
            f"delay {d['max_seconds']:g}s" if same else f"delay {d['min_seconds']:g}-{d['max_seconds']:g}s"
        )
    if (dup := f.get("duplicate")) and dup["copies"]:
        parts.append(f"duplicate x{dup['copies']}" + (" (own ids)" if dup["bypass_dedupe"] else ""))
    if (r := f.get("reorder")) and r["window"]:
        parts.append(f"reorder within {r['window']} ({r['max_hold_seconds']:g}s)")
    if f.get("drop_first_attempt"):
        parts.append("drop first attempts")
    if (h := f.get("hold_acks")) and (h["count"] or h["probability"]):
        held = [f"next {h['count']}"] if h["count"] else []
        held += [f"{h['probability']:.0%}"] if h["probability"] else []
        parts.append(f"hold acks ({', '.join(held)})")
    if f.get("slow_handler_seconds"):
        parts.append(f"slow handler {f['slow_handler_seconds']:g}s")
    if parts and f.get("only"):
        parts.append(f"only {' '.join(f['only'])}")
    return ", ".join(parts) or None


def _injected_text(counters: dict[str, int]) -> str | None:
    return ", ".join(f"{k.removeprefix('faults.')} {v}" for k, v in sorted(counters.items())) or None


def _check_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        metavar="URL",
        default=None,
        help="the database (default: $DATABASE_URL, else the read-only login `make run` wrote under "
        "$RACKPLANE_HOME, default .rackplane)",
    )
    p.add_argument(
        "--at-rest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also check what holds only once the system is quiet, the broker's consumers and the sleds' "
        "VMMs included (default); --no-at-rest: only what always holds, from the database alone",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="at rest, while work is in flight (a saga, a message not yet consumed), check again each second "
        "for up to this long before reporting what still fails (default 30; 0: the first look)",
    )


@command(
    "check",
    "check rackplane's invariants against its database (and, at rest, its broker): exit 0 when they all "
    "hold, 1 with one line per violation",
    _check_options,
    json_flag,
)
async def check_invariants(ctx: Ctx) -> None:
    a = ctx.args
    within = min(CONNECT_TIMEOUT, a.timeout)
    try:
        conn = await asyncio.wait_for(asyncpg.connect(a.database_url or check_database_url()), within)
    except TimeoutError:
        raise ConnectionError(f"cannot reach the database within {within:g}s") from None
    except (OSError, asyncpg.PostgresError) as e:
        raise ConnectionError(f"cannot reach the database: {type(e).__name__}: {e}") from None
    js: JetStreamContext | None = None
    nc = None
    violations: list[str] = []
    try:
        if a.at_rest:
            try:
                nc = (await ctx.client()).nc
                js = nc.jetstream()
            except ConnectionError as e:
                violations.append(f"broker checks not run: {e}")
        violations += await _settled(conn, a.at_rest, js, nc, a.settle)
    finally:
        await conn.close()
    checks = checker.names(at_rest=a.at_rest, broker=js is not None)
    data = {"ok": not violations, "at_rest": a.at_rest, "checks": checks, "violations": violations}

    def human(d: dict[str, Any]) -> None:
        for line in d["violations"]:
            print(line)
        if d["ok"]:
            print(f"ok: {len(d['checks'])} checks, every invariant holds")

    ctx.emit(data, human)
    if violations:
        raise Failure(f"{len(violations)} invariant violation{'' if len(violations) == 1 else 's'}")


async def _settled(conn: asyncpg.Connection, at_rest: bool, js: Any, nc: Any, settle: float) -> list[str]:
    """The checker's findings once they hold still: an at-rest check fails while work is in flight (a
    delete's saga, an event on its way), so what fails is looked at again until it passes or `settle`
    seconds have gone by; a violation that lasts that long is reported. Without --at-rest, one look."""
    deadline = time.monotonic() + (settle if at_rest else 0)
    progress = Progress("check", out=sys.stderr)
    try:
        while True:
            found = await checker.check(conn, at_rest=at_rest, js=js, nc=nc)
            left = deadline - time.monotonic()
            if not found or left <= 0:
                return found
            progress.update(f"{len(found)} not passing yet, looking again for {left:.0f}s more")
            await asyncio.sleep(min(1.0, left))
    finally:
        progress.clear()


# --- helpers ---------------------------------------------------------------------------------------------


def _validated(model: type[M], options: dict[str, str], **fields: Any) -> M:
    """Build the request here, so that an out-of-range value is a usage error naming the option."""
    try:
        return model(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "request"
        option = options.get(name, name)
        bounds = err.get("ctx") or {}
        show = format_size if name.endswith("_bytes") else str
        if "ge" in bounds:
            raise UsageError(f"{option} must be at least {show(bounds['ge'])}") from None
        if "le" in bounds:
            raise UsageError(f"{option} must be at most {show(bounds['le'])}") from None
        raise UsageError(f"{option}: {err['msg']}") from None


def _scope(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(silo, project) from --silo and --project; --project names its silo, which must agree."""
    silo: str | None = args.silo
    if args.project is None:
        return silo, None
    p_silo, project = args.project
    if silo is not None and silo != p_silo:
        raise UsageError(f"--silo {silo} and --project {p_silo}/{project} name different silos")
    return p_silo, project


def _ref(v: dict[str, Any]) -> str:
    return f"{v['silo']}/{v['project']}/{v['name']}"


def _shape(v: dict[str, Any]) -> str:
    cpus = f"{v['vcpus']} vCPU" + ("" if v["vcpus"] == 1 else "s")
    return f"{cpus}, {format_size(v['ram_bytes'])} RAM, {format_size(v['disk_bytes'])} disk"


def _state_where(v: dict[str, Any]) -> str:
    """`running on sled-2`, or the state alone when it does not run anywhere (yet)."""
    return f"running on {v['sled_id']}" if v["state"] == "running" and v.get("sled_id") else v["state"]


def _size_or_none(n: int | None) -> str | None:
    return None if n is None else format_size(n)


def _used_of(used: dict[str, int], quota: dict[str, Any] | None, key: str, fmt: Callable[[int], str]) -> str:
    limit = (quota or {}).get(key)
    return fmt(used[key]) if limit is None else f"{fmt(used[key])} / {fmt(limit)}"


def _ago(timestamp: str | None) -> str | None:
    if not timestamp:
        return None
    try:
        age = datetime.now(UTC) - datetime.fromisoformat(timestamp)
    except ValueError:
        return timestamp
    return f"{max(age.total_seconds(), 0):.0f}s ago"


def _when(timestamp: str | None) -> str | None:
    """A timestamp, and how far it is from now: `2024-05-01T10:00:00+00:00 (12s ago)`, or `(in 3s)`."""
    if not timestamp:
        return None
    try:
        delta = (datetime.fromisoformat(timestamp) - datetime.now(UTC)).total_seconds()
    except ValueError:
        return timestamp
    return f"{timestamp} ({f'in {delta:.0f}s' if delta >= 0.5 else f'{-delta:.0f}s ago'})"


def _print_instance(v: dict[str, Any]) -> None:
    """Every field of the view; the recovery ones only when they say something (no error, no restart...)."""
    restarts = v.get("auto_restarts") or None
    fields: list[tuple[str, Any, bool]] = [  # (label, value, shown even when empty)
        ("instance", _ref(v), True),
        ("id", v["id"], True),
        ("state", f"{v['state']} (generation {v['generation']})", True),
        ("intended state", v.get("intended_state"), False),
        ("health", v.get("health"), False),
        ("vcpus", v["vcpus"], True),
        ("ram", format_size(v["ram_bytes"]), True),
        ("disk", format_size(v["disk_bytes"]), True),
        ("auto-restart", v["auto_restart"], True),
        ("pool", _pool_of(v), False),
        ("has customer data since", _when(v.get("has_customer_data_at")), False),
        ("auto-restarts", restarts, False),
        ("last auto-restart", _when(v.get("last_auto_restart_at")), False),
        ("next restart", _when(v.get("next_restart_at")), False),
        ("sled", v.get("sled_id"), True),
        ("vmm", v.get("active_vmm_id"), True),
        ("moving to", v.get("target_sled_id"), False),
        ("target vmm", v.get("target_vmm_id"), False),
        ("last error", v.get("last_error"), False),
        ("failed at", _when(v.get("failed_at")), False),
        ("updated", v.get("updated_at"), True),
    ]
    print_fields([(label, value) for label, value, always in fields if always or value not in (None, "")])


def _pool_of(v: dict[str, Any]) -> str | None:
    """The pool a VM came from, as a path; a VM still in its pool (not handed out) says so."""
    if not v.get("pool"):
        return None
    waiting = "" if v.get("has_customer_data_at") else " (not handed out)"
    return f"{v['silo']}/{v['project']}/{v['pool']}{waiting}"


# --- parser and entry point ------------------------------------------------------------------------------


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """On the top parser with defaults; on every command too (suppressed defaults), so both orders work."""
    p.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("NATS_URL") or None if defaults else argparse.SUPPRESS,
        help=f"NATS server (default: $NATS_URL, else the context's, else {DEFAULT_NATS_URL})",
    )
    p.add_argument(
        "--context",
        metavar="NAME",
        default=None if defaults else argparse.SUPPRESS,
        help="whose credential to use: a context name or file (default: $RACKCTL_CONTEXT, else the "
        "`default` context that make run writes; see docs/security.md)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        default=DEFAULT_TIMEOUT if defaults else argparse.SUPPRESS,
        help="how long to wait for a reply, and with --wait for the target state "
        f"(default {DEFAULT_TIMEOUT:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Operate a rackplane control plane.")
    _global_options(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    subs = {(): parser.add_subparsers(title="commands", metavar="COMMAND", required=True)}
    for words, cmd in COMMANDS.items():
        for i in range(1, len(words)):
            if words[:i] not in subs:
                about = GROUPS.get(" ".join(words[:i]))
                group = subs[words[: i - 1]].add_parser(words[i - 1], help=about, description=about)
                subs[words[:i]] = group.add_subparsers(metavar="COMMAND", required=True)
        leaf = subs[words[:-1]].add_parser(words[-1], help=cmd.help, description=cmd.help, parents=[common])
        for add in cmd.options:
            add(leaf)
        leaf.set_defaults(command=cmd, parser=leaf)
    return parser


async def run(cmd: Command, args: argparse.Namespace) -> None:
    """One command, as one trace: the client carries this span's context to every service it reaches."""
    ctx = Ctx(args)
    with telemetry.span(f"{PROG} {' '.join(cmd.words)}"):
        try:
            await cmd.run(ctx)
        finally:
            await ctx.close()


def main(argv: list[str] | None = None) -> NoReturn:
    _setup_logging()
    args = build_parser().parse_args(argv)
    try:
        telemetry.setup_tracing(PROG)
    except ValueError as e:
        _exit_error(str(e))
    code = 0
    try:
        asyncio.run(run(args.command, args))
    except UsageError as e:
        args.parser.error(str(e))
    except Unconfirmed as e:
        _report(str(e))
        code = 2
    except BrokenPipeError:  # stdout closed early (`rackctl ... | head`): not an error worth a line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    except (bus.CommandError, Failure, ConnectionError) as e:
        code = _report(str(e))
    except nats.errors.Error as e:
        code = _report(f"nats: {e}")
    except KeyboardInterrupt:
        code = 130
    finally:
        telemetry.shutdown_tracing()
    sys.exit(code)


def _report(message: str) -> int:
    """One line on stderr, whatever the message holds."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


def _exit_error(message: str) -> NoReturn:
    sys.exit(_report(message))


def _setup_logging() -> None:
    level = os.environ.get("RACKCTL_LOG")
    if level:
        logging.basicConfig(level=level.upper(), format=f"{PROG}: %(levelname)s %(name)s: %(message)s")
    else:  # without a handler, Python would print library warnings (nats reconnects) to stderr
        logging.getLogger().addHandler(logging.NullHandler())


if __name__ == "__main__":
    main()
