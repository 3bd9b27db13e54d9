"""DVC stage `train`: thin entry point for `voxdiff train` (the logic lives in src/voxdiff)."""

import _entry

_entry.run("train")
