"""recovery: reconciles what should run on each sled with what does."""

from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"
"""This service's schema migrations (NNN_*.sql), applied by shared/db/migrations.py."""
