"""`rackctl silo`: silos, the tenants, with their quotas: create, list, show, limits, delete."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rackctl import context as contexts
from rackctl.commands.args import count, json_flag, silo_path, size
from rackctl.commands.base import Invocation, UsageError, command, group, validated
from rackctl.output import print_fields, print_table
from rackctl.sizes import format_size
from shared.messages import Quota, SiloLimitsSet

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
async def silo_create(ctx: Invocation) -> None:
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
async def silo_list(ctx: Invocation) -> None:
    def human(silos: list[dict[str, Any]]) -> None:
        rows = []
        for s in silos:
            q = s.get("quota") or {}
            ram, disk = q.get("ram_bytes"), q.get("disk_bytes")
            rows.append((s["name"], q.get("vcpus"), _size_or_none(ram), _size_or_none(disk)))
        print_table(("SILO", "VCPU QUOTA", "RAM QUOTA", "STORAGE QUOTA"), rows)

    ctx.emit(await (await ctx.client()).silo_list(), human)


@command(
    "silo delete",
    "delete a silo that holds no project (refused, saying which, while any lives); its name is free again",
    lambda p: p.add_argument("name", type=silo_path, metavar="SILO"),
    json_flag,
    examples=(
        "rackctl silo delete acme",
        "rackctl silo delete acme --json",
    ),
)
async def silo_delete(ctx: Invocation) -> None:
    data = await (await ctx.client()).silo_delete(ctx.args.name)
    left = _identities_of(ctx.args.name)
    ctx.emit(
        {**data, "identities_left": left},
        lambda d: print(
            f"deleted silo {d['name']}"
            + (
                f"; its identities remain: {', '.join(left)}. The broker scopes them by the silo's name: "
                "remove them before the name is given to another tenant (rackctl subscriber remove NAME "
                "--yes; python -m deploy.identities remove DIR NAME)"
                if left
                else ""
            )
        ),
    )


def _identities_of(silo: str) -> list[str]:
    """The silo's operators and subscribers that the rack's identities folder still names, where this
    host holds it: scoped by the silo's name, they would reach a new silo of that name."""
    manifest = contexts.identities_dir() / "identities.json"
    try:
        rows = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return []
    return sorted(
        r["name"]
        for r in rows
        if isinstance(r, dict) and r.get("kind") in ("silo-operator", "subscriber") and r.get("param") == silo
    )


def _size_or_none(n: int | None) -> str | None:
    return None if n is None else format_size(n)


@command(
    "silo show",
    "show a silo: its quota, and its tenant limits with what it holds of each",
    lambda p: p.add_argument("name", type=silo_path, metavar="SILO"),
    json_flag,
    examples=(
        "rackctl silo show acme",
        "rackctl silo show acme --json",
    ),
)
async def silo_show(ctx: Invocation) -> None:
    ctx.emit(await (await ctx.client()).silo_show(ctx.args.name), _show)


def _show(d: dict[str, Any]) -> None:
    limits, own, used = d["limits"], d["limits_own"], d["used"]

    def whose(k: str) -> str:
        return "" if own.get(k) else " (the rack's default)"

    print_fields(
        [
            ("silo", d["name"]),
            ("id", d["id"]),
            ("quota", _quota_text(d["quota"])),
            *(
                (label, f"{used[k]} of {limits[k]}{whose(k)}")
                for label, k in (
                    ("projects", "projects"),
                    ("instances", "instances"),
                    ("pool members", "pool_members"),
                )
            ),
            ("command rate", f"{limits['command_rate']} a second{whose('command_rate')}"),
        ]
    )


def _limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", type=silo_path, metavar="SILO")
    p.add_argument("--projects", type=count, metavar="N", help="most projects the silo may hold")
    p.add_argument("--instances", type=count, metavar="N", help="most instances, warm-pool VMs included")
    p.add_argument(
        "--pool-members", type=count, metavar="N", help="most VMs its warm pools may keep, together"
    )
    p.add_argument("--command-rate", type=count, metavar="N", help="commands a second the silo may send")


@command(
    "silo limits",
    "set a silo's tenant limits (the fleet operator); a limit not given stays as it is",
    _limit_options,
    json_flag,
    examples=(
        "rackctl silo limits acme --projects 20 --instances 200",
        "rackctl silo limits acme --pool-members 50 --command-rate 100",
    ),
)
async def silo_limits(ctx: Invocation) -> None:
    a = ctx.args
    body = validated(
        SiloLimitsSet,
        {"pool_members": "--pool-members", "command_rate": "--command-rate"},
        name=a.name,
        projects=a.projects,
        instances=a.instances,
        pool_members=a.pool_members,
        command_rate=a.command_rate,
    )
    if body.model_dump(exclude={"name"}, exclude_none=True) == {}:
        raise UsageError("nothing to set: give --projects, --instances, --pool-members or --command-rate")
    ctx.emit(await (await ctx.client()).silo_limits(body), _show)
