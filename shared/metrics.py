"""Counters, gauges and durations of one process, kept once and seen two ways.

`count` is the one place a process counts something (a stale report, a duplicate delta, a dead letter).
The counts live in `COUNTERS`; `rp.svc.<service>.stats` (and so `rackctl stats`) returns them as they are,
and the OpenTelemetry meter reads the same numbers when `/metrics` is scraped (observable counters whose
callbacks look into `COUNTERS`), so the two can never disagree. Gauges (`GAUGES`: consumer lag, outbox
depth) work the same way; the ones that need a query are sampled by `sample()` just before either is read.
Durations (handlers, saga steps, reconcile passes) are histograms: they exist on `/metrics` only.

Every metric is declared once in `METRICS`, with the HELP text `/metrics` gives it (Prometheus' linter,
`promtool check metrics`, refuses a metric without one) and the services that export it at 0 from their
start, so that an alert on its increase has a series before the first count; docs/architecture.md's list
is `python -m shared.metrics`. A consumer's counters are all exported at 0 from its first fetch.

Names: a counter `<group>.<what>` (`reports.stale`) is exported as `rackplane.<group>.<what>`
(Prometheus: `rackplane_reports_stale_total`); one counted for a durable consumer (`count("handled",
consumer=...)`, kept as `<durable>.handled`) as `rackplane.messages.<what>` with the attribute
`messaging.consumer.group.name` (`rackplane_messages_handled_total{messaging_consumer_group_name=...}`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.semconv._incubating.attributes.messaging_attributes import MESSAGING_CONSUMER_GROUP_NAME
from opentelemetry.semconv._incubating.metrics.messaging_metrics import MESSAGING_PROCESS_DURATION

log = logging.getLogger(__name__)

IM, ACCT, REC, SA = "instance-manager", "accounting", "recovery", "sled-agent"
ALL = (IM, ACCT, REC, SA)
DB = (IM, ACCT, REC)
"""The services that count something: a counter is exported, at 0, from the start in each of its own."""


@dataclass(frozen=True)
class Metric:
    """One metric's kind, HELP text, and the services that export it from the start (at 0, so that an
    alert on its increase has a series from the first scrape); none for a name with a `*` in it (one of a
    free-form family, known only once counted) and for gauges (set when first known)."""

    kind: Literal["counter", "gauge", "histogram"]
    help: str
    services: tuple[str, ...] = ()


def _c(help: str, *services: str) -> Metric:
    return Metric("counter", help, services)


METRICS: dict[str, Metric] = {
    # what a durable consumer did with a message: `<durable>.<what>`, labelled by the consumer
    "messages.handled": _c("Messages a durable consumer handled and acknowledged", *ALL),
    "messages.dead_lettered": _c("Messages a durable consumer parked in the DLQ, with their reason", *ALL),
    "messages.retried": _c("Messages handed back to be redelivered later (not yet applicable)", *ALL),
    "messages.transient_errors": _c("Messages handed back while the infrastructure was away", *ALL),
    "messages.fetch_errors": _c("Fetches from the broker that failed", *ALL),
    "messages.batches": _c("Batches of messages applied at once (accounting)", *ALL),
    "messages.batch_splits": _c("Batches split to isolate a failing message", *ALL),
    "messages.pending": Metric(
        "gauge", "Messages the broker still holds for the consumer after its last fetch"
    ),
    # every service
    "commands.rejected": _c("Requests answered with an error before their handler ran (bad input)", *ALL),
    "faults.drop_first_attempt": _c("Injected: first deliveries dropped", *ALL),
    "faults.delay": _c("Injected: deliveries delayed", *ALL),
    "faults.duplicate": _c("Injected: deliveries duplicated", *ALL),
    "faults.reorder": _c("Injected: messages moved out of order in a batch", *ALL),
    "faults.duplicate_request": _c("Injected: requests handled twice", *ALL),
    "faults.delay_reply": _c("Injected: replies delayed", *ALL),
    "faults.drop_reply": _c("Injected: replies dropped", *ALL),
    "faults.slow_handler": _c("Injected: handlers slowed down", *ALL),
    "faults.hold_ack": _c("Injected: acknowledgements held back", *ALL),
    "outbox.published": _c("Outbox rows published", *DB),
    "outbox.errors": _c("Outbox relay passes that failed", *DB),
    "outbox.depth": Metric("gauge", "Outbox rows committed and not yet published"),
    "inventories.applied": _c("Sled inventories applied", IM, REC),
    "inventories.stale": _c("Sled inventories refused as older than the one applied", IM, REC),
    # instance-manager
    "commands.limited": _c("Requests refused by a tenant's rate limit", IM),
    "commands.busy": _c(
        "Creates, starts and migrations refused busy: more sagas in hand than a backlog's worth", IM
    ),
    "reports.applied": _c("VMM reports applied", IM),
    "reports.stale": _c("VMM reports refused by the generation fence", IM),
    "reports.wrong_sled": _c("VMM reports from a sled the VMM is not on", IM),
    "reports.unknown": _c("VMM reports about a VMM this service does not know", IM),
    "reports.detached": _c("VMM reports about a VMM no longer its instance's", IM),
    "migrations.done": _c("Migrations finished", IM),
    "migrations.failed": _c("Migrations failed", IM),
    "vmms.lost": _c("VMMs ended as lost on recovery's order", IM),
    "vmms.lost_already_ended": _c("VMMs recovery reported lost that had already ended", IM),
    "zombies.destroyed": _c("Zombie VMMs ordered destroyed", IM),
    "orders.stale.*": Metric("counter", "Recovery's orders refused as stale, by order"),
    "placement.contended": _c("Placements retried because another took the capacity", IM),
    "inventories_first.waited_out": _c("Lost orders that stopped waiting for the inventories ahead", IM),
    "reports_first.waited_out": _c("Stuck orders that stopped waiting for the VMM reports ahead", IM),
    "charge.waits_timed_out": _c("Requests that stopped waiting for accounting's outcome", IM),
    "outcomes.unsolicited": _c("Provisioning outcomes no saga waited for", IM),
    "pool.picked": _c("Instances started from a warm pool", IM),
    "pool.empty": _c("Starts that found their warm pool empty", IM),
    "pool.provisioned": _c("Warm pool members provisioned", IM),
    "pool.refused": _c("Warm pool members refused (quota)", IM),
    "pool.backing_off": _c("Warm pool keeper passes spent backing off", IM),
    "pool.keeper_errors": _c("Warm pool keeper passes that failed", IM),
    "saga.step_retries": _c("Saga steps retried", IM),
    "saga.steps_grouped": _c("Sagas whose steps were recorded in one statement with others'", IM),
    "saga.leases_lost": _c("Saga leases lost to another replica", IM),
    "saga.lease_renewals_failed": _c("Saga lease renewals that failed", IM),
    "saga.undo_spared_active_vmm": _c("Saga undos that left an instance's active VMM running", IM),
    "prune.pass_errors": _c("Prune passes that failed", IM),
    "prune.passes_skipped": _c("Prune passes skipped (another replica's turn)", IM),
    "pruned.*": Metric("counter", "Rows pruned past retention, by table"),
    # accounting
    "deltas.applied": _c("Provisioning deltas applied", ACCT),
    "deltas.refused": _c("Provisioning deltas refused (over quota)", ACCT),
    "deltas.stale": _c("Provisioning deltas refused by the generation fence", ACCT),
    "deltas.duplicate": _c("Provisioning deltas seen again (already applied)", ACCT),
    "deltas.forged": _c("Provisioning deltas whose subject and body disagree", ACCT),
    # recovery
    "reconcile.runs_where.passes": _c("Passes of the runs_where reconciler", REC),
    "reconcile.runs_where.pass_errors": _c("Passes of the runs_where reconciler that failed", REC),
    "reconcile.runs_where.passes_skipped": _c("Passes of runs_where skipped (another replica's)", REC),
    "reconcile.bring_back.passes": _c("Passes of the bring_back reconciler", REC),
    "reconcile.bring_back.pass_errors": _c("Passes of the bring_back reconciler that failed", REC),
    "reconcile.bring_back.passes_skipped": _c("Passes of bring_back skipped (another replica's)", REC),
    "reconcile.vmm_lost": _c("VMMs recovery ordered ended as lost", REC),
    "reconcile.vmm_lost_stale": _c("vmm.lost orders refused as stale", REC),
    "reconcile.vmm_lost_errors": _c("vmm.lost orders that failed", REC),
    "reconcile.stuck": _c("vmm.stuck orders accepted", REC),
    "reconcile.stuck_reports_late": _c("VMMs judged stuck whose report came late", REC),
    "reconcile.zombie": _c("vmm.zombie orders accepted", REC),
    "reconcile.restart": _c("instance.restart orders accepted", REC),
    "reconcile.settle": _c("instance.settle orders accepted", REC),
    "reconcile.*_*": Metric("counter", "Recovery's orders refused, by order and error code"),
    # sled-agent
    "sled.reports": _c("VMM reports sent", SA),
    "sled.reboots": _c("Simulated sled reboots", SA),
    "sled.ensure_repeated": _c("vmm.ensure commands for a VMM already as asked", SA),
    "sled.ensure_for_old_boot": _c("vmm.ensure commands meant for a previous boot", SA),
    "sled.migrations": _c("Migrations started", SA),
    "sled.migrations_abandoned": _c("Migrations abandoned", SA),
    "sled.migrations_finished_on_resume": _c("Migrations finished when a frozen sled resumed", SA),
    "sled.migrations_timed_out": _c("Migrations timed out", SA),
    "sled.fault.command_dropped": _c("Simulated: commands dropped", SA),
    "sled.fault.command_held": _c("Simulated: commands held back on the stream (hold_commands_seconds)", SA),
    "sled.fault.failed_start": _c("Simulated: VMM starts failed", SA),
    "sled.fault.dropped": _c("Simulated: reports dropped", SA),
    "sled.fault.delayed": _c("Simulated: reports delayed", SA),
    "sled.fault.delayed_delivered": _c("Simulated: delayed reports delivered", SA),
    "sled.fault.duplicated": _c("Simulated: reports duplicated", SA),
    # durations
    MESSAGING_PROCESS_DURATION: Metric(
        "histogram",
        "How long a consumer took to handle one message or batch (labels: messaging_system, "
        "messaging_consumer_group_name, messaging_destination_template, error_type)",
    ),
    "rackplane.saga.step.duration": Metric(
        "histogram",
        "How long one attempt of one saga step took (labels: saga, step, undo <step> for an undo, "
        "error_type)",
    ),
    "rackplane.reconcile.pass.duration": Metric(
        "histogram",
        "How long one pass of one of recovery's reconcilers took (labels: reconciler, error_type)",
    ),
}
"""Every metric, by its stats name (`messages.<what>` for a consumer's): the one place its HELP is written;
docs/architecture.md's metrics list is `python -m shared.metrics`."""


def describe(name: str) -> Metric | None:
    """The table's entry for the stats name `name` (exact, else the first pattern it matches)."""
    found = METRICS.get(name)
    if found is None:
        found = next((m for k, m in METRICS.items() if "*" in k and fnmatchcase(name, k)), None)
    return found


COUNTERS: collections.Counter[str] = collections.Counter()
"""Every count of this process, by its stats name."""
GAUGES: dict[str, float] = {}
"""Every gauge of this process, by its stats name."""

meter = metrics.get_meter("rackplane")
_exported: dict[str, list[tuple[str, dict[str, str]]]] = {}
"""Metric name -> the (stats name, attributes) of each of its series."""
_series: set[str] = set()
"""The stats names exported (a counter exported at 0 is not in COUNTERS, the stats reply, until counted)."""
_consumers: set[str] = set()
"""The durable consumers whose counters are exported (all of them, at 0, from the first one seen)."""


def count(name: str, n: int = 1, *, consumer: str | None = None) -> None:
    """Count `n` of `name`; with `consumer`, something that durable consumer did with a message."""
    key = f"{consumer}.{name}" if consumer else name
    if consumer and consumer not in _consumers:
        _consumer(consumer)
    if key not in _series:
        _export(COUNTERS, key, name, consumer)
    COUNTERS[key] += n


def gauge(name: str, value: float, *, consumer: str | None = None) -> None:
    """Set the gauge `name` (named and exported as `count` names and exports counters)."""
    key = f"{consumer}.{name}" if consumer else name
    if consumer and consumer not in _consumers:
        _consumer(consumer)
    if key not in _series:
        _export(GAUGES, key, name, consumer)
    GAUGES[key] = value


def _consumer(consumer: str) -> None:
    """Export every counter of a durable consumer at 0, the first time anything of it is counted (its
    lag is set by its first fetch): its dead letters have a series long before its first one."""
    _consumers.add(consumer)
    for name, m in METRICS.items():
        if m.kind == "counter" and name.startswith("messages."):
            _zero(name.removeprefix("messages."), consumer)


def _zero(name: str, consumer: str | None = None) -> None:
    """Export a counter before it is first counted: it reads 0 (COUNTERS' default) until then."""
    key = f"{consumer}.{name}" if consumer else name
    if key not in _series:
        _export(COUNTERS, key, name, consumer)


def _export(
    store: collections.Counter[str] | dict[str, float], key: str, name: str, consumer: str | None
) -> None:
    """Add the series `key` to its metric, made the first time it is needed."""
    metric = f"rackplane.messages.{name}" if consumer else f"rackplane.{name}"
    series = _exported.get(metric)
    if series is None:
        series = _exported[metric] = []
        create = meter.create_observable_counter if store is COUNTERS else meter.create_observable_gauge
        known = describe(f"messages.{name}" if consumer else name)
        if known is None:
            log.warning("metric %s has no entry in shared/metrics.py METRICS: exported without HELP", metric)
        create(metric, callbacks=[_observer(series, store)], description=known.help if known else metric)
    series.append((key, {MESSAGING_CONSUMER_GROUP_NAME: consumer} if consumer else {}))
    _series.add(key)


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
            async with asyncio.timeout(timeout):
                await fn()
        except Exception as e:
            log.debug("sampler %s: %s", getattr(fn, "__qualname__", fn), e)


# --- durations ------------------------------------------------------------------------------------------

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

HISTOGRAMS = {name: m.help for name, m in METRICS.items() if m.kind == "histogram"}
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
    for name, m in METRICS.items():
        if (
            m.kind == "counter"
            and service in m.services
            and not name.startswith("messages.")
            and "*" not in name
        ):
            _zero(name)


def scrape(openmetrics: bool = False) -> tuple[str, bytes]:
    """The content type and exposition of every metric of the process: Prometheus' text format, or
    OpenMetrics when the scraper asks for it."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
    from prometheus_client.openmetrics import exposition

    if openmetrics:
        return exposition.CONTENT_TYPE_LATEST, exposition.generate_latest(REGISTRY)
    return CONTENT_TYPE_LATEST, generate_latest(REGISTRY)


_SUFFIX = {"counter": "_total", "gauge": "", "histogram": "_seconds"}


def table() -> str:
    """The metrics list of docs/architecture.md, from METRICS."""
    rows = [
        "| metric (Prometheus) | stats name | kind | at 0 from the start in | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in METRICS.items():
        label = "{messaging_consumer_group_name}" if name.startswith("messages.") else ""
        shown = name if name.startswith(("rackplane.", "messaging.")) else f"rackplane.{name}"
        shown = shown.replace(".", "_").replace("*", "<x>") + _SUFFIX[m.kind]
        stats = f"`<durable>.{name.removeprefix('messages.')}`" if label else f"`{name}`"
        if m.kind == "histogram":
            stats = "(/metrics only)"
        starts = ", ".join(m.services) if len(m.services) < len(ALL) else "every service"
        rows.append(f"| `{shown}{label}` | {stats} | {m.kind} | {starts or '-'} | {m.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
