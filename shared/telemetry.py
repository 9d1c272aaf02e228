"""Tracing and counters.

Traces: one trace follows an operation from `rackctl` through every service, carried as W3C trace
context in NATS headers (there is no official OpenTelemetry instrumentation for nats-py). The exporter is
chosen by `RACKPLANE_TRACES`: `none` (default), `console`, `otlp` (OTLP over HTTP, configured by the
standard OTEL_EXPORTER_OTLP_* variables) or `file:PATH` (one JSON span a line, used by tests).

Counters: plain in-process counts (stale reports ignored, duplicates, dead letters...), readable with the
`stats` command of each service so that tests and operators see that a fence really fired.
"""

from __future__ import annotations

import collections
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

COUNTERS: collections.Counter[str] = collections.Counter()


def count(name: str, n: int = 1) -> None:
    COUNTERS[name] += n


def setup_tracing(service: str, spec: str | None = None) -> None:
    spec = spec if spec is not None else os.environ.get("RACKPLANE_TRACES", "none")
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
def span(name: str, headers: Mapping[str, str] | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """A span, as a child of the trace context carried in `headers` when given."""
    ctx = context_from(headers) if headers is not None else None
    with tracer.start_as_current_span(name, context=ctx, attributes=attributes) as s:
        yield s


def current_traceparent() -> dict[str, str]:
    """The current trace context, to store with durable work (sagas, outbox rows) and resume later."""
    return inject({})
