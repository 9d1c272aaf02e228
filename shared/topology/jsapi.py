"""The JetStream API subjects a client sends on, by what they do: permissions are granted on these
(deploy/identities.py), and a client that must know whether it was denied names the one it used."""

from __future__ import annotations

API = "$JS.API"
INFO = f"{API}.INFO"
"""The account's JetStream information (every client asks it on connecting)."""


def stream(verb: str, name: str) -> str:
    """A stream's API: `verb` is INFO, CREATE, UPDATE, DELETE, PURGE, MSG.GET, MSG.DELETE..."""
    return f"{API}.STREAM.{verb}.{name}"


def streams(verb: str) -> str:
    """The API over every stream: NAMES, LIST."""
    return f"{API}.STREAM.{verb}"


def consumer_create(stream: str, name: str | None = None, filter_subject: str | None = None) -> str:
    """Create (or update) a consumer: the name and the filter are in the subject, which the server checks
    against the config's, so a grant on it holds the creator to both. Without them, the plain subject of
    an ordered consumer."""
    parts = [f"{API}.CONSUMER.CREATE.{stream}", name, filter_subject]
    return ".".join(p for p in parts if p is not None)


def consumer(verb: str, stream: str, name: str | None = None, api: str = API) -> str:
    """A consumer's API: `verb` is INFO, DELETE, MSG.NEXT, DURABLE.CREATE; without `name`, over every
    consumer of the stream (NAMES, LIST). `api`: the JetStream context's own prefix, where it has one."""
    return f"{api}.CONSUMER.{verb}.{stream}" + ("" if name is None else f".{name}")


def ack(stream: str, durable: str | None = None) -> str:
    """Acknowledgements of one durable's messages, or of every consumer's on the stream."""
    return f"$JS.ACK.{stream}." + ("" if durable is None else f"{durable}.") + ">"


def flow_control(stream: str) -> str:
    """Flow-control replies of consumers on the stream (ordered readers, the broker's sourcing)."""
    return f"$JS.FC.{stream}.>"


def parse_consumer_create(subject: str) -> tuple[str, str, str] | None:
    """(stream, durable, filter subject) of a create subject that names all three (`consumer_create`
    with a name and a filter), or None for any other subject."""
    prefix = f"{API}.CONSUMER.CREATE."
    if not subject.startswith(prefix) or subject.count(".") < 6:
        return None
    stream, durable, filter_subject = subject[len(prefix) :].split(".", 2)
    return stream, durable, filter_subject
