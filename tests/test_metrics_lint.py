"""Metrics that lint: every metric has its HELP from one table (shared/metrics.py METRICS, which
docs/architecture.md's list is generated from), every counter has a series at 0 from the start, and each
service's /metrics passes Prometheus' own linter, `promtool check metrics`."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import urllib.request
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from deploy.stack import SERVICES, Stack
from rackctl.client import Client
from shared.metrics import METRICS, describe, table
from tests.conftest import GiB, eventually, wait_state

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL = shutil.which("promtool")

COUNTED = re.compile(
    r"""(?:telemetry|metrics)\.(count|gauge)\(\s*f?"([^"]+)"(?:[^()]*?consumer=)?|counter="([^"]+)\""""
)


def get(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


def names_in_code() -> set[str]:
    """Every stats name the code counts or sets (`messages.<what>` for a consumer's), a `*` for each
    f-string placeholder."""
    found = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]:
        for m in COUNTED.finditer(path.read_text()):
            name = re.sub(r"\{[^}]*\}", "*", m[2] or m[3])
            found.add(f"messages.{name}" if "consumer=" in m[0] else name)
    return found


def test_docs_metrics_list_is_the_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(r"<!-- metrics: python -m shared.metrics -->\n(.*?)<!-- end metrics -->", text, re.S)
    assert m, "docs/architecture.md has no metrics table"
    assert m[1] == table(), "docs/architecture.md: run `python -m shared.metrics` and paste its table"


def test_every_name_counted_in_the_code_has_help_in_the_table() -> None:
    names = names_in_code()
    assert {"reports.stale", "messages.dead_lettered", "outbox.depth", "orders.stale.*"} <= names, names
    missing = sorted(
        n
        for n in names
        if (describe(n) if "*" not in n else None) is None
        and not any(fnmatchcase(k, n) or fnmatchcase(n, k) for k in METRICS)
    )
    assert not missing, f"counted in the code, no entry in shared/metrics.py METRICS: {missing}"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
async def test_promtool_check_metrics_passes_for_every_service(
    stack: Stack, client: Client, project: tuple[str, str]
) -> None:
    """After a start (so that every kind of metric has series: counters, gauges, histograms)."""
    silo, proj = project
    await client.instance_create(silo, proj, "linted", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "linted")
    await wait_state(client, silo, proj, "linted", "running")
    for key in SERVICES:
        await client.stats(key.replace("_", "-"))  # up and serving
        _, text = await asyncio.to_thread(get, stack.http_url(key))
        lint = await asyncio.to_thread(
            subprocess.run,
            [str(PROMTOOL), "check", "metrics"],
            input=text,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert lint.returncode == 0, f"{key}: promtool check metrics:\n{lint.stdout}{lint.stderr}"
        helps = re.findall(r"^# HELP (rackplane_\S+)(.*)$", text, re.M)
        assert helps and all(h.strip() for _, h in helps), (key, [n for n, h in helps if not h.strip()])


async def test_every_consumers_dead_letter_counter_has_a_series_from_the_start(
    stack: Stack, client: Client
) -> None:
    """A consumer's dead-letter counter is exported (at 0 until its first letter) as soon as the consumer
    fetches, and every service's own counters from its start: an alert on their increase has a series
    from the first scrape."""
    for key in SERVICES:
        service = key.replace("_", "-")

        async def fetched(service: str = service) -> dict[str, Any] | None:  # a consumer has fetched
            stats = await client.stats(service)
            return stats if any(k.endswith(".pending") for k in stats["gauges"]) else None

        stats = await eventually(fetched)
        consumers = {k.removesuffix(".pending") for k in stats["gauges"] if k.endswith(".pending")}
        _, text = await asyncio.to_thread(get, stack.http_url(key))
        samples = [
            (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
        ]
        assert consumers, key
        letters = {
            labels["messaging_consumer_group_name"]: v
            for n, labels, v in samples
            if n == "rackplane_messages_dead_lettered_total"
        }
        assert set(letters) >= consumers, (key, consumers - set(letters))
        for durable in consumers:  # 0 unless this consumer really parked a message
            assert letters[durable] == stats["counters"].get(f"{durable}.dead_lettered", 0), (key, durable)
        own = [n for n, m in METRICS.items() if service in m.services and not n.startswith("messages.")]
        for name in own:
            assert f"rackplane_{name.replace('.', '_')}_total" in {n for n, _, _ in samples}, (key, name)


async def test_metrics_are_openmetrics_when_the_scraper_asks(stack: Stack, client: Client) -> None:
    await client.stats("accounting")
    kind, text = await asyncio.to_thread(
        get, stack.http_url("accounting"), "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
    )
    assert kind.startswith("application/openmetrics-text"), kind
    assert text.endswith("# EOF\n")
    families = {f.name for f in openmetrics_families(text)}
    assert "rackplane_messages_dead_lettered" in families, sorted(families)
    kind, text = await asyncio.to_thread(get, stack.http_url("accounting"))
    assert kind.startswith("text/plain") and "# EOF" not in text
