"""instance-manager: owns silos, projects, instances, sleds and VMMs, and runs the instance sagas."""
