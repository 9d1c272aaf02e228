"""`rackctl stats`: one service's counters and gauges, the numbers its `/metrics` exports."""

from __future__ import annotations

import argparse
from typing import Any

from rackctl.commands.args import json_flag
from rackctl.commands.base import Invocation, command
from rackctl.output import print_table
from shared.topology import subjects


def _stats_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", choices=subjects.SERVICES, metavar="SERVICE", help=", ".join(subjects.SERVICES))


@command(
    "stats",
    "a service's counters (messages handled, stale, duplicate, dead-lettered...) and gauges (consumer "
    "lag, outbox depth), as its /metrics exports them",
    _stats_options,
    json_flag,
    examples=(
        "rackctl stats accounting",
        "rackctl stats instance-manager --json",
    ),
)
async def stats(ctx: Invocation) -> None:
    def human(d: dict[str, Any]) -> None:
        port = d.get("http_port")
        print(f"{d['service']}" + (f" (metrics on port {port})" if port else ""))
        rows: list[tuple[str, Any, str]] = [
            (name, n, "counter") for name, n in sorted((d.get("counters") or {}).items())
        ]
        rows += [(name, _number(v), "gauge") for name, v in sorted((d.get("gauges") or {}).items())]
        rows += [(name, v, "") for name, v in sorted(d.items()) if name not in _SHOWN]
        print_table(("NAME", "VALUE", "KIND"), rows)

    ctx.emit(await (await ctx.client()).stats(ctx.args.service), human)


_SHOWN = {"service", "counters", "gauges", "http_port"}


def _number(v: float) -> int | str:
    return int(v) if float(v).is_integer() else f"{v:g}"
