"""Dead letters (stream DLQ): read them, check what they claim, replay the messages they stand for, delete.

Each is read by its sequence (`$JS.API.STREAM.MSG.GET.DLQ`), so reading creates no consumer and changes
nothing.

A letter's headers (`Rp-Dlq-*`) and body are whatever its publisher wrote, and any identity that may file
letters may write any: a sled may publish on its own DLQ subject. The one thing the broker vouches for is
that DLQ subject (`rp.dlq.<service>.<durable or name>`), since each identity may publish only on its own.
So a letter is judged by its filer (`check`): the consumer it names must be one that files on that
subject, by the topology in code (deploy/identities.py's grants, which the broker enforces: a durable is
created on the subject that carries its filter); the stream must be that consumer's and the subject one
its filter takes; and the message at that stream and sequence must be on that subject, with that body.

A replay puts on the bus only what was really stored: the original, read from its stream by sequence,
published on the subject it was first published on (`subjects.replay_subject`), which the filer's
consumer reads. A letter whose claims do not hold is refused, with the reason in one line. A letter
whose original has left its stream (aged out, or an inventory past its TTL) is replayed from its own
body only where every identity that may file it could have published that message itself, else refused:
replaying it would let the filer say what it may not. The replay goes under a message id of its own,
made from the letter's (`replay:DLQ:<seq>:<digest>`, which no one who cannot read the DLQ can guess, so a
replay retried within the duplicate window is stored once and none can be pre-empted), then the letter
and its repeats are deleted. The consumer takes it as any message: decoded, checked against its subject
and fenced again. If it fails again, it is dead-lettered again, with a new sequence and its new reason.

Each filing has an id of its own (shared/bus/deadletter.py), so a letter filed twice (its `term` lost) is
stored twice: `read` shows such repeats (one filer, one original, one body) as one letter, with their
sequences.
"""

from rackctl.dead_letters.filers import Reader, could_publish, readers
from rackctl.dead_letters.letters import (
    CONSUMER,
    GONE,
    MISMATCH,
    OK,
    REASON,
    REPLAY_OF,
    SEQUENCE,
    STREAM,
    SUBJECT,
    UNREAD,
    Check,
    DeadLetter,
    Depth,
    NoDeadLetter,
)
from rackctl.dead_letters.reading import check, depth, get, read, repeats_of
from rackctl.dead_letters.replay import Refused, delete, replay, replay_id

__all__ = [
    "CONSUMER",
    "GONE",
    "MISMATCH",
    "OK",
    "REASON",
    "REPLAY_OF",
    "SEQUENCE",
    "STREAM",
    "SUBJECT",
    "UNREAD",
    "Check",
    "DeadLetter",
    "Depth",
    "NoDeadLetter",
    "Reader",
    "Refused",
    "check",
    "could_publish",
    "delete",
    "depth",
    "get",
    "read",
    "readers",
    "repeats_of",
    "replay",
    "replay_id",
]
