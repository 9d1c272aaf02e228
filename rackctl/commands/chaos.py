"""`rackctl chaos`: inject faults into one service's messages, to test that the invariants still hold.

A service takes them only from the test identity, and only when started with fault injection enabled.
"""

from __future__ import annotations

import argparse
from typing import Any

from rackctl.commands.args import count, duration, json_flag, probability
from rackctl.commands.base import Failure, Invocation, UsageError, command, validated
from rackctl.output import print_table
from shared import bus
from shared.messages import ServiceFaults
from shared.topology import subjects


def _chaos_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "service",
        choices=[*subjects.SERVICES, "status"],
        metavar="SERVICE",
        help=f"{', '.join(subjects.SERVICES)}; or `status`: the faults of every service",
    )
    delay = p.add_mutually_exclusive_group()
    delay.add_argument("--delay", type=duration, metavar="S", help="hold each outgoing message S seconds")
    delay.add_argument(
        "--delay-range",
        type=duration,
        nargs=2,
        metavar=("A", "B"),
        help="hold each outgoing message a random time from A to B seconds",
    )
    p.add_argument("--duplicate", type=count, metavar="N", help="send each outgoing message N more times")
    p.add_argument(
        "--bypass-dedupe",
        action="store_true",
        help="give each copy its own message id, so the consumers (not the broker) must drop it",
    )
    p.add_argument(
        "--reorder-window",
        type=count,
        metavar="W",
        help="hold up to W outgoing messages, release them shuffled",
    )
    p.add_argument(
        "--drop-first-attempt",
        action=argparse.BooleanOptionalAction,
        help="fail the first publish of each message, so that the sender's retry is what arrives",
    )
    p.add_argument(
        "--hold-acks",
        type=probability,
        metavar="P",
        help="leave each handled message unacked with chance P: JetStream redelivers it after its ack wait",
    )
    p.add_argument(
        "--hold-acks-count", type=count, metavar="K", help="leave the next K handled messages unacked"
    )
    p.add_argument(
        "--slow-handler",
        type=duration,
        metavar="S",
        help="sleep S seconds before handling each first delivery (longer than the ack wait: a redelivery "
        "arrives while it runs)",
    )
    p.add_argument(
        "--only",
        nargs="*",
        metavar="PREFIX",
        help="apply the faults only to subjects starting with one of these, e.g. rp.acct.delta. "
        "(with no prefix: every subject again)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="seed the random choices, for a repeatable run")
    p.add_argument("--clear", action="store_true", help="remove every fault first (alone: turn them all off)")


_CHAOS_OPTIONS = {
    "delay": "--delay",
    "duplicate": "--duplicate",
    "reorder": "--reorder-window",
    "drop_first_attempt": "--drop-first-attempt",
    "hold_acks": "--hold-acks",
    "slow_handler_seconds": "--slow-handler",
    "only": "--only",
    "seed": "--seed",
}


def _chaos_request(a: argparse.Namespace) -> ServiceFaults:
    """The `rp.svc.faults` body the options ask for; no option at all reads the faults and changes nothing."""
    fields: dict[str, Any] = {"clear": a.clear}
    if a.delay is not None:
        fields["delay"] = {"min_seconds": a.delay, "max_seconds": a.delay}
    elif a.delay_range is not None:
        fields["delay"] = {"min_seconds": a.delay_range[0], "max_seconds": a.delay_range[1]}
    if a.bypass_dedupe and not a.duplicate:
        raise UsageError("--bypass-dedupe needs --duplicate N (how many copies to send)")
    if a.duplicate is not None:
        fields["duplicate"] = {"copies": a.duplicate, "bypass_dedupe": a.bypass_dedupe}
    if a.reorder_window is not None:
        fields["reorder"] = {"window": a.reorder_window}
    if a.hold_acks is not None or a.hold_acks_count is not None:
        fields["hold_acks"] = {"probability": a.hold_acks or 0, "count": a.hold_acks_count or 0}
    given = {
        "drop_first_attempt": a.drop_first_attempt,
        "slow_handler_seconds": a.slow_handler,
        "only": a.only,
        "seed": a.seed,
    }
    fields.update({k: v for k, v in given.items() if v is not None})
    return validated(ServiceFaults, _CHAOS_OPTIONS, **fields)


@command(
    "chaos",
    "inject faults into one service's messages (delay, duplicate, reorder, drop, hold acks, slow handler); "
    "the options given replace those faults, the others stay; with none, show them (testing only)",
    _chaos_options,
    json_flag,
    examples=(
        "rackctl chaos accounting --delay 0.2 --duplicate 2  # what accounting sends: late, thrice",
        "rackctl chaos status  # the faults of every service",
        "rackctl chaos accounting --clear",
    ),
)
async def chaos(ctx: Invocation) -> None:
    a = ctx.args
    body = _chaos_request(a)
    if a.service == "status" and body != ServiceFaults():
        raise UsageError("chaos status only shows the faults: set them with rackctl chaos SERVICE ...")
    client = await ctx.client()
    if a.service == "status":

        def table(replies: list[dict[str, Any]]) -> None:
            rows = [
                (
                    r["service"],
                    f"no answer ({r['error']})" if "error" in r else _chaos_text(r["faults"]) or "none",
                    _injected_text(r.get("counters") or {}),
                )
                for r in replies
            ]
            print_table(("SERVICE", "FAULTS", "INJECTED"), rows)

        replies = await client.faults_status(timeout=min(ctx.args.timeout, 2.0))
        ctx.emit(replies, table)
        if replies and all("error" in r for r in replies):  # a status of nothing is a failure, for scripts
            raise Failure(
                "no service answered: " + "; ".join(f"{r['service']}: {r['error']}" for r in replies)
            )
        return

    def human(d: dict[str, Any]) -> None:
        text = _chaos_text(d["faults"])
        print(f"{d['service']}: {'no faults' if text is None else 'faults: ' + text}")
        if d.get("counters"):
            print(f"injected so far: {_injected_text(d['counters'])}")

    try:
        reply = await client.faults(a.service, body)
    except bus.CommandError as e:
        if e.code in ("forbidden", "unavailable"):
            raise Failure(f"{a.service}: {FAULTS_OFF} ({e.message})") from None
        raise
    ctx.emit(reply, human)


FAULTS_OFF = (
    "fault injection refused or off: the services take it only from the test identity, and only when "
    "started with it enabled (make run FAULTS=1)"
)


def _chaos_text(f: dict[str, Any]) -> str | None:
    """A service's faults in a few words; None when it injects none."""
    parts = []
    if (d := f.get("delay")) and d["max_seconds"]:
        same = d["min_seconds"] == d["max_seconds"]
        parts.append(
            f"delay {d['max_seconds']:g}s" if same else f"delay {d['min_seconds']:g}-{d['max_seconds']:g}s"
        )
    if (dup := f.get("duplicate")) and dup["copies"]:
        parts.append(f"duplicate x{dup['copies']}" + (" (own ids)" if dup["bypass_dedupe"] else ""))
    if (r := f.get("reorder")) and r["window"]:
        parts.append(f"reorder within {r['window']} ({r['max_hold_seconds']:g}s)")
    if f.get("drop_first_attempt"):
        parts.append("drop first attempts")
    if (h := f.get("hold_acks")) and (h["count"] or h["probability"]):
        held = [f"next {h['count']}"] if h["count"] else []
        held += [f"{h['probability']:.0%}"] if h["probability"] else []
        parts.append(f"hold acks ({', '.join(held)})")
    if f.get("slow_handler_seconds"):
        parts.append(f"slow handler {f['slow_handler_seconds']:g}s")
    if parts and f.get("only"):
        parts.append(f"only {' '.join(f['only'])}")
    return ", ".join(parts) or None


def _injected_text(counters: dict[str, int]) -> str | None:
    return ", ".join(f"{k.removeprefix('faults.')} {v}" for k, v in sorted(counters.items())) or None
