"""Crash points: named places where a test can make a process die as kill -9 would, to prove that what
was committed before that point, and only that, survives.

`RACKPLANE_CRASH_AT` lists the points, comma-separated. Off (empty) in every real deployment. Points:
  saga:<kind>/<step>          before a saga step runs (`saga:instance-start/undo:interlock` for an undo)
  saga:<kind>/after:<step>    after a remote step's action, before its progress is committed
  after-commit:<consumer>     after a stream handler's transaction committed, before its ack
  sled-agent:write:<name>     before the simulator writes a sled's state file carrying a named change: a
                              command's (`vmm.ensure`, `vmm.stop`...), a hand-over's (`handover-target`,
                              then `handover-source`)
A point ending in `*` names every point it is the start of (`after-commit:accounting-deltas-*`).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_POINTS: set[str] = set()
"""The points this process dies at: none until `arm` (service.run arms its settings' crash_at)."""


def arm(points: frozenset[str]) -> None:
    """Die at `points` from now on (a process's RACKPLANE_CRASH_AT, given at its start)."""
    _POINTS.clear()
    _POINTS.update(points)


def crash_point(name: str) -> None:
    points = _POINTS
    if points and any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in points):
        log.warning("crashing at %s, as RACKPLANE_CRASH_AT asks", name)
        logging.shutdown()
        os._exit(137)
