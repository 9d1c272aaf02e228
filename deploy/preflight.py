"""What `make run` and `make test` need from the machine, checked before anything is installed.

Run by the Makefile with the Python it was given, before the virtualenv exists, so it uses the standard
library only (and runs on an older Python, to say that it is too old). Each missing piece is one line
with its fix; the exit status is 1 if anything is missing.
"""

# ruff: noqa: UP031, UP036 (written for whatever Python the machine has, so that an old one hears why)

import glob
import os
import shutil
import sys

NEEDS_POSTGRES = ("initdb", "pg_ctl", "postgres")
NEEDS_HA = ("patroni", "etcd")
"""PostgreSQL under an HA manager (deploy/patroni.py): Debian's patroni and etcd-server."""


def problems(need_postgres: bool, need_ha: bool = False):
    found = []
    if sys.version_info < (3, 11):
        found.append(
            "rackplane needs Python 3.11 or newer, and %s is %d.%d: install python3.11 (Debian: apt-get "
            "install python3.11) or run make PYTHON=/path/to/python3.11"
            % (sys.executable, sys.version_info[0], sys.version_info[1])
        )
    try:
        import ensurepip  # noqa: F401
        import venv  # noqa: F401
    except ImportError:
        found.append(
            "%s cannot make virtualenvs (no venv/ensurepip module): apt-get install python3-venv "
            "(or python3.11-venv)" % sys.executable
        )
    if need_postgres:
        dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
        missing = [
            b
            for b in NEEDS_POSTGRES
            if not (shutil.which(b) or any(os.path.exists(os.path.join(d, b)) for d in dirs))
        ]
        if missing:
            found.append(
                "PostgreSQL's server binaries are missing (%s): apt-get install postgresql-15 (or set "
                "DATABASE_URL to a PostgreSQL 15 server for make run)" % ", ".join(missing)
            )
    if need_ha:
        missing = [b for b in NEEDS_HA if not (shutil.which(b) or os.path.exists("/usr/bin/" + b))]
        if missing:
            found.append(
                "PostgreSQL's HA manager is missing (%s): apt-get install --no-install-recommends patroni "
                "etcd-server" % ", ".join(missing)
            )
    return found


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "run"
    need_postgres = target == "test" or (target == "run" and not os.environ.get("DATABASE_URL"))
    # `make test-ha` (preflight.py ha) and `make run HA=1`: Patroni and etcd as well
    need_ha = target == "ha" or os.environ.get("HA", "") not in ("", "0")
    found = problems(need_postgres or target == "ha", need_ha)
    for line in found:
        sys.stderr.write("make %s: %s\n" % (target, line))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
