"""`rackctl pool`: warm pools, VMs booted ahead and handed to one customer each."""

from __future__ import annotations

import argparse
from typing import Any

from rackctl.commands.args import count, json_flag, pool_arg, scope, scope_args, size
from rackctl.commands.base import SHAPE_OPTIONS, Invocation, command, group, shape_text, validated, view_path
from rackctl.output import print_fields, print_table
from rackctl.sizes import format_size
from shared.messages import PoolCreate, PoolResize

group("pool", "warm pools: VMs booted ahead, handed to one customer each")


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
    examples=("rackctl pool create acme/web/warm --size 2 --cpus 2 --ram 4GiB --disk 20GiB",),
)
async def pool_create(ctx: Invocation) -> None:
    a, ref = ctx.args, ctx.args.pool
    body = validated(
        PoolCreate,
        {"size": "--size", **SHAPE_OPTIONS},
        silo=ref.silo,
        project=ref.project,
        name=ref.name,
        size=a.size,
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.disk,
    )
    data = await (await ctx.client()).send(body)
    ctx.emit(data, lambda v: print(f"created pool {ref}: {_vms(v['target_size'])} of {shape_text(v)}"))


@command(
    "pool show",
    "show one warm pool: its shape, target size, and its VMs by state",
    pool_arg,
    json_flag,
    examples=("rackctl pool show acme/web/warm",),
)
async def pool_show(ctx: Invocation) -> None:
    ctx.emit(await (await ctx.client()).pool("show", *ctx.args.pool), _print_pool)


@command(
    "pool list",
    "list the warm pools of the fleet, a silo or a project",
    scope_args,
    json_flag,
    examples=("rackctl pool list --silo acme",),
)
async def pool_list(ctx: Invocation) -> None:
    silo, project = scope(ctx.args)

    def human(pools: list[dict[str, Any]]) -> None:
        rows = [
            (
                view_path(v),
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
    examples=("rackctl pool resize acme/web/warm --size 5",),
)
async def pool_resize(ctx: Invocation) -> None:
    ref = ctx.args.pool
    body = validated(
        PoolResize, {"size": "--size"}, silo=ref.silo, project=ref.project, name=ref.name, size=ctx.args.size
    )
    data = await (await ctx.client()).pool("resize", *ref, size=body.size)
    ctx.emit(data, lambda v: print(f"resized pool {ref}: target {_vms(v['target_size'])} ({_counts(v)})"))


@command(
    "pool delete",
    "delete a warm pool: its idle VMs are retired; the instances it handed out stay",
    pool_arg,
    json_flag,
    examples=("rackctl pool delete acme/web/warm",),
)
async def pool_delete(ctx: Invocation) -> None:
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
            ("pool", view_path(v)),
            ("id", v["id"]),
            ("state", f"{v['state']} (generation {v['generation']})"),
            ("shape", shape_text(v)),
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
