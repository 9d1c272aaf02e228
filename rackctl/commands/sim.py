"""`rackctl sim`: drive the sled simulator, the rack's hardware in tests (reboot, freeze, partition, faults).

It talks to the simulator's own console (`rp.sim.>`), not to the control plane, which sees only the effects.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rackctl.commands.args import count, json_flag, probability, seconds, size, sled_arg
from rackctl.commands.base import Invocation, UsageError, command, group, validated
from rackctl.output import print_table
from rackctl.sizes import format_size
from shared.messages import SimFaults, SimSledAdd, VmmState
from shared.messages.simulator import SimSledCapacity
from shared.topology import subjects

group("sim", "drive the sled simulator: reboot, freeze, partition, faults (testing only)")
group(
    "sim sled",
    "add, list, reboot, freeze, thaw, partition, heal, resize or remove simulated sleds (testing only)",
)
group("sim rack", "the whole simulated rack at once (testing only)")


@command(
    "sim rack reboot",
    "reboot every simulated sled at once: a power loss of the whole rack",
    json_flag,
    examples=("rackctl sim rack reboot",),
)
async def sim_rack_reboot(ctx: Invocation) -> None:
    data = await (await ctx.client()).sim_rack_reboot()
    ctx.emit(data, lambda d: print(f"rebooted {d['rebooted']} sleds: each comes back on its next boot"))


@command(
    "sim sled list",
    "list simulated sleds: boot number and id, VMMs, frozen or partitioned, faults",
    json_flag,
    examples=("rackctl sim sled list",),
)
async def sim_sled_list(ctx: Invocation) -> None:
    def human(sleds: list[dict[str, Any]]) -> None:
        rows = [
            (
                s["sled_id"],
                _sim_state(s),
                s.get("boot_number"),
                s.get("boot_id"),
                s["vcpus"],
                format_size(s["ram_bytes"]),
                s["vmms"],
                _faults_text(s.get("faults")),
            )
            for s in sleds
        ]
        print_table(("SLED", "STATE", "BOOT", "BOOT ID", "VCPUS", "RAM", "VMMS", "FAULTS"), rows)

    ctx.emit(await (await ctx.client()).sim_sled("list"), human)


def _sim_add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", type=count, metavar="N", help="vCPUs (default: 64)")
    p.add_argument("--ram", type=size, metavar="SIZE", help="RAM, e.g. 256GiB (default: 256GiB)")


@command(
    "sim sled add",
    "add a simulated sled (it joins the rack at once)",
    _sim_add_options,
    json_flag,
    examples=(
        "rackctl sim sled add  # 64 vCPUs, 256 GiB",
        "rackctl sim sled add --cpus 32 --ram 128GiB",
    ),
)
async def sim_sled_add(ctx: Invocation) -> None:
    given = {"vcpus": ctx.args.cpus, "ram_bytes": ctx.args.ram}
    body = validated(
        SimSledAdd,
        {"vcpus": "--cpus", "ram_bytes": "--ram"},
        **{k: v for k, v in given.items() if v is not None},
    )
    data = await (await ctx.client()).sim_sled("add", vcpus=body.vcpus, ram_bytes=body.ram_bytes)
    ctx.emit(
        data,
        lambda d: print(
            f"added {d['sled_id']}: {d['vcpus']} vCPUs, {format_size(d['ram_bytes'])} RAM "
            f"(boot id {d['boot_id']})"
        ),
    )


def _sim_capacity_options(p: argparse.ArgumentParser) -> None:
    sled_arg(p)
    p.add_argument("--cpus", type=count, metavar="N", help="vCPUs to report (default: as made)")
    p.add_argument("--ram", type=size, metavar="SIZE", help="RAM to report, e.g. 64GiB (default: as made)")


@command(
    "sim sled capacity",
    "make a simulated sled report another capacity from its next inventory on (sent at once); "
    "without options, restore what it was made with",
    _sim_capacity_options,
    json_flag,
    examples=(
        "rackctl sim sled capacity sled-0 --cpus 8 --ram 16GiB  # it lost cores and DIMMs",
        "rackctl sim sled capacity sled-0  # back to what it was made with",
    ),
)
async def sim_sled_capacity(ctx: Invocation) -> None:
    body = validated(
        SimSledCapacity,
        {"vcpus": "--cpus", "ram_bytes": "--ram"},
        sled_id=ctx.args.sled,
        vcpus=ctx.args.cpus,
        ram_bytes=ctx.args.ram,
    )
    data = await (await ctx.client()).call(subjects.sim_control("sled.capacity"), body)

    def human(d: dict[str, Any]) -> None:
        made = f"{d['nominal_vcpus']} vCPUs, {format_size(d['nominal_ram_bytes'])} RAM"
        now = f"{d['vcpus']} vCPUs, {format_size(d['ram_bytes'])} RAM"
        print(f"{d['sled_id']} reports {now}" + ("" if now == made else f" (made with {made})"))

    ctx.emit(data, human)


async def sim_sled_action(ctx: Invocation, verb: str, said: Callable[[dict[str, Any]], str]) -> None:
    """Send one sled's simulator verb, and print what `said` makes of the reply."""
    data = await (await ctx.client()).sim_sled(verb, ctx.args.sled)
    ctx.emit(data, lambda d: print(said(d)))


