"""Figures of a training run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from voxdiff.runtime.fsutil import atomic_path  # noqa: E402


def convergence(history: list[dict], path: Path, title: str = "") -> None:
    """Train (window mean) and validation loss against optimizer steps and against samples seen."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    val = [h for h in history if h["val_loss"] is not None]
    for ax, x in zip(axes, ("step", "samples_seen")):
        ax.plot([h[x] for h in history], [h["train_loss"] for h in history], lw=0.8, alpha=0.5,
                label="train loss (window mean)")
        ax.plot([h[x] for h in val], [h["val_loss"] for h in val], "o-", ms=3, label="val loss (EMA, fixed draws)")
        ax.set_xlabel("optimizer steps" if x == "step" else "samples seen")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "convergence", fontsize=10)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
