"""accounting: applies idempotent, generation-fenced provisioning deltas to project, silo and fleet
totals, and enforces silo quotas atomically."""
