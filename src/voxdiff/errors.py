"""User-facing errors: one line naming the file or key and what is wrong.

The CLI prints ``VoxdiffError`` as ``error: <message>`` and exits 2, without a traceback unless
``--debug`` is given. Anything else is a bug and keeps its traceback.
"""


class VoxdiffError(Exception):
    """A problem with the user's input (params, data, paths, checkpoints)."""


class ParamsError(VoxdiffError):
    """An invalid params.yaml key."""


class DataError(VoxdiffError):
    """An invalid input file (NIfTI, manifest, cache)."""


class TrainingDiverged(VoxdiffError):
    """The loss became NaN or infinite."""
