"""Tracing, and where the process's counters are reached (kept in shared/metrics.py).

Traces: one trace follows an operation from `rackctl` through every service, carried as W3C trace
context in NATS headers (there is no official OpenTelemetry instrumentation for nats-py). The exporter is
chosen by `RACKPLANE_TRACES`: `none` (default), `console`, `otlp` (OTLP over HTTP, configured by the
standard OTEL_EXPORTER_OTLP_* variables) or `file:PATH` (one JSON span a line, used by tests).

Spans follow OpenTelemetry's conventions: PRODUCER for a JetStream publish (and an outbox row, the
publish to come), CONSUMER for a stream message handled, CLIENT / SERVER for request and reply, CLIENT for
each PostgreSQL query (shared/db/pool.py); messaging spans are named `<operation> <subject template>`
(shared/topology/subjects.py `template`) and carry the messaging attributes (`messaging_attributes` below).

Counters: plain in-process counts (stale reports ignored, duplicates, dead letters...), readable with the
`stats` command of each service and on its `/metrics`, so that tests and operators see that a fence really
fired (shared/metrics.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_DESTINATION_NAME,
    MESSAGING_DESTINATION_TEMPLATE,
    MESSAGING_OPERATION_NAME,
    MESSAGING_OPERATION_TYPE,
    MESSAGING_SYSTEM,
    MessagingOperationTypeValues,
)
from opentelemetry.trace import SpanKind

from shared.metrics import COUNTERS, count
from shared.topology import subjects

__all__ = ["COUNTERS", "SpanKind", "count"]

_enabled = False

NATS = "nats"
"""The `messaging.system` of every messaging span and metric: the conventions list no value for NATS."""


def setup_tracing(service: str, spec: str | None = None) -> None:
    spec = spec if spec is not None else os.environ.get("RACKPLANE_TRACES", "none")
    global _enabled
    if spec in ("", "none"):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter: SpanExporter
    if spec == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif spec == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif spec.startswith("file:"):
        out = open(spec.removeprefix("file:"), "a", buffering=1)
        exporter = ConsoleSpanExporter(out=out, formatter=_span_line)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        raise ValueError(f"RACKPLANE_TRACES={spec!r}: expected none, console, otlp or file:PATH")
    trace.set_tracer_provider(provider)
    _enabled = True


def tracing() -> bool:
    """Whether spans go anywhere (RACKPLANE_TRACES set): what costs per query is only done then."""
    return _enabled


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def _span_line(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    parent = span.parent
    return (
        json.dumps(
            {
                "name": span.name,
                "kind": span.kind.name,
                "service": span.resource.attributes.get("service.name"),
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(parent.span_id, "016x") if parent else None,
                "attributes": dict(span.attributes or {}),
            }
        )
        + "\n"
    )


tracer = trace.get_tracer("rackplane")


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context to outgoing NATS headers."""
    propagate.inject(headers)
    return headers


def context_from(headers: Mapping[str, str] | None) -> Any:
    return propagate.extract(dict(headers or {}))


@contextmanager
def span(
    name: str,
    headers: Mapping[str, str] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    **attributes: Any,
) -> Iterator[trace.Span]:
    """A span, as a child of the trace context carried in `headers` when given."""
    ctx = context_from(headers) if headers is not None else None
    with tracer.start_as_current_span(name, context=ctx, kind=kind, attributes=attributes) as s:
        yield s


def messaging_attributes(
    subject: str, operation: MessagingOperationTypeValues, **more: Any
) -> dict[str, Any]:
    """The messaging conventions' attributes of one operation on `subject`."""
    return {
        MESSAGING_SYSTEM: NATS,
        MESSAGING_DESTINATION_NAME: subject,
        MESSAGING_DESTINATION_TEMPLATE: subjects.template(subject),
        MESSAGING_OPERATION_TYPE: operation.value,
        MESSAGING_OPERATION_NAME: operation.value,
        **more,
    }


@contextmanager
def messaging_span(
    subject: str,
    operation: MessagingOperationTypeValues,
    kind: SpanKind,
    headers: Mapping[str, str] | None = None,
    **more: Any,
) -> Iterator[trace.Span]:
    """A messaging span named `<operation> <subject template>`: `process rp.sled.{sled}.cmd.vmm.ensure`."""
    attributes = messaging_attributes(subject, operation, **more)
    name = f"{operation.value} {attributes[MESSAGING_DESTINATION_TEMPLATE]}"
    with span(name, headers, kind=kind, **attributes) as s:
        yield s


def current_traceparent() -> dict[str, str]:
    """The current trace context, to store with durable work (sagas, outbox rows) and resume later."""
    return inject({})
