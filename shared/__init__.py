"""The library every rackplane service shares: messages, bus, database, telemetry and config."""
