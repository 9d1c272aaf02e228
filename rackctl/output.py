"""How rackctl writes results: aligned tables for people, JSON for scripts, a progress line on terminals.

Machine output (`--json`) is the reply data and nothing else, so that `rackctl ... --json | jq` always
works; progress is drawn only when stdout is a terminal, so pipes and logs never see control characters.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

Cell = str | int | None


def print_json(data: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump(data, out, indent=2, sort_keys=True)
    out.write("\n")


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], out: TextIO | None = None) -> None:
    """Columns padded to their widest cell; None shows as `-`. An empty table still shows its headers."""
    out = out or sys.stdout
    text = [list(headers), *([("-" if c is None else str(c)) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    for r in text:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


class TableStream:
    """A table written a page at a time, as the pages arrive: the columns take the widths of the first
    page (a wider cell later just pushes its line along), so a list of any length starts at once."""

    def __init__(self, headers: Sequence[str], out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.headers = [str(h) for h in headers]
        self.widths: list[int] | None = None

    def write(self, rows: Iterable[Sequence[Cell]]) -> None:
        text = [[("-" if c is None else str(c)) for c in row] for row in rows]
        if self.widths is None:
            every = [self.headers, *text]
            self.widths = [max(len(r[i]) for r in every) for i in range(len(self.headers))]
            text = every
        for r in text:
            self.out.write("  ".join(c.ljust(w) for c, w in zip(r, self.widths, strict=True)).rstrip() + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.widths is None:
            self.write([])


def print_fields(fields: Sequence[tuple[str, Cell]], out: TextIO | None = None) -> None:
    """One `key  value` line per field, keys aligned: the shape of a `show`."""
    out = out or sys.stdout
    width = max((len(k) for k, _ in fields), default=0)
    for key, value in fields:
        out.write(f"{key.ljust(width)}  {'-' if value is None else value}\n")


class Progress:
    """A single status line, rewritten in place on a terminal and silent anywhere else."""

    def __init__(
        self, label: str, *, started: float | None = None, enabled: bool = True, out: TextIO | None = None
    ) -> None:
        self.out = out or sys.stdout
        self.label = label
        self.started = time.monotonic() if started is None else started
        self.enabled = enabled and self.out.isatty()
        self.drawn = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, status: str) -> None:
        if self.enabled:
            self.out.write(f"\r\033[K{self.label}: {status} ({self.elapsed:.1f}s)")
            self.out.flush()
            self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self.out.write("\r\033[K")
            self.out.flush()
            self.drawn = False
