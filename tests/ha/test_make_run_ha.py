"""`make run HA=1` as a user runs it: it comes up, says where everything listens, writes stack.json, walks
the README's walkthrough unchanged, and stops every process on Ctrl-C (tests/test_make_run.py does the
same for `make run`)."""

from __future__ import annotations

import json

import pytest

from deploy.stack import REPLICATED, replica_key
from tests.test_make_run import make_run, walk_the_readme

pytestmark = pytest.mark.ha


def test_make_run_ha_walks_the_readme_and_stops_everything() -> None:
    with make_run("HA=1", up_within=180) as run:
        assert "every stream at 3 replicas" in run.output, run.output
        processes = json.loads((run.home / "stack.json").read_text())["processes"]
        roles: dict[str, int] = {}
        for p in processes:
            roles[p["role"]] = roles.get(p["role"], 0) + 1
            assert p["pid"], p  # every process running, and found by its pid
        assert roles["nats"] == 3, processes
        assert roles["patroni"] == 2 and roles["etcd"] == 3, processes
        names = {p["name"] for p in processes}
        for service in REPLICATED:
            assert {service, replica_key(service)} <= names, names
        check = run.rackctl("check", "--no-at-rest")
        assert check.returncode == 0 and "every invariant holds" in check.stdout, check
        walk_the_readme(run.rackctl)
