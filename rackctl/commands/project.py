"""`rackctl project`: the projects inside a silo: create, list, delete."""

from __future__ import annotations

from typing import Any

from rackctl.commands.args import json_flag, project_path, silo_path
from rackctl.commands.base import Invocation, command, group
from rackctl.output import print_table

group("project", "projects inside a silo")


@command(
    "project create",
    "create a project in a silo",
    lambda p: p.add_argument("project", type=project_path, metavar="SILO/PROJECT"),
    json_flag,
    examples=("rackctl project create acme/web",),
)
async def project_create(ctx: Invocation) -> None:
    silo, name = ctx.args.project
    data = await (await ctx.client()).project_create(silo, name)
    ctx.emit(data, lambda d: print(f"created project {d['silo']}/{d['name']}"))


@command(
    "project list",
    "list the projects of a silo",
    lambda p: p.add_argument("silo", type=silo_path, metavar="SILO"),
    json_flag,
    examples=("rackctl project list acme",),
)
async def project_list(ctx: Invocation) -> None:
    def human(projects: list[dict[str, Any]]) -> None:
        print_table(("PROJECT", "ID"), [(f"{p['silo']}/{p['name']}", p["id"]) for p in projects])

    ctx.emit(await (await ctx.client()).project_list(ctx.args.silo), human)


@command(
    "project delete",
    "delete a project that holds no instance and no pool (refused, saying what, while any lives)",
    lambda p: p.add_argument("project", type=project_path, metavar="SILO/PROJECT"),
    json_flag,
    examples=(
        "rackctl project delete acme/web",
        "rackctl project delete acme/web --json",
    ),
)
async def project_delete(ctx: Invocation) -> None:
    silo, name = ctx.args.project
    data = await (await ctx.client()).project_delete(silo, name)
    ctx.emit(data, lambda d: print(f"deleted project {d['silo']}/{d['name']}"))
