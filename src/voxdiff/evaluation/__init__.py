"""Evaluation: the evaluate stage and `voxdiff sample`."""
