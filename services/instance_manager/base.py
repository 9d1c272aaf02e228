"""What every module of instance-manager names, with no dependency of its own: the service's name on
what it sends, and its named queries (queries.sql)."""

from __future__ import annotations

from pathlib import Path

from shared.db import queries

SOURCE = "instance-manager"
Q = queries(Path(__file__).with_name("queries.sql"))
