"""Benchmarks: each prints ratios against a baseline measured in the same run (`make bench`)."""

UNLIMITED = {
    "RACKPLANE_SILO_COMMAND_RATE": "1000000",
    "RACKPLANE_IDENTITY_COMMAND_RATE": "1000000",
    "RACKPLANE_SILO_MAX_PROJECTS": "1000000",
    "RACKPLANE_SILO_MAX_INSTANCES": "1000000",
    "RACKPLANE_SILO_MAX_POOL_MEMBERS": "1000000",
}
"""A bench measures the control plane at its pace, not the tenant limits a rack sets by default (one
operator starting hundreds of instances a second is past them): every bench stack lifts them."""
