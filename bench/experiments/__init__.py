"""One module per experiment (listed in :mod:`bench.registry`)."""
