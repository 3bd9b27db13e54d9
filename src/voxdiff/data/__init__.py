"""Data: the built-in MNI152 pseudo-subjects, user NIfTI pairs, checks, preprocessing and the training cache."""
