"""Reports across runs: `voxdiff compare` and the figures."""
