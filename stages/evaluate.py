"""DVC stage `evaluate`: thin entry point for `voxdiff evaluate` (the logic lives in src/voxdiff)."""

import _entry

_entry.run("evaluate")
