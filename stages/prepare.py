"""DVC stage `prepare`: thin entry point for `voxdiff prepare` (the logic lives in src/voxdiff)."""

import _entry

_entry.run("prepare")
