"""accounting: applies idempotent, generation-fenced provisioning deltas to project, silo and fleet
totals, and enforces silo quotas atomically."""

from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"
"""This service's schema migrations (NNN_*.sql), applied by shared/db/migrations.py."""
