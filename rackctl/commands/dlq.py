"""`rackctl dlq`: the dead letters, with who filed each, why, and whether its claims hold; replay the
message one stands for where it came from; delete.

Reading takes the auditor's rights (the console's); replaying and deleting the dlq-admin identity's
(`--context dlq-admin`), since a replay publishes on a sled's or a service's own subjects. A letter's
headers are its filer's word: each is checked against what its filer's consumer reads, and a replay
sends the stored original, never the letter (rackctl/dead_letters/, docs/operations.md "Dead letters").
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from nats.js import JetStreamContext

from rackctl import dead_letters
from rackctl.commands.args import ago, count, json_flag
from rackctl.commands.base import Failure, Invocation, Unconfirmed, UsageError, command, group
from rackctl.output import print_fields, print_table
from shared.topology import subjects

T = TypeVar("T")

group("dlq", "dead letters: the messages a consumer gave up on, with the reason")


def _time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--service", choices=subjects.SERVICES, help="only this service's dead letters")
    p.add_argument("--since", type=ago, metavar="AGO", help="only those of the last 30m, 2h, 7d...")
    json_flag(p)


@command(
    "dlq list",
    "the dead letters, oldest first: sequence, time, filer, consumer, subject, check, reason",
    _list_args,
    examples=("rackctl dlq list", "rackctl dlq list --service accounting --since 2h"),
)
async def dlq_list(ctx: Invocation) -> None:
    a = ctx.args
    since = datetime.now(UTC) - timedelta(seconds=a.since) if a.since else None
    letters = await dead_letters.read(await _js(ctx), service=a.service, since=since)
    ctx.emit(
        [d.as_dict() for d in letters],
        lambda _: print_table(
            ("SEQ", "TIME", "FILER", "CONSUMER", "SUBJECT", "CHECK", "REASON"),
            [(d.seq, _time(d.time), d.filed_by, d.consumer, d.subject, _check(d), d.reason) for d in letters],
        ),
    )


def _seq_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("seq", type=count, metavar="SEQ", help="the dead letter's sequence (rackctl dlq list)")


@command(
    "dlq show",
    "one dead letter: who filed it, whether its claims hold, its headers and its message",
    _seq_arg,
    json_flag,
    examples=("rackctl dlq show 42",),
)
async def dlq_show(ctx: Invocation) -> None:
    d = await _get(ctx, ctx.args.seq)

    def human(_: object) -> None:
        print_fields(
            [
                ("seq", d.seq),
                ("time", _time(d.time)),
                ("service", d.service),
                ("filed by", f"{d.filed_by} (on {d.filed_on})"),
                ("check", _check(d) + (f": {d.check.reason}" if d.check and d.check.reason else "")),
                ("consumer", d.consumer),
                ("reason", d.reason),
                ("subject", d.subject),
                ("replays to", d.replay_to),
                ("stream", f"{d.stream} (sequence {d.original_seq})"),
                *([("repeats", ", ".join(map(str, d.repeats)))] if d.repeats else []),
                *((f"header {k}", v) for k, v in sorted(d.headers.items())),
            ]
        )
        payload = d.payload()
        print(json.dumps(payload, indent=2, sort_keys=True) if not isinstance(payload, str) else payload)

    ctx.emit(d.as_dict(payload=True), human)


def _replay_args(p: argparse.ArgumentParser) -> None:
    _seq_arg(p)
    p.add_argument("--yes", action="store_true", help="confirm: the message is published again")
    json_flag(p)


@command(
    "dlq replay",
    "publish the stored message a dead letter stands for again on its original subject, then delete the "
    "letter (needs --yes, and the dlq-admin identity); a letter whose claims do not hold is refused",
    _replay_args,
    examples=("rackctl dlq replay 42 --yes --context dlq-admin  # once what made it fail is fixed",),
)
async def dlq_replay(ctx: Invocation) -> None:
    a = ctx.args
    if not a.yes:
        raise Unconfirmed(
            f"refusing to replay dead letter {a.seq} without --yes: its consumer acts on it again"
        )
    letter, new_seq = await _run(dead_letters.replay(await _js(ctx), a.seq))
    stored = letter.check is not None and letter.check.status == dead_letters.OK
    data = {
        "seq": letter.seq,
        "subject": letter.replay_to,
        "stream_seq": new_seq,
        "sent": "original" if stored else "letter",
    }
    what = f"the original, {letter.stream} {letter.original_seq}" if stored else "the letter's body"
    ctx.emit(data, lambda d: print(f"replayed dead letter {d['seq']} ({what}) to {d['subject']} (stream "
                                    f"sequence {d['stream_seq']}); deleted it from the DLQ"))  # fmt: skip


def _purge_args(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("seq", type=count, nargs="?", metavar="SEQ", help="one dead letter")
    which.add_argument("--all", action="store_true", help="every dead letter")
    which.add_argument("--older-than", type=ago, metavar="AGO", help="those older than 1h, 7d...")
    p.add_argument("--yes", action="store_true", help="confirm: deleted dead letters are gone for good")
    json_flag(p)


@command(
    "dlq purge",
    "delete dead letters: one, all, or those older than a time (needs --yes)",
    _purge_args,
    examples=(
        "rackctl dlq purge 42 --yes --context dlq-admin",
        "rackctl dlq purge --older-than 7d --yes --context dlq-admin",
    ),
)
async def dlq_purge(ctx: Invocation) -> None:
    a = ctx.args
    if a.seq is None and not a.all and a.older_than is None:
        raise UsageError("name a dead letter (SEQ), or --all, or --older-than")
    if not a.yes:
        raise Unconfirmed("refusing to delete dead letters without --yes: they are gone for good")
    js = await _js(ctx)
    if a.seq is not None:  # the letter and its repeats, which `list` shows as one
        letter = await _get(ctx, a.seq)
        seqs = [a.seq, *await dead_letters.repeats_of(js, letter)]
        for seq in seqs:
            await _run(dead_letters.delete(js, seq))
    else:
        cutoff = datetime.now(UTC) - timedelta(seconds=a.older_than) if a.older_than else None
        seqs = [d.seq for d in await dead_letters.read(js, repeats=True) if cutoff is None or d.time < cutoff]
        for seq in seqs:
            await _run(dead_letters.delete(js, seq))
    ctx.emit({"deleted": seqs}, lambda d: print(f"deleted {len(d['deleted'])} dead letter(s)"))


async def _js(ctx: Invocation) -> JetStreamContext:
    return (await ctx.client()).nc.jetstream()


async def _get(ctx: Invocation, seq: int) -> dead_letters.DeadLetter:
    letter = await _run(dead_letters.get(await _js(ctx), seq))
    repeats = await dead_letters.repeats_of(await _js(ctx), letter)
    return replace(letter, repeats=tuple(repeats))


def _check(d: dead_letters.DeadLetter) -> str:
    return d.check.status if d.check else "?"


async def _run(call: Awaitable[T]) -> T:
    """A dead letter that is not there is a failure of the command (exit 1), said in one line."""
    try:
        return await call
    except dead_letters.NoDeadLetter as e:
        raise Failure(str(e)) from None
