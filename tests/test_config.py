"""Settings: one class reads every variable, a bad value is one line naming it, and the docs' table is the
class's own output."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ConfigError, Settings, table
from tests.conftest import make_stack

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_table_is_the_settings_class() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(r"<!-- settings: python -m shared.config -->\n(.*?)<!-- end settings -->", text, re.S)
    assert m, "docs/architecture.md has no settings table"
    assert m[1] == table(), "docs/architecture.md: run `python -m shared.config` and paste its table"


def test_no_service_reads_the_environment_but_the_settings() -> None:
    """Every setting of a service process is a field of `Settings`: no other module reads os.environ."""
    readers = []
    for folder in ("services", "shared"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "config.py" and re.search(r"os\.environ|os\.getenv", path.read_text()):
                readers.append(str(path.relative_to(ROOT)))
    # rackctl's tracing reads RACKPLANE_TRACES itself; services pass theirs from Settings
    assert readers == ["shared/telemetry.py"], readers


def test_defaults_and_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [f.validation_alias for f in Settings.model_fields.values()]:
        monkeypatch.delenv(str(name), raising=False)
    s = Settings.from_env()
    assert (s.sleds, s.retention, s.faults, s.sled_shapes, s.crash_at) == (8, 604800.0, False, None, set())
    url = tmp_path / "db.url"
    url.write_text("postgresql://im@db/rackplane\n")
    monkeypatch.setenv("DATABASE_URL_FILE", str(url))
    monkeypatch.setenv("RACKPLANE_SLED_SHAPES", "4:8,2:4")
    monkeypatch.setenv("RACKPLANE_CRASH_AT", "a,b*")
    monkeypatch.setenv("RACKPLANE_FAULTS", "1")
    monkeypatch.setenv("RACKPLANE_PRUNE_INTERVAL", "")  # empty is unset
    monkeypatch.setenv("RACKPLANE_ACK_WAIT", "2m")
    s = Settings.from_env()
    assert s.database_url == "postgresql://im@db/rackplane"
    assert (s.sled_shapes, s.crash_at, s.faults) == ([(4, 8), (2, 4)], {"a", "b*"}, True)
    assert (s.prune_interval, s.ack_wait) == (60.0, 120.0)
    monkeypatch.setenv("DATABASE_URL", "postgresql://given@db/rackplane")
    assert Settings.from_env().database_url == "postgresql://given@db/rackplane"


@pytest.mark.parametrize(
    ("name", "raw", "expects"),
    [
        ("RACKPLANE_ACK_WAIT", "soon", "expected positive seconds or a duration"),
        ("RACKPLANE_VMM_START_DELAY", "-1", "expected seconds or a duration"),
        ("RACKPLANE_SLEDS", "eight", "valid integer"),
        ("RACKPLANE_SLED_SHAPES", "64:256:1", "expected VCPUS:RAM_GIB pairs"),
        ("RACKPLANE_FAULTS", "perhaps", "expected 1 or 0 (on/off, true/false, yes/no)"),
        ("RACKPLANE_LOG", "loud", "expected DEBUG, INFO"),
        ("RACKPLANE_TRACES", "jaeger", "expected none, console, otlp or file:PATH"),
        ("DATABASE_URL_FILE", "/nonexistent/db.url", "cannot read it"),
        ("RACKPLANE_INVENTORY_TTL", "1", "expected at least the inventory interval"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str, expects: str
) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as caught:
        Settings.from_env()
    line = str(caught.value)
    assert line.startswith(f"{name}={raw!r}: ") and expects in line and "\n" not in line, line


def test_a_bad_value_stops_a_service_before_it_connects() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RACKPLANE_SLEDS": "many", "NATS_URL": "nats://127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-m", "services.sled_agent"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "sled-agent: RACKPLANE_SLEDS='many': input should be a valid integer, unable to parse string as an "
        "integer"
    ]


def test_a_stack_whose_service_refuses_its_settings_leaves_nothing_running() -> None:
    """The stack stops what it started when one part does not come up (here the services, on a bad
    value): a failed start must not leave a broker, a database and services behind, using the machine."""
    stack = make_stack("refused", RACKPLANE_VMM_START_DELAY="soon")
    try:
        with pytest.raises((RuntimeError, TimeoutError), match="RACKPLANE_VMM_START_DELAY"):
            stack.start()
        assert not [key for key, svc in stack.services.items() if svc.alive]
        assert stack.nats is not None and stack.nats.proc is None
        assert stack.postgres is not None and not (stack.postgres.data / "postmaster.pid").exists()
    finally:
        stack.stop()
        shutil.rmtree(stack.dir, ignore_errors=True)
