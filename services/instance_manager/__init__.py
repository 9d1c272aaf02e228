"""instance-manager: owns silos, projects, instances, sleds and VMMs, and runs the instance sagas."""

from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"
"""This service's schema migrations (NNN_*.sql), applied by shared/db/migrations.py."""
