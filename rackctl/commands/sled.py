"""`rackctl sled`: the sleds of the rack, and expunging one for good."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from rackctl.commands.args import json_flag, sled_arg
from rackctl.commands.base import Invocation, Unconfirmed, command, group
from rackctl.output import print_table
from rackctl.sizes import format_size

group("sled", "the sleds of the rack")


@command(
    "sled list",
    "list sleds, their capacity and what is reserved on them",
    json_flag,
    examples=(
        "rackctl sled list",
        "rackctl sled list --json",
    ),
)
async def sled_list(ctx: Invocation) -> None:
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
    examples=("rackctl sled expunge sled-4 --yes",),
)
async def sled_expunge(ctx: Invocation) -> None:
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


def _ago(timestamp: str | None) -> str | None:
    if not timestamp:
        return None
    try:
        age = datetime.now(UTC) - datetime.fromisoformat(timestamp)
    except ValueError:
        return timestamp
    return f"{max(age.total_seconds(), 0):.0f}s ago"
