"""The run at its own best: the EMA weights where the validation loss was lowest, and early stopping.

The best point is the one `own_best_*` reports (convergence.best_point): the centre of the lowest mean of
`BEST_WINDOW` consecutive validations (one validation's minimum is biased low by its jitter). The centre is
known only `BEST_WINDOW // 2` validations later, so the EMA of the last that many validations waits beside the
kept copy: 1 + BEST_WINDOW // 2 EMA copies at most (3), on the CPU, whatever the run's length. Not the
weights at the window's end: on a run that rises after its best they are already past it (tests/test_best_point.py:
the window [0.764, 0.732, 0.743, 0.822, 0.799] ends on weights at 0.799, its centre is at 0.743).

Early stopping (`train.early_stop_patience_samples`, 0 = off) ends a run once that many samples have been seen
since the best point: a long arm does not spend hours over-fitting. Patience is counted in samples, so it
means the same at every accumulate_every.
"""

from __future__ import annotations

import dataclasses

import torch

from voxdiff.analysis.convergence import BEST_WINDOW


@dataclasses.dataclass
class BestMark:
    """Where the kept copy was taken: the centre of the lowest window."""
    step: int
    samples_seen: int
    window_mean: float  # mean val loss of the BEST_WINDOW validations around it
    val_loss: float     # this validation's own val loss


class BestWeights:
    def __init__(self, ema: torch.nn.Module, patience_samples: int, window: int = BEST_WINDOW):
        self.ema = ema  # the AveragedModel whose state is copied
        self.window = window
        self.patience_samples = patience_samples
        self.mark: BestMark | None = None
        self.state: dict | None = None  # the EMA's state_dict at the mark, on the CPU
        self.pending: list[dict] = []  # the EMA at the last window // 2 validations: possible centres

    def observe(self, history: list[dict]) -> bool:
        """After a validation (the last record of `history` holds its val loss): keep the EMA at the centre of
        the last `window` validations when their mean is the lowest yet. True when it did."""
        val = [h for h in history if h.get("val_loss") is not None]
        self.pending.append({k: v.detach().to("cpu", copy=True) for k, v in self.ema.state_dict().items()})
        kept = False
        if len(val) >= self.window:
            centre = self.pending.pop(0)  # the EMA at val[-1 - window // 2]
            mean = sum(h["val_loss"] for h in val[-self.window:]) / self.window
            if mean == mean and (self.mark is None or mean < self.mark.window_mean):  # NaN never wins
                at = val[-1 - self.window // 2]
                self.mark = BestMark(at["step"], at["samples_seen"], float(mean), float(at["val_loss"]))
                self.state, kept = centre, True
        del self.pending[: len(self.pending) - self.window // 2]
        return kept

    def should_stop(self, samples_seen: int) -> bool:
        """Early stopping: patience samples have passed since the best point."""
        return (self.patience_samples > 0 and self.mark is not None
                and samples_seen - self.mark.samples_seen >= self.patience_samples)

    def state_dict(self) -> dict:
        return {"mark": dataclasses.asdict(self.mark) if self.mark else None, "ema": self.state,
                "pending": list(self.pending)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.mark = BestMark(**state["mark"]) if state.get("mark") else None
        self.state = state.get("ema")
        self.pending = list(state.get("pending") or [])