@command(
    "sim sled reboot",
    "reboot a simulated sled: its VMMs are lost and it comes back on its next boot",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled reboot sled-0",),
)
async def sim_sled_reboot(ctx: Invocation) -> None:
    await sim_sled_action(
        ctx, "reboot", lambda d: f"rebooted {d['sled_id']}: boot {d['boot_number']} (boot id {d['boot_id']})"
    )


@command(
    "sim sled freeze",
    "freeze a simulated sled: no inventory, reports or commands until thawed",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled freeze sled-0",),
)
async def sim_sled_freeze(ctx: Invocation) -> None:
    await sim_sled_action(ctx, "freeze", lambda d: f"froze {d['sled_id']}: it answers nothing until thawed")


@command(
    "sim sled thaw",
    "thaw a frozen simulated sled",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled thaw sled-0",),
)
async def sim_sled_thaw(ctx: Invocation) -> None:
    await sim_sled_action(ctx, "thaw", lambda d: f"thawed {d['sled_id']}")


@command(
    "sim sled partition",
    "cut a simulated sled off the network until healed: nothing goes in or out, its VMMs go on running",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled partition sled-0",),
)
async def sim_sled_partition(ctx: Invocation) -> None:
    await sim_sled_action(
        ctx,
        "partition",
        lambda d: f"partitioned {d['sled_id']}: cut off until healed (its VMMs go on running)",
    )


@command(
    "sim sled heal",
    "end a simulated sled's partition",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled heal sled-0",),
)
async def sim_sled_heal(ctx: Invocation) -> None:
    await sim_sled_action(ctx, "heal", lambda d: f"healed {d['sled_id']}")


@command(
    "sim sled remove",
    "remove a sled from the simulator (the control plane still lists it: expunge it there)",
    sled_arg,
    json_flag,
    examples=("rackctl sim sled remove sled-0",),
)
async def sim_sled_remove(ctx: Invocation) -> None:
    await sim_sled_action(ctx, "remove", lambda d: f"removed {d['sled_id']} from the simulator")


def _faults_options(p: argparse.ArgumentParser) -> None:
    sled_arg(p)
    p.add_argument(
        "--delay-state",
        choices=[s.value for s in VmmState],
        help="delay only reports of this VMM state (default: any state)",
    )
    p.add_argument("--delay-seconds", type=seconds, metavar="S", help="how long to hold each delayed report")
    p.add_argument("--delay-count", type=count, metavar="N", help="how many reports to delay")
    p.add_argument("--duplicate", type=count, metavar="N", help="send every report N extra times")
    p.add_argument("--drop-probability", type=probability, metavar="P", help="drop reports with chance P")
    p.add_argument(
        "--drop-commands", action="store_true", help="take commands but never act on them (no start/stop)"
    )
    p.add_argument("--fail-starts", action="store_true", help="every VMM that boots fails at once")


_FAULT_OPTIONS = {
    "delay_state": "--delay-state",
    "delay_seconds": "--delay-seconds",
    "delay_count": "--delay-count",
    "duplicate": "--duplicate",
    "drop_probability": "--drop-probability",
    "drop_commands": "--drop-commands",
    "fail_starts": "--fail-starts",
}


@command(
    "sim faults",
    "set the faults a simulated sled injects, replacing its current ones; with no fault options, clear them",
    _faults_options,
    json_flag,
    examples=(
        "rackctl sim faults sled-0 --delay-state running --delay-seconds 5 --delay-count 1  # late, once",
        "rackctl sim faults sled-0 --fail-starts  # every VMM it boots fails",
        "rackctl sim faults sled-0  # clear them",
    ),
)
async def sim_faults(ctx: Invocation) -> None:
    a = ctx.args
    if (a.delay_state is not None or a.delay_seconds is not None) and not a.delay_count:
        raise UsageError("--delay-state and --delay-seconds need --delay-count (how many reports to delay)")
    if a.delay_count and a.delay_seconds is None:
        raise UsageError("--delay-count needs --delay-seconds (how long to hold each report)")
    given = {key: getattr(a, key) for key in _FAULT_OPTIONS}
    faults = validated(
        SimFaults,
        _FAULT_OPTIONS,
        sled_id=a.sled,
        **{k: v for k, v in given.items() if v not in (None, False)},
    )
    data = await (await ctx.client()).sim_faults(faults)

    def human(d: dict[str, Any]) -> None:
        text = _faults_text(d.get("faults"))
        print(f"{d['sled_id']}: faults {'cleared' if text is None else 'set: ' + text}")

    ctx.emit(data, human)


def _sim_state(s: dict[str, Any]) -> str:
    """`up`, or why the sled is silent: `frozen`, `partitioned` (or both: `frozen,partitioned`)."""
    silent = [state for state in ("frozen", "partitioned") if s.get(state)]
    return ",".join(silent) or "up"


def _faults_text(f: dict[str, Any] | None) -> str | None:
    """The faults a sled injects, in a few words; None when it injects none."""
    if not f:
        return None
    parts = []
    if f.get("delay_count"):
        which = f"{f['delay_state']} reports" if f.get("delay_state") else "reports"
        parts.append(f"delay next {f['delay_count']} {which} by {f.get('delay_seconds', 0):g}s")
    if f.get("duplicate"):
        parts.append(f"duplicate reports x{f['duplicate']}")
    if f.get("drop_probability"):
        parts.append(f"drop {f['drop_probability']:.0%} of reports")
    if f.get("drop_commands"):
        parts.append("drop commands")
    if f.get("fail_starts"):
        parts.append("fail starts")
    return ", ".join(parts) or None
