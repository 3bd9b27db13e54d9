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


def echo(line: str) -> None:
    """One line on stderr, dropped when stderr is gone: a pipe whose reader died (`dvc repro train | tee log`
    with its process group stopped: tee dies at once) or a closed terminal. The write raised BrokenPipeError
    mid-training, which ended the run before its deferred save (issue 36 item 11)."""
    import sys

    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # EPIPE, EIO; ValueError: the stream was closed
        pass


def exit_on_user_error(fn, debug: bool):
    """Call fn(); a VoxdiffError becomes `error: <message>` on stderr and exit 2, Ctrl-C exit 130
    (tracebacks only with debug). Shared by the CLI and the stage entry points."""
    import sys

    try:
        return fn()
    except VoxdiffError as e:
        if debug:
            raise
        echo(f"error: {e}")
        sys.exit(2)
    except KeyboardInterrupt:
        if debug:
            raise
        echo("interrupted")
        sys.exit(130)
