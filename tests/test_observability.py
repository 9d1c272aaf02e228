"""Each service's metrics endpoint counts what it does, its readiness follows its database, and its logs
can be JSON lines that lead to their traces."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from deploy.stack import SERVICES, Stack
from rackctl.client import Client
from shared.logs import JsonFormatter
from tests.conftest import GiB, Rack, eventually, private_rack, wait_state
from tests.test_cli import assert_ok, rackctl

ROOT = Path(__file__).resolve().parent.parent
Samples = list[tuple[str, dict[str, str], float]]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def fetch(stack: Stack, key: str, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(get, stack.http_url(key, path))


async def scrape(stack: Stack, key: str) -> Samples:
    status, text = await fetch(stack, key, "/metrics")
    assert status == 200, text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples: Samples, name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


async def test_every_service_counts_on_its_metrics_what_it_handled_for_a_start(
    stack: Stack, client: Client, project: tuple[str, str]
) -> None:
    silo, proj = project
    before = {key: total(await scrape(stack, key), "rackplane_messages_handled_total") for key in SERVICES}
    await client.instance_create(silo, proj, "scraped", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "scraped")
    await wait_state(client, silo, proj, "scraped", "running")

    async def moved() -> dict[str, float] | None:
        now = {key: total(await scrape(stack, key), "rackplane_messages_handled_total") for key in SERVICES}
        return now if all(now[k] > before[k] for k in SERVICES) else None

    await eventually(moved, timeout=15)
    im = await scrape(stack, "instance_manager")
    names = {n for n, _, _ in im}
    assert "messaging_process_duration_seconds_count" in names  # handler durations
    assert "rackplane_saga_step_duration_seconds_count" in names
    assert "rackplane_outbox_depth" in names
    pending = [labels for n, labels, _ in im if n == "rackplane_messages_pending"]  # consumer lag
    assert {"messaging_consumer_group_name": "instance-manager-vmm-reports"} in pending
    recovery = {n for n, _, _ in await scrape(stack, "recovery")}
    assert "rackplane_reconcile_pass_duration_seconds_count" in recovery


async def test_stats_and_metrics_are_the_same_counters(stack: Stack, client: Client) -> None:
    """One place counts: every counter of `rp.svc.<service>.stats` is on /metrics, at least as high (the
    scrape comes after)."""
    for key in SERVICES:
        counters = (await client.stats(key.replace("_", "-")))["counters"]
        samples = await scrape(stack, key)
        assert counters, key
        for name, n in counters.items():
            group, _, what = name.rpartition(".")
            plain = f"rackplane_{name.replace('.', '_').replace('-', '_')}_total"
            exported = [
                v
                for metric, labels, v in samples
                if metric == plain
                or (
                    metric == f"rackplane_messages_{what}_total"
                    and labels.get("messaging_consumer_group_name") == group
                )
            ]
            assert exported and exported[0] >= n, (key, name, n, exported)


async def test_rackctl_stats_prints_the_counters(stack: Stack, client: Client) -> None:
    r = await rackctl(stack, "stats", "instance-manager", "--json")
    assert_ok(r)
    data = r.json()
    assert data["service"] == "instance-manager" and data["counters"]
    assert data["http_port"] == stack.http_ports["instance_manager"]
    assert "outbox.depth" in data["gauges"]
    r = await rackctl(stack, "stats", "instance-manager")
    assert_ok(r)
    lines = r.out.splitlines()
    assert lines[0].startswith("instance-manager (metrics on port ")
    assert lines[1].split() == ["NAME", "VALUE", "KIND"]
    assert any(line.split()[0] == "instance-manager-inventory.handled" for line in lines[2:])


@pytest.fixture
async def json_rack(tmp_path: Path) -> AsyncIterator[Rack]:
    async with private_rack(
        "readyz",
        RACKPLANE_SLEDS="2",
        RACKPLANE_LOG_FORMAT="json",
        RACKPLANE_TRACES=f"file:{tmp_path / 'traces.jsonl'}",
    ) as made:
        yield made


async def test_readyz_fails_while_postgres_is_stopped_and_passes_again_after(json_rack: Rack) -> None:
    stack, _, _ = json_rack
    with_db = ("instance_manager", "accounting", "recovery")

    async def statuses() -> dict[str, int]:
        return {key: (await fetch(stack, key, "/readyz"))[0] for key in SERVICES}

    assert await eventually(lambda: _all(statuses, 200))
    assert stack.postgres is not None
    stack.postgres.stop("immediate")
    try:
        down = await eventually(lambda: _only(statuses, with_db, 503), timeout=20)
        assert down["sled_agent"] == 200  # it has no database
        status, text = await fetch(stack, "accounting", "/readyz")
        assert status == 503 and text.startswith("database: "), text
        assert all([(await fetch(stack, key, "/healthz"))[0] == 200 for key in SERVICES])  # alive all along
    finally:
        stack.postgres.start()
    await eventually(lambda: _all(statuses, 200), timeout=30)

    for key in SERVICES:  # RACKPLANE_LOG_FORMAT=json: every line of every log is one JSON object
        lines = (stack.dir / f"{key}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert records and all(r["service"] == key.replace("_", "-") for r in records)
        assert {"ts", "level", "logger", "message"} <= set(records[0])


Statuses = Callable[[], Awaitable[dict[str, int]]]


async def _all(statuses: Statuses, want: int) -> dict[str, int] | None:
    now = await statuses()
    return now if set(now.values()) == {want} else None


async def _only(statuses: Statuses, keys: tuple[str, ...], want: int) -> dict[str, int] | None:
    now = await statuses()
    return now if all(now[k] == want for k in keys) else None


def test_a_json_log_line_carries_the_trace_and_span_of_its_span() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("accounting"))
    logger = logging.getLogger("tests.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("outside %s", "spans")
        with TracerProvider().get_tracer("t").start_as_current_span("work") as span:
            logger.warning("inside")
            ctx = span.get_span_context()
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    outside, inside, failed = (json.loads(line) for line in out.getvalue().splitlines())
    assert outside["message"] == "outside spans" and outside["service"] == "accounting"
    assert outside["level"] == "WARNING" and outside["logger"] == "tests.json"
    assert "trace_id" not in outside and outside["ts"].endswith("+00:00")
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert "ValueError: boom" in failed["exception"]


@pytest.mark.parametrize(
    ("variable", "value"),
    [("RACKPLANE_HTTP_PORT", "abc"), ("RACKPLANE_HTTP_PORT", "70000"), ("RACKPLANE_LOG_FORMAT", "xml")],
)
def test_a_bad_observability_setting_stops_the_service_naming_the_variable(variable: str, value: str) -> None:
    env = {**os.environ, variable: value, "NATS_URL": "nats://127.0.0.1:1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "services.recovery"], env=env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].startswith(f"recovery: {variable}={value!r}: expected"), p.stderr


def test_a_port_already_taken_stops_the_service_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **os.environ,
            "RACKPLANE_HTTP_PORT": str(port),
            "NATS_URL": "nats://127.0.0.1:1",
            "PYTHONPATH": str(ROOT),
        }
        p = subprocess.run(
            [sys.executable, "-m", "services.recovery"], env=env, capture_output=True, text=True, timeout=30
        )
    assert p.returncode != 0
    want = f"recovery: RACKPLANE_HTTP_PORT={port}: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert p.stderr.strip().splitlines()[-1] == want, p.stderr
