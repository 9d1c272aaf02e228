"""Replaying a dead letter (the stored original, published where it came from, under a message id of its
own) and deleting letters: the dlq-admin identity's rights."""

from __future__ import annotations

import hashlib

import nats.js.errors
from nats.js import JetStreamContext

from rackctl.dead_letters.filers import could_publish
from rackctl.dead_letters.letters import (
    DLQ,
    GONE,
    MISMATCH,
    NO_MESSAGE,
    REPLAY_OF,
    UNREAD,
    Check,
    DeadLetter,
    NoDeadLetter,
    api,
)
from rackctl.dead_letters.reading import get, repeats_of
from shared import bus
from shared.topology import jsapi, subjects


class Refused(bus.CommandError):
    """A replay refused: the letter's claims do not hold, or what it stands for cannot be published."""

    def __init__(self, message: str) -> None:
        super().__init__("refused", message)


async def replay(js: JetStreamContext, seq: int) -> tuple[DeadLetter, int]:
    """Publish the message dead letter `seq` stands for where it came from, then delete the letter and
    its repeats: (the letter, the new stream sequence of the replayed message)."""
    letter = await get(js, seq)
    checked = letter.check or Check(UNREAD)
    target = letter.replay_to
    if checked.status == MISMATCH:
        raise Refused(f"dead letter {seq} (filed by {letter.filed_by}) is not replayed: it {checked.reason}")
    if checked.status == UNREAD:
        raise bus.CommandError("forbidden", f"dead letter {seq} is not replayed: {checked.reason}")
    if not any(subjects.matches(target, p) for p in subjects.REPLAYABLE):
        raise Refused(f"dead letter {seq} came from {letter.subject!r}, which no stream of rackplane holds")
    if checked.status == GONE:
        if size := letter.headers.get(bus.DLQ_TRUNCATED):
            raise Refused(
                f"dead letter {seq}: {checked.reason}, and the letter keeps only the first "
                f"{len(letter.data)} of its {size} bytes: it can be read, not replayed"
            )
        if not could_publish(letter.filed_on, target):
            raise Refused(
                f"dead letter {seq}: {checked.reason}, and {letter.filed_by} may not publish on {target} "
                "itself, so its letter's body is not sent there: it can be read, not replayed"
            )
        data = letter.data
    else:
        data = checked.original or b""
    headers = {bus.MSG_ID: replay_id(letter), REPLAY_OF: f"{DLQ}:{seq}"}
    if bus.wire_size(data, headers) > js._nc.max_payload:
        raise Refused(
            f"dead letter {seq}: its message ({len(data)} bytes) and a replay's headers would pass the "
            "broker's max payload: it can be read, not replayed"
        )
    ack = await api(js, target, js.publish(target, data, headers=headers))
    for s in [seq, *await repeats_of(js, letter)]:
        try:
            await delete(js, s)
        except NoDeadLetter:  # a repeat deleted meanwhile
            pass
    return letter, ack.seq


def replay_id(letter: DeadLetter) -> str:
    """The replay's message id: the same for every try of one letter's replay (so a retry within the
    duplicate window is stored once), and made from the letter's own random id and time, which only
    the DLQ's readers know (so no publisher on the target stream can take it first)."""
    seed = f"{letter.headers.get(bus.MSG_ID, '')}|{letter.time.isoformat()}|{letter.seq}"
    return f"replay:{DLQ}:{letter.seq}:{hashlib.sha256(seed.encode()).hexdigest()[:16]}"


async def delete(js: JetStreamContext, seq: int) -> None:
    try:
        await api(js, jsapi.stream("MSG.DELETE", DLQ), js.delete_msg(DLQ, seq))
    except nats.js.errors.APIError as e:
        if isinstance(e, nats.js.errors.NotFoundError) or e.err_code in NO_MESSAGE:
            raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None
        raise
