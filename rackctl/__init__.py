"""rackctl: the operator's command line, and the Python client it is built on."""
