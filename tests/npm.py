"""The Node checks' one install step: node and npm found, a folder's pinned packages installed by `npm ci`
(once, and again when they no longer match its package-lock.json), or the test skipped with the reason
(no node or npm, node older than 18, the npm registry out of reach)."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

UNREACHABLE = re.compile(
    r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|EHOSTUNREACH|network|FetchError"
    r"|code E[45]\d\d|UNABLE_TO_GET_ISSUER_CERT|SELF_SIGNED_CERT|CERT_HAS_EXPIRED"
)
"""What npm says when the registry is out of reach or refuses (a proxy's 403, a registry's 5xx, a TLS
interception): the test is skipped with it; any other failure of `npm ci` fails the test."""


def _installed(folder: Path) -> bool:
    """Whether node_modules holds every package of the lockfile at its locked version (an optional one, for
    another platform, may be missing)."""
    lock = json.loads((folder / "package-lock.json").read_text())
    for where, package in lock["packages"].items():
        if not where or package.get("optional"):
            continue
        installed = folder / where / "package.json"
        if not installed.exists() or json.loads(installed.read_text()).get("version") != package["version"]:
            return False
    return True


def npm_ci(folder: Path, what: str) -> str:
    """node's path, with `folder`'s packages installed; `what` names the check in a skip's reason."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"node and npm are needed for {what}")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 18:
        pytest.skip(f"{what} needs node 18 or newer (found {version})")
    # one install at a time: pytest-xdist may run these tests in two workers, and `npm ci` begins by
    # removing node_modules
    with open(Path(tempfile.gettempdir()) / f"rackplane-npm-{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed(folder):
            return node
        try:
            r = subprocess.run(
                [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=180,
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm ci for {what} timed out: is the npm registry reachable?")
    if r.returncode != 0 and (offline := UNREACHABLE.search(r.stderr)):
        pytest.skip(f"the npm registry cannot be reached (or refused) for {what}: {offline.group(0)}")
    assert r.returncode == 0, r.stderr
    return node
