"""Contexts: where rackctl finds the broker and its credential, so that no command needs flags for them.

A context is a small JSON file, `{"url", "nkey", "ca", "identity"}`: the NATS URL, the identity's nkey
seed file, the CA of the server's certificate (TLS only), and the identity's name (for its reply inbox);
a subscriber's also names its stream and its silo (`{"stream", "silo"}`). `make run` writes `default`
(deploy/stack.py); `rackctl subscriber add` writes one per subscriber; `python -m deploy.identities
add-silo-operator` makes a credential that a context of its own can name. rackctl picks, in order:
`--context NAME`, then $RACKCTL_CONTEXT, then `default`; NAME may also be the path of a context file.
Contexts live in $RACKCTL_CONTEXTS, else $RACKPLANE_HOME/contexts, else .rackplane/contexts of the checkout.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "default"


@dataclass(frozen=True)
class ConnectionContext:
    """Where and as whom rackctl connects: one context file. (Not the `Invocation` a command runs with, nor
    nats's JetStreamContext.)"""

    url: str
    nkey: str | None = None
    ca: str | None = None
    identity: str | None = None
    stream: str | None = None
    """A subscriber's: its own stream of events (`EVENTS-<name>`), which `events follow` reads."""
    silo: str | None = None
    """A silo subscriber's silo: the only events it may follow."""


def contexts_dir() -> Path:
    if d := os.environ.get("RACKCTL_CONTEXTS"):
        return Path(d)
    return Path(os.environ.get("RACKPLANE_HOME") or ROOT / ".rackplane") / "contexts"


def identities_dir() -> Path:
    """The identities folder of the rack this host runs (deploy/identities.py): $RACKPLANE_IDENTITIES, else
    $RACKPLANE_HOME/identities, else .rackplane/identities of the checkout."""
    if shared := os.environ.get("RACKPLANE_IDENTITIES"):
        return Path(shared)
    return Path(os.environ.get("RACKPLANE_HOME") or ROOT / ".rackplane") / "identities"


def path_of(name: str) -> Path:
    if name.endswith(".json") or os.sep in name:
        return Path(name)
    return contexts_dir() / f"{name}.json"


def load(name: str | None = None) -> ConnectionContext | None:
    """The context asked for (an error if it does not exist), or the default one if there is one."""
    asked = name or os.environ.get("RACKCTL_CONTEXT") or None
    path = path_of(asked or DEFAULT)
    if not path.exists():
        if asked:
            raise ConnectionError(f"no rackctl context {asked!r} (looked for {path})")
        return None
    try:
        return ConnectionContext(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ConnectionError(f"rackctl context {path} is not valid: {e}") from None


def write(name: str, context: ConnectionContext, dir: Path | None = None) -> Path:
    path = (dir or contexts_dir()) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(context), indent=1) + "\n")
    return path


COMMANDERS = ("console", "test", "fleet-operator")
"""Identities that may run every operator command: a context of one of them is what a refused one is
pointed to."""


def _name_of(path: Path) -> str:
    return path.stem if path.parent == contexts_dir() else str(path)


def denied_hint(name: str | None) -> str | None:
    """What to say after the broker refused this context a command: which context is in use, and one that
    may run it (`default`, as `make run` writes it, first), so nobody has to guess from a subject."""
    path = path_of(name or os.environ.get("RACKCTL_CONTEXT") or DEFAULT)
    try:
        current = load(name)
    except ConnectionError:
        return None
    if current is None:
        return None
    others = sorted(contexts_dir().glob("*.json"), key=lambda p: (p.stem != DEFAULT, p.stem))
    alt = None
    for other in others:
        if other.resolve() == path.resolve():
            continue
        try:
            identity = json.loads(other.read_text()).get("identity")
        except (OSError, ValueError, AttributeError):
            continue
        if identity in COMMANDERS and identity != current.identity:
            alt = other.stem
            break
    use = f"use --context {alt}" if alt else "use a context whose identity may (docs/security.md)"
    if current.stream:  # a subscriber's
        return f"this context ({_name_of(path)}) may only read events: {use} for other commands"
    return f"this context ({_name_of(path)}, identity {current.identity}) may not do this: {use}"
