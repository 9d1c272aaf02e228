"""`rackctl usage`: what the fleet, a silo or a project uses, against its quota; `usage history` and
`usage plot`: how that changed over time; `usage audit`: whether those totals and each instance's charge
are what they should be (rackctl/invariants/audit.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rackctl.commands.args import (
    count,
    duration,
    json_flag,
    project_path,
    scope,
    scope_args,
    scope_path,
    silo_path,
)
from rackctl.commands.base import Failure, Invocation, UnknownName, command, validated
from rackctl.commands.database import connect, database_url_option
from rackctl.invariants import audit
from rackctl.output import print_table
from rackctl.settle import settled
from rackctl.sizes import format_size
from shared.messages import MAX_HISTORY_SECONDS, MIN_HISTORY_SECONDS, UsageHistoryGet

GiB = 2**30


@command(
    "usage",
    "resource usage of the fleet, a silo or a project, against quotas",
    lambda p: scope_args(p, exclusive=True),
    json_flag,
    examples=(
        "rackctl usage  # the fleet",
        "rackctl usage --silo acme",
        "rackctl usage --project acme/web --json",
    ),
)
async def usage(ctx: Invocation) -> None:
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
    examples=(
        "rackctl usage audit  # the whole fleet",
        "rackctl usage audit acme/web --settle 0  # one look, no waiting",
    ),
)
async def usage_audit(ctx: Invocation) -> None:
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


# --- usage over time -------------------------------------------------------------------------------------

_SPAN = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def span(text: str) -> int:
    """A length of time as `90s`, `30m`, `24h` or `7d`, in seconds, within what a history may cover."""
    m = _SPAN.match(text.strip())
    seconds = int(m.group(1)) * _SECONDS[m.group(2)] if m else 0
    if not MIN_HISTORY_SECONDS <= seconds <= MAX_HISTORY_SECONDS:
        raise argparse.ArgumentTypeError(
            f"invalid length of time {text!r}: expected a number and s, m, h or d (e.g. 30m, 24h, 7d), "
            f"from 1m to {MAX_HISTORY_SECONDS // 86400}d"
        )
    return seconds


def history_scope(text: str) -> tuple[str | None, str | None]:
    """`fleet`, `SILO` or `SILO/PROJECT` as (silo, project)."""
    if text == "fleet":
        return None, None
    if "/" in text:
        silo, project = project_path(text)
        return silo, project
    return silo_path(text), None


def _history_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("scope", type=history_scope, metavar="SCOPE", help="fleet, SILO or SILO/PROJECT")
    p.add_argument(
        "--since", type=span, default=86400, metavar="AGO", help="how far back: 30m, 24h, 7d (default 24h)"
    )


def _buckets(default: int) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--buckets",
            type=count,
            default=default,
            metavar="N",
            help=f"into how many equal intervals to divide the time (default {default})",
        )

    return add


async def _history(ctx: Invocation) -> dict[str, Any]:
    silo, project = ctx.args.scope
    body = validated(
        UsageHistoryGet,
        {"since_seconds": "--since", "buckets": "--buckets"},
        silo=silo,
        project=project,
        since_seconds=ctx.args.since,
        buckets=ctx.args.buckets,
    )
    result: dict[str, Any] = await (await ctx.client()).send(body)
    return result


@command(
    "usage history",
    "usage of the fleet, a silo or a project over time: the least, greatest and last level per interval",
    _history_args,
    _buckets(24),
    json_flag,
    examples=(
        "rackctl usage history acme --since 7d",
        "rackctl usage history fleet --since 30m --buckets 6",
    ),
)
async def usage_history(ctx: Invocation) -> None:
    def human(h: dict[str, Any]) -> None:
        quota = h.get("quota") or {}
        print(f"{h['scope']} {h['name']}" if h["scope"] != "fleet" else "fleet")
        limits = [
            f"{label} {fmt(quota[key])}" for label, key, fmt in _RESOURCES if quota.get(key) is not None
        ]
        if limits:
            print("quota: " + ", ".join(limits))
        rows = [
            (_when(p["at"]), *(_range(p[key], unit) for key, unit in _HISTORY_COLUMNS)) for p in h["points"]
        ]
        print_table(("UNTIL (UTC)", "VCPUS", "RAM GIB", "STORAGE GIB"), rows)

    ctx.emit(await _history(ctx), human)


@command(
    "usage plot",
    "draw usage over time (vCPUs, RAM, storage) against the quota, as a PNG image",
    _history_args,
    _buckets(120),
    lambda p: p.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="where to write it"),
    examples=("rackctl usage plot acme --since 24h --out usage.png",),
)
async def usage_plot(ctx: Invocation) -> None:
    from rackctl.plot import save, usage_figure

    fig = usage_figure(await _history(ctx))
    save(fig, ctx.args.out)
    print(f"wrote {ctx.args.out}")


_HISTORY_COLUMNS = (("vcpus", 1), ("ram_bytes", GiB), ("disk_bytes", GiB))


def _when(iso: str) -> str:
    return f"{datetime.fromisoformat(iso).astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def _range(v: dict[str, int], unit: int) -> str:
    """The last level, and the range the interval covered when it moved: `6 (2-8)`."""
    last, low, high = (f"{v[k] / unit:g}" for k in ("last", "min", "max"))
    return last if low == high else f"{last} ({low}-{high})"
