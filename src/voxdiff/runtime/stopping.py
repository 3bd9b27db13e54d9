"""Stop requests (SIGTERM, SIGHUP, Ctrl-C) that arrive while a training starts up, or while a stop is saved.

The training loop defers a stop to the end of the optimizer step (pipeline.train.GracefulInterrupt). Before
the loop, the train stage imports torch and MONAI, opens the data and the checkpoint and starts its MLflow
run: seconds on an idle machine, a minute or more on a loaded one. A SIGTERM then took its default action:
the process ended without a word, its MLflow run left RUNNING (issue 36 item 11: a SIGTERM 12 s after
`dvc repro train` started, under load, left no checkpoint, no line and no run end). `defer()` is the first
thing the train stage and `voxdiff train` do: from then on SIGTERM and a first Ctrl-C only note the
request, which the training honours at its first window boundary. A second Ctrl-C still acts at once; a
repeated SIGTERM is the same request again (launchers repeat it: a process-group SIGTERM reaches a torchrun
worker both directly and forwarded by torchrun). SIGHUP (the terminal closed: an ssh session dropped) is a
stop request like SIGTERM, unless the process was started ignoring it (`nohup`), which it keeps doing. While a
stop's checkpoint is written and its MLflow run ended, the noting handler is back (GracefulInterrupt's exit), so
a repeated SIGTERM there cannot end the process mid-save; `restore()` at the end of the training puts back the
handlers that were there before.

Standard library only: it runs before the heavy imports.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_requested: list[int] = []             # the signals noted, in order
_originals: dict[int, object] = {}     # the handlers defer() replaced


def _note(signum, frame) -> None:
    if signum == signal.SIGINT and signal.SIGINT in _requested:
        raise KeyboardInterrupt  # a second Ctrl-C: at once, as Python's own handler would
    _requested.append(signum)


def stop_signals() -> list[int]:
    """The signals that ask a training to stop at its next window boundary: SIGINT, SIGTERM and SIGHUP, less
    SIGHUP where the process ignores it (started under `nohup`: a closed terminal must not stop it)."""
    out = []
    for name in SIGNALS:
        sig = getattr(signal, name, None)  # no SIGHUP on Windows
        if sig is not None and not (name == "SIGHUP" and signal.getsignal(sig) is signal.SIG_IGN):
            out.append(sig)
    return out


def defer() -> None:
    """Note the stop signals from now on instead of acting on them (main thread only; calling it again
    keeps the first handlers as the originals)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in stop_signals():
        current = signal.signal(sig, _note)
        if current is not _note:
            _originals[sig] = current


def requested() -> int | None:
    """The first signal noted since defer(), or None."""
    return _requested[0] if _requested else None


def original(sig: int):
    """The handler that was in place before defer() replaced it (None: defer() did not)."""
    return _originals.get(sig)


def restore() -> None:
    """Put back the handlers defer() replaced, and forget what was noted (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in _originals.items():
        if signal.getsignal(sig) is _note:
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    _originals.clear()
    _requested.clear()
