"""`rackctl instance`: create, inspect, start, stop, migrate and delete VM instances.

`--wait` polls `show` until the target state, so a script gets exit 0 only once the instance is there.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime
from typing import Any

from rackctl.client import Client
from rackctl.commands.args import (
    Ref,
    count,
    instance_arg,
    json_flag,
    pool_path,
    scope,
    scope_args,
    size,
    sled_name,
    wait_flag,
)
from rackctl.commands.base import (
    SHAPE_OPTIONS,
    Failure,
    Invocation,
    UsageError,
    command,
    emit_pages,
    group,
    shape_text,
    validated,
    view_path,
)
from rackctl.output import Progress, print_fields
from rackctl.sizes import format_size
from shared import bus
from shared.messages import AutoRestart, InstanceCreate, InstanceList

group("instance", "VM instances: create, start, stop, migrate, delete, inspect")


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


@command(
    "instance create",
    "create a (stopped) instance; with --from-pool, take a running VM from a warm pool",
    _create_options,
    json_flag,
    examples=(
        "rackctl instance create acme/web/frontend --cpus 4 --ram 8GiB --disk 40GiB",
        "rackctl instance create acme/web/batch --cpus 2 --ram 4GiB --disk 10GiB --auto-restart never",
        "rackctl instance create acme/web/checkout --from-pool acme/web/warm  # running at once",
    ),
)
async def instance_create(ctx: Invocation) -> None:
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
    body = validated(
        InstanceCreate,
        SHAPE_OPTIONS,
        silo=ref.silo,
        project=ref.project,
        name=ref.name,
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.disk,
        auto_restart=a.auto_restart,
    )
    data = await (await ctx.client()).send(body)
    ctx.emit(data, lambda v: print(f"created instance {ref}: {shape_text(v)} ({v['state']})"))


async def _instance_from_pool(ctx: Invocation, shape_given: list[str]) -> None:
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
            print(f"created instance {ref}: {shape_text(v)} ({_state_where(v)})")
        if v.get("note"):
            print(f"note: {v['note']}")

    ctx.emit(data, human)


@command(
    "instance show",
    "show one instance",
    instance_arg,
    json_flag,
    examples=(
        "rackctl instance show acme/web/frontend",
        "rackctl instance show acme/web/frontend --json",
    ),
)
async def instance_show(ctx: Invocation) -> None:
    ctx.emit(await (await ctx.client()).instance("show", *ctx.args.instance), _print_instance)


@command(
    "instance list",
    "list instances of the fleet, a silo or a project",
    scope_args,
    json_flag,
    examples=(
        "rackctl instance list  # the whole fleet",
        "rackctl instance list --project acme/web",
    ),
)
async def instance_list(ctx: Invocation) -> None:
    silo, project = scope(ctx.args)

    def row(v: dict[str, Any]) -> tuple[Any, ...]:
        return (
            view_path(v),
            v["state"],
            v.get("health"),
            v["vcpus"],
            format_size(v["ram_bytes"]),
            format_size(v["disk_bytes"]),
            v["sled_id"],
        )

    headers = ("INSTANCE", "STATE", "HEALTH", "VCPUS", "RAM", "DISK", "SLED")
    await emit_pages(ctx, InstanceList(silo=silo, project=project), headers, row)


async def instance_action(ctx: Invocation, verb: str, target: str | None) -> None:
    """start, stop or delete; with --wait, only return once the instance got to `target` (None: gone)."""
    ref: Ref = ctx.args.instance
    client = await ctx.client()
    data = await client.instance(verb, *ref)
    final = data
    if ctx.args.wait:
        final = await _wait_for(ctx, client, ref, data, target) or data

    def human(v: dict[str, Any]) -> None:
        state = "deleted" if ctx.args.wait and target is None else v["state"]
        where = f" on {v['sled_id']}" if state == "running" and v.get("sled_id") else ""
        took = f" ({time.monotonic() - ctx.started:.1f}s)" if ctx.args.wait else ""
        print(f"{ref}: {state}{where}{took}")

    ctx.emit(final, human)


@command(
    "instance start",
    "start an instance (--wait: until running)",
    instance_arg,
    wait_flag,
    json_flag,
    examples=(
        "rackctl instance start acme/web/frontend",
        "rackctl instance start acme/web/frontend --wait --timeout 120  # until it is running, for up to 2 "
        "minutes",
    ),
)
async def instance_start(ctx: Invocation) -> None:
    await instance_action(ctx, "start", "running")


@command(
    "instance stop",
    "stop an instance (--wait: until stopped)",
    instance_arg,
    wait_flag,
    json_flag,
    examples=(
        "rackctl instance stop acme/web/frontend",
        "rackctl instance stop acme/web/frontend --wait --timeout 120  # until it is stopped, for up to 2 "
        "minutes",
    ),
)
async def instance_stop(ctx: Invocation) -> None:
    await instance_action(ctx, "stop", "stopped")


@command(
    "instance delete",
    "delete an instance (--wait: until gone)",
    instance_arg,
    wait_flag,
    json_flag,
    examples=(
        "rackctl instance delete acme/web/frontend",
        "rackctl instance delete acme/web/frontend --wait --timeout 120  # until it is gone",
    ),
)
async def instance_delete(ctx: Invocation) -> None:
    await instance_action(ctx, "delete", None)


def _migrate_options(p: argparse.ArgumentParser) -> None:
    instance_arg(p)
    p.add_argument(
        "--to", type=sled_name, metavar="SLED_ID", help="the sled to move to (default: the least loaded)"
    )
    wait_flag(p)
    json_flag(p)


@command(
    "instance migrate",
    "move a running instance to another sled without stopping it",
    _migrate_options,
    examples=(
        "rackctl instance migrate acme/web/frontend --wait  # to the least loaded sled",
        "rackctl instance migrate acme/web/frontend --to sled-3",
    ),
)
async def instance_migrate(ctx: Invocation) -> None:
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
    ctx: Invocation, client: Client, ref: Ref, view: dict[str, Any], target: str | None
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


# --- how an instance is shown ----------------------------------------------------------------------------


def _state_where(v: dict[str, Any]) -> str:
    """`running on sled-2`, or the state alone when it does not run anywhere (yet)."""
    return f"running on {v['sled_id']}" if v["state"] == "running" and v.get("sled_id") else v["state"]


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
        ("instance", view_path(v), True),
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
