"""rackctl's commands, one module per resource or command group, so that each reads on its own.

Importing this package registers every command in `base.COMMANDS`; the order of the imports below is the
order in which `rackctl --help` lists them.
"""

# isort: off
from rackctl.commands import (
    silo,
    project,
    instance,
    pool,
    sled,
    sim,
    usage,
    stats,
    events,
    subscriber,
    dlq,
    chaos,
    check,
    completion,
    version,
)

# isort: on

__all__ = [
    "chaos",
    "check",
    "completion",
    "dlq",
    "events",
    "instance",
    "pool",
    "project",
    "silo",
    "sim",
    "sled",
    "stats",
    "subscriber",
    "usage",
    "version",
]
