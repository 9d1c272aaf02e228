"""An earlier release of rackplane, checked out from git history, for tests that run its code beside
today's: a rolling upgrade, where old and new processes share the broker and the database."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PREVIOUS = "34d786e"
"""The last release before `rp.evt.instance.changed` v2: its instance-manager sends only v1, and its
recovery reads only v1."""


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)


@contextmanager
def checkout(commit: str = PREVIOUS) -> Iterator[Path]:
    """The source tree of `commit` in a folder of its own (removed afterwards). Skips the test, saying
    why, where the history is not there to take it from: no git, not a clone, or a shallow one."""
    if shutil.which("git") is None:
        pytest.skip(f"release {commit} is taken from git history, and git is not installed")
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        why = "this clone is shallow (git fetch --unshallow)" if shallow else "it is not in this checkout"
        pytest.skip(f"release {commit} is not in git history here: {why}")
    folder = Path(tempfile.mkdtemp(prefix=f"rackplane-release-{commit}-"))
    try:
        archived = _git("archive", "--format=tar", f"--output={folder / 'source.tar'}", commit)
        if archived.returncode != 0:
            pytest.fail(f"git archive {commit} failed: {archived.stderr.decode(errors='replace').strip()}")
        with tarfile.open(folder / "source.tar") as tar:
            tar.extractall(folder / "tree", filter="data")
        yield folder / "tree"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
