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


def exit_on_user_error(fn, debug: bool):
    """Call fn(); a VoxdiffError becomes `error: <message>` on stderr and exit 2, Ctrl-C exit 130
    (tracebacks only with debug). Shared by the CLI and the stage entry points."""
    import sys

    try:
        return fn()
    except VoxdiffError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
