"""PostgreSQL, the way every service uses it, one job a module: `pool` (a pool confined to the service's
own schema), `queries` (named queries loaded from .sql files), `migrations` (plain .sql files applied in
order, with their checksums), `outbox` (the transactional outbox and its relay), `locks` (one pass at a
time across replicas) and `group_commit` (many requests in one transaction). `from shared import db;
db.X` reaches each of their public names.
"""

from shared.db.group_commit import GroupCommit
from shared.db.locks import PassLock
from shared.db.migrations import (
    SHARED_SQL,
    Migration,
    MigrationError,
    migrate,
    migration_files,
    migration_states,
    owner_role,
    refuse_changed,
    require_current,
)
from shared.db.outbox import ACK_TIMEOUT, OUTBOX, OutboxRelay, enqueue, enqueue_many
from shared.db.pool import create_pool
from shared.db.queries import queries

__all__ = [
    "ACK_TIMEOUT",
    "OUTBOX",
    "SHARED_SQL",
    "GroupCommit",
    "Migration",
    "MigrationError",
    "OutboxRelay",
    "PassLock",
    "create_pool",
    "enqueue",
    "enqueue_many",
    "migrate",
    "migration_files",
    "migration_states",
    "owner_role",
    "queries",
    "refuse_changed",
    "require_current",
]
