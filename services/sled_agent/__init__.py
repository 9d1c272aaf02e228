"""The sled-agent simulator: many simulated sleds in one process, each running VMMs and reporting them."""
