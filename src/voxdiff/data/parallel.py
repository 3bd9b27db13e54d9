"""Per-subject work on every core, in order, with a progress bar: prepare and preprocess at hundreds of
subjects (the data-size study's 320 synthesised subjects) must not take one core's time.

The standard library's process pool is enough: subjects are independent, each result is small (one subject's
arrays, or nothing when the worker writes its own files), and the order of the results is the input's, so the
outputs are byte-for-byte those of a serial loop. Workers are forked (spawn would re-run an unguarded caller's
script), and only from a process that has not imported torch: the stages import none, while a process that
has (tests, benchmarks) may hold OpenMP threads that a fork would copy mid-state, so it runs serially.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Callable, Iterable, Sequence

from tqdm import tqdm


def workers(count: int) -> int:
    """Processes for `count` items: the cores this process may use (VOXDIFF_DATA_WORKERS caps them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cap = int(os.environ.get("VOXDIFF_DATA_WORKERS", "0") or 0)
    return max(1, min(count, cores, cap or cores))


def ordered_map(fn: Callable, items: Sequence, desc: str, unit: str = "subject") -> Iterable:
    """fn(item) for each item, results in the items' order; serial in this process when one worker is all
    there is (no start-up cost for a handful of subjects). An exception in a worker is raised here, as itself."""
    n = workers(len(items)) if "torch" not in sys.modules else 1
    bar = tqdm(total=len(items), desc=desc, unit=unit)
    try:
        if n == 1 or len(items) < 8:
            for item in items:
                yield fn(item)
                bar.update(1)
            return
        with ProcessPoolExecutor(n, mp_context=get_context("fork")) as pool:
            for result in pool.map(fn, items, chunksize=max(1, len(items) // (8 * n))):
                yield result
                bar.update(1)
    finally:
        bar.close()
