"""DVC stage `preprocess`: thin entry point for `voxdiff preprocess` (the logic lives in src/voxdiff)."""

import _entry

_entry.run("preprocess")
