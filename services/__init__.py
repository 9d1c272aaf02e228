"""The four rackplane services, each run as its own process with `python -m services.<name>`."""
