"""`make run` and `make test` say first, in one line each with its fix, what the machine lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "preflight.py"


def run(target: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), target], capture_output=True, text=True, env=env)


def test_a_machine_with_what_it_needs_passes() -> None:
    r = run("test", {"PATH": "/usr/bin:/bin"})
    assert (r.returncode, r.stderr) == (0, "")


def test_missing_postgres_binaries_are_named_with_their_fix(tmp_path: Path) -> None:
    import deploy.preflight as preflight

    found = preflight.problems(need_postgres=False)
    assert found == []
    # No PostgreSQL anywhere on this PATH, and none under /usr/lib/postgresql: as on a fresh machine.
    original = preflight.glob.glob
    try:
        preflight.glob.glob = lambda pattern: []  # type: ignore[assignment]
        env_path = preflight.os.environ.get("PATH", "")
        preflight.os.environ["PATH"] = str(tmp_path)
        [line] = preflight.problems(need_postgres=True)
    finally:
        preflight.glob.glob = original  # type: ignore[assignment]
        preflight.os.environ["PATH"] = env_path
    assert "initdb, pg_ctl, postgres" in line and "apt-get install postgresql-15" in line


def test_make_run_with_a_database_url_needs_no_local_postgres() -> None:
    r = run("run", {"PATH": "/nonexistent", "DATABASE_URL": "postgresql://db/rackplane"})
    assert r.returncode == 0, r.stderr
