"""Counters, gauges and durations of one process, kept once and seen two ways.

`count` is the one place a process counts something (a stale report, a duplicate delta, a dead letter).
The counts live in `COUNTERS`; `rp.svc.<service>.stats` (and so `rackctl stats`) returns them as they are,
and the OpenTelemetry meter reads the same numbers when `/metrics` is scraped (observable counters whose
callbacks look into `COUNTERS`), so the two can never disagree. Gauges (`GAUGES`: consumer lag, outbox
depth) work the same way; the ones that need a query are sampled by `sample()` just before either is read.
Durations (handlers, saga steps, reconcile passes) are histograms: they exist on `/metrics` only.

Names: a counter `<group>.<what>` (`reports.stale`) is exported as `rackplane.<group>.<what>`
(Prometheus: `rackplane_reports_stale_total`); one counted for a durable consumer (`count("handled",
consumer=...)`, kept as `<durable>.handled`) as `rackplane.messages.<what>` with the attribute
`messaging.consumer.group.name` (`rackplane_messages_handled_total{messaging_consumer_group_name=...}`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.semconv._incubating.attributes.messaging_attributes import MESSAGING_CONSUMER_GROUP_NAME
from opentelemetry.semconv._incubating.metrics.messaging_metrics import MESSAGING_PROCESS_DURATION

log = logging.getLogger(__name__)

COUNTERS: collections.Counter[str] = collections.Counter()
"""Every count of this process, by its stats name."""
GAUGES: dict[str, float] = {}
"""Every gauge of this process, by its stats name."""

meter = metrics.get_meter("rackplane")
_exported: dict[str, list[tuple[str, dict[str, str]]]] = {}
"""Metric name -> the (stats name, attributes) of each of its series."""


def count(name: str, n: int = 1, *, consumer: str | None = None) -> None:
    """Count `n` of `name`; with `consumer`, something that durable consumer did with a message."""
    key = f"{consumer}.{name}" if consumer else name
    if key not in COUNTERS:
        _export(COUNTERS, key, name, consumer)
    COUNTERS[key] += n


def gauge(name: str, value: float, *, consumer: str | None = None) -> None:
    """Set the gauge `name` (named and exported as `count` names and exports counters)."""
    key = f"{consumer}.{name}" if consumer else name
    if key not in GAUGES:
        _export(GAUGES, key, name, consumer)
    GAUGES[key] = value


def _export(
    store: collections.Counter[str] | dict[str, float], key: str, name: str, consumer: str | None
) -> None:
    """Add the series `key` to its metric, made the first time it is needed."""
    metric = f"rackplane.messages.{name}" if consumer else f"rackplane.{name}"
    series = _exported.get(metric)
    if series is None:
        series = _exported[metric] = []
        create = meter.create_observable_counter if store is COUNTERS else meter.create_observable_gauge
        create(metric, callbacks=[_observer(series, store)])
    series.append((key, {MESSAGING_CONSUMER_GROUP_NAME: consumer} if consumer else {}))


def _observer(
    series: list[tuple[str, dict[str, str]]], store: collections.Counter[str] | dict[str, float]
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(store[key], attributes) for key, attributes in series]

    return observe


# --- gauges sampled on demand ---------------------------------------------------------------------------

Sampler = Callable[[], Awaitable[None]]
_samplers: list[Sampler] = []


def sampler(fn: Sampler) -> None:
    """Register `fn`, which sets gauges that take a query to know (the outbox's depth, say): `sample()`
    runs it before the gauges are read, by a scrape or a stats request."""
    _samplers.append(fn)


async def sample(timeout: float = 1.0) -> None:
    """Run every sampler, each within `timeout`; one that fails or is late leaves its gauges as they were."""
    for fn in _samplers:
        try:
            await asyncio.wait_for(fn(), timeout)
        except Exception as e:
            log.debug("sampler %s: %s", getattr(fn, "__qualname__", fn), e)


# --- durations ------------------------------------------------------------------------------------------

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

HISTOGRAMS = {
    MESSAGING_PROCESS_DURATION: "How long a consumer took to handle one message (or one batch)",
    "rackplane.saga.step.duration": "How long one saga step (or undo) took, attempt by attempt",
    "rackplane.reconcile.pass.duration": "How long one pass of recovery's reconcilers took",
}
_histograms = {
    name: meter.create_histogram(
        name, unit="s", description=text, explicit_bucket_boundaries_advisory=_BUCKETS
    )
    for name, text in HISTOGRAMS.items()
}


@contextmanager
def timed(histogram: str, **attributes: str) -> Iterator[dict[str, str]]:
    """Record how long the block took in `histogram`; the yielded attributes may be added to inside it,
    and an exception leaving the block adds `error.type`."""
    attrs = dict(attributes)
    start = time.perf_counter()
    try:
        yield attrs
    except BaseException as e:
        attrs["error.type"] = type(e).__qualname__
        raise
    finally:
        _histograms[histogram].record(time.perf_counter() - start, attrs)


def setup(service: str) -> None:
    """Give the process a meter provider whose metrics the Prometheus client's registry serves
    (`shared/endpoint.py` answers `/metrics` from it)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    reader = PrometheusMetricReader(scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": service}))
    metrics.set_meter_provider(provider)


def scrape() -> bytes:
    """The Prometheus text exposition of every metric of the process."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY)
