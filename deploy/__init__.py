"""Bringing rackplane up: the local stack (`make run`, tests), nats-server config, compose files."""
