"""Reports across runs: `voxdiff compare`, the study reports and the figures; run grouping (groups.py)."""
