"""Contexts: where rackctl finds the broker and its credential, so that no command needs flags for them.

A context is a small JSON file, `{"url", "nkey", "ca", "identity"}`: the NATS URL, the identity's nkey
seed file, the CA of the server's certificate (TLS only), and the identity's name (for its reply inbox).
`make run` writes `default` (deploy/stack.py); `python -m deploy.identities add-silo-operator` makes a
credential that a context of its own can name. rackctl picks, in order: `--context NAME`, then
$RACKCTL_CONTEXT, then `default`; NAME may also be the path of a context file. Contexts live in
$RACKCTL_CONTEXTS, else $RACKPLANE_HOME/contexts, else .rackplane/contexts of the checkout.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "default"


@dataclass(frozen=True)
class Context:
    url: str
    nkey: str | None = None
    ca: str | None = None
    identity: str | None = None


def contexts_dir() -> Path:
    if d := os.environ.get("RACKCTL_CONTEXTS"):
        return Path(d)
    return Path(os.environ.get("RACKPLANE_HOME") or ROOT / ".rackplane") / "contexts"


def path_of(name: str) -> Path:
    if name.endswith(".json") or os.sep in name:
        return Path(name)
    return contexts_dir() / f"{name}.json"


def load(name: str | None = None) -> Context | None:
    """The context asked for (an error if it does not exist), or the default one if there is one."""
    asked = name or os.environ.get("RACKCTL_CONTEXT") or None
    path = path_of(asked or DEFAULT)
    if not path.exists():
        if asked:
            raise ConnectionError(f"no rackctl context {asked!r} (looked for {path})")
        return None
    try:
        return Context(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ConnectionError(f"rackctl context {path} is not valid: {e}") from None


def write(name: str, context: Context, dir: Path | None = None) -> Path:
    path = (dir or contexts_dir()) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(context), indent=1) + "\n")
    return path
