"""Each service's small HTTP endpoint, for Prometheus and for whatever runs the process:

- `/metrics`: every metric of the process, in Prometheus' text format, or OpenMetrics when the scraper's
  `Accept` asks for `application/openmetrics-text` (shared/metrics.py);
- `/healthz`: 200 while the process's event loop answers at all (restart it if not);
- `/readyz`: 200 once the service serves and while each of its dependencies answers within `TIMEOUT`
  (the broker connected; `SELECT 1` on the database pool), else 503 with one line per failing check.

A few lines of asyncio, not a web framework: three paths, GET only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared import metrics

log = logging.getLogger(__name__)

TIMEOUT = 1.0
"""Seconds a readiness check may take before it counts as failed."""

Check = Callable[[], Awaitable[None]]
"""A readiness check: returns if the dependency answers, raises (with the reason) if not."""

checks: dict[str, Check] = {}
serving = False
"""Set once the service answers its requests (shared/service.py serve_stats): ready from then on, while
every check passes."""


def check(name: str, fn: Check) -> None:
    checks[name] = fn


async def readiness() -> list[str]:
    """What keeps the service from being ready, one line each; none when it is."""
    failing = [] if serving else ["service: starting"]
    for name, fn in checks.items():
        try:
            async with asyncio.timeout(TIMEOUT):
                await fn()
        except TimeoutError:
            failing.append(f"{name}: no answer within {TIMEOUT:g}s")
        except Exception as e:
            failing.append(f"{name}: {type(e).__name__}: {e}")
    return failing


async def _respond(path: str, accept: str = "") -> tuple[int, str, bytes]:
    if path == "/metrics":
        await metrics.sample()
        kind, body = metrics.scrape(openmetrics="application/openmetrics-text" in accept)
        return 200, kind, body
    if path == "/healthz":
        return 200, "text/plain", b"ok\n"
    if path == "/readyz":
        failing = await readiness()
        if failing:
            return 503, "text/plain", "".join(f"{f}\n" for f in failing).encode()
        return 200, "text/plain", b"ok\n"
    return 404, "text/plain", b"not found: /metrics, /healthz or /readyz\n"


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Unavailable"}


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
        request, *fields = head.decode("latin-1").split("\r\n")
        method, path, *_ = [*request.split(" "), "", ""]
        path = path.split("?", 1)[0]
        accept = ",".join(
            v.strip().lower()
            for k, _, v in (f.partition(":") for f in fields)
            if k.strip().lower() == "accept"
        )
        if method not in ("GET", "HEAD"):
            status, kind, body = 405, "text/plain", b"GET only\n"
        else:
            status, kind, body = await _respond(path, accept)
        writer.write(
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        if method != "HEAD":
            writer.write(body)
        await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> asyncio.Server:
    """Listen on host:port (port 0: one the system picks; `bound_port` says which)."""
    return await asyncio.start_server(_handle, host, port)


def bound_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])
