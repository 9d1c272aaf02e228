"""`rackctl usage`: what the fleet, a silo or a project uses, against its quota."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rackctl.commands.args import json_flag, scope, scope_args
from rackctl.commands.base import Ctx, command
from rackctl.output import print_table
from rackctl.sizes import format_size


@command(
    "usage",
    "resource usage of the fleet, a silo or a project, against quotas",
    lambda p: scope_args(p, exclusive=True),
    json_flag,
)
async def usage(ctx: Ctx) -> None:
    silo, project = scope(ctx.args)

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


def _used_of(used: dict[str, int], quota: dict[str, Any] | None, key: str, fmt: Callable[[int], str]) -> str:
    limit = (quota or {}).get(key)
    return fmt(used[key]) if limit is None else f"{fmt(used[key])} / {fmt(limit)}"
