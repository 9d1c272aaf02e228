"""`rackctl usage`: what the fleet, a silo or a project uses, against its quota; `rackctl usage audit`:
whether those totals and each instance's charge are what they should be (rackctl/audit.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rackctl import audit
from rackctl.commands.args import duration, json_flag, scope, scope_args, scope_path
from rackctl.commands.base import Ctx, Failure, UnknownName, command
from rackctl.commands.database import connect, database_url_option
from rackctl.output import print_table
from rackctl.settle import settled
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


def _audit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scope",
        nargs="?",
        type=scope_path,
        metavar="SCOPE",
        help="SILO or SILO/PROJECT (default: the whole fleet)",
    )
    database_url_option(p)
    p.add_argument(
        "--settle",
        type=duration,
        default=10.0,
        metavar="SECONDS",
        help="while an instance's charge differs from its state (a start or stop on its way), look again "
        "each second for up to this long before reporting it (default 10; 0: the first look)",
    )


@command(
    "usage audit",
    "recompute the usage of the fleet, a silo or a project from its charges, and each instance's charge "
    "from its state: exit 0 when accounting holds what it should, 1 with one line per drift",
    _audit_options,
    json_flag,
)
async def usage_audit(ctx: Ctx) -> None:
    silo, project = ctx.args.scope or (None, None)
    conn = await connect(ctx.args)
    try:
        try:
            where = await audit.resolve(conn, silo, project)
        except audit.UnknownScope as e:
            raise UnknownName(str(e)) from None
        found = await settled(
            lambda: audit.drifts(conn, where),
            ctx.args.settle,
            label="usage audit",
            status=lambda d, left: f"{_count(d)}, waiting for in-flight work for {left:.0f}s more",
        )
    finally:
        await conn.close()
    data = {"scope": str(where), "ok": not found, "drifts": [d.as_dict() for d in found]}

    def human(_: dict[str, Any]) -> None:
        for d in found:
            print(d.line())
        print(_count(found))

    ctx.emit(data, human)
    if found:
        raise Failure(f"{_count(found)} in the usage of {where}")


def _count(drifts: list[audit.Drift]) -> str:
    return "no drift" if not drifts else f"{len(drifts)} drift{'' if len(drifts) == 1 else 's'}"
