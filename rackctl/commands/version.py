"""`rackctl version` (and `rackctl --version`): what this rackctl is, to quote in a bug report."""

from __future__ import annotations

import collections
import importlib.metadata
import subprocess
from pathlib import Path
from typing import Any

from rackctl.commands.args import json_flag
from rackctl.commands.base import Invocation, command
from shared.messages import registry

PACKAGE = "rackplane"


def version_info() -> dict[str, Any]:
    """The package version, the git commit when run from a checkout, and the message schemas it speaks."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    schemas: dict[str, list[int]] = {}
    for schema, v in sorted(registry()):
        schemas.setdefault(schema, []).append(v)
    return {"version": version, "commit": _commit(), "schemas": schemas}


def version_text(info: dict[str, Any] | None = None) -> str:
    info = info or version_info()
    by_version = collections.Counter(v for versions in info["schemas"].values() for v in versions)
    versions = ", ".join(f"v{v}: {n}" for v, n in sorted(by_version.items()))
    commit = f" (git {info['commit']})" if info["commit"] else ""
    return f"rackctl {info['version']}{commit}\nmessage schemas: {len(info['schemas'])} ({versions})"


def _commit() -> str | None:
    """The checkout's commit, with `-dirty` if it has changes; None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=2,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


@command(
    "version",
    "show rackctl's version, its git commit, and the message schemas it speaks",
    json_flag,
    examples=("rackctl version", "rackctl version --json  # with every schema and its version"),
)
async def version(ctx: Invocation) -> None:
    ctx.emit(version_info(), lambda info: print(version_text(info)))
