"""Usage over time as a picture: three panels sharing the time axis (vCPUs, RAM, storage), each with the
level in use (the last of each interval, and the band between its least and greatest) against the quota.

matplotlib is imported here only, when a plot is asked for, so that every other command starts without
it.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GiB = 2**30
PANELS = (("vcpus", "vCPUs", 1), ("ram_bytes", "RAM (GiB)", GiB), ("disk_bytes", "storage (GiB)", GiB))
"""Each panel: the resource, its axis label with its unit, and the unit its values are divided by."""


def title(history: dict[str, Any]) -> str:
    what = "the fleet" if history["scope"] == "fleet" else f"{history['scope']} {history['name']}"
    return f"Usage of {what}"


def usage_figure(history: dict[str, Any]) -> Figure:
    """The figure of a `rp.cmd.<silo>.usage.history` reply."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    points = history["points"]
    edges = [datetime.fromisoformat(history["since"]), *(datetime.fromisoformat(p["at"]) for p in points)]
    quota = history.get("quota") or {}
    fig = Figure(figsize=(10, 8), dpi=100, layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (key, label, unit) in zip(axes, PANELS, strict=True):
        start = history["start"][key] / unit
        last = [start, *(p[key]["last"] / unit for p in points)]
        low = [start, *(p[key]["min"] / unit for p in points)]
        high = [start, *(p[key]["max"] / unit for p in points)]
        ax.fill_between(edges, low, high, step="pre", alpha=0.25, color="tab:blue", label="used, min to max")
        ax.step(edges, last, where="pre", color="tab:blue", linewidth=1.8, label="used (last)")
        top = max(high)
        if quota.get(key) is not None:
            ax.axhline(quota[key] / unit, color="tab:red", linestyle="--", linewidth=1.5, label="quota")
            top = max(top, quota[key] / unit)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1)
        ax.set_ylabel(label)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlim(edges[0], edges[-1])
    axes[-1].set_xlabel("time (UTC)")
    locator = mdates.AutoDateLocator()
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    fig.suptitle(f"{title(history)}, {edges[0]:%Y-%m-%d %H:%M} to {edges[-1]:%Y-%m-%d %H:%M} UTC")
    return fig


def save(fig: Figure, out: Path) -> None:
    fig.savefig(out, format="png")
