"""`rackctl silo`: silos, the tenants, with their quotas."""

from __future__ import annotations

import argparse
from typing import Any

from rackctl.commands.args import count, json_flag, silo_path, size
from rackctl.commands.base import Ctx, command, group, validated
from rackctl.output import print_table
from rackctl.sizes import format_size
from shared.messages import Quota

group("silo", "silos: tenants, with their quotas")


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


@command(
    "silo create",
    "create a silo, optionally with quotas",
    _quota_options,
    json_flag,
    examples=(
        "rackctl silo create acme  # no quota",
        "rackctl silo create acme --cpus 16 --ram 64GiB --storage 1TiB  # with quotas",
    ),
)
async def silo_create(ctx: Ctx) -> None:
    a = ctx.args
    quota = validated(
        Quota,
        {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--storage"},
        vcpus=a.cpus,
        ram_bytes=a.ram,
        disk_bytes=a.storage,
    )
    data = await (await ctx.client()).silo_create(a.name, quota)
    ctx.emit(data, lambda d: print(f"created silo {d['name']} ({_quota_text(d['quota'])})"))


@command(
    "silo list",
    "list silos and their quotas",
    json_flag,
    examples=(
        "rackctl silo list",
        "rackctl silo list --json",
    ),
)
async def silo_list(ctx: Ctx) -> None:
    def human(silos: list[dict[str, Any]]) -> None:
        rows = []
        for s in silos:
            q = s.get("quota") or {}
            ram, disk = q.get("ram_bytes"), q.get("disk_bytes")
            rows.append((s["name"], q.get("vcpus"), _size_or_none(ram), _size_or_none(disk)))
        print_table(("SILO", "VCPU QUOTA", "RAM QUOTA", "STORAGE QUOTA"), rows)

    ctx.emit(await (await ctx.client()).silo_list(), human)


def _size_or_none(n: int | None) -> str | None:
    return None if n is None else format_size(n)
