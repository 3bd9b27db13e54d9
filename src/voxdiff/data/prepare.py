"""Stage `prepare`: make data/raw, the pipeline's view of the input data.

- data.source "mni152": synthesise the built-in pseudo-subjects into data/raw (NIfTI + index.json).
- a directory: index and check the user's pairs; data/raw holds only index.json, whose sha256 per
  file makes any change to the user's data visible to DVC.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from voxdiff.data import builtin

from voxdiff.data import nifti

from voxdiff.data import sources
from voxdiff.runtime.errors import ParamsError
from voxdiff.runtime.fsutil import atomic_path, write_json

INDEX_NAME = "index.json"


def run_prepare(params, root: str | Path) -> list[dict]:
    """Write <root>/data/raw (replacing it whole); returns the subject index."""
    root = Path(root)
    raw = sources.raw_dir(root)
    if params.data.builtin:
        if tuple(params.data.label_values) != builtin.LABEL_VALUES:
            raise ParamsError(f"params.yaml: data.label_values must be {list(builtin.LABEL_VALUES)} "
                              f"(background, CSF, GM, WM) for data.source mni152, got {list(params.data.label_values)}")
        return builtin.synthesize(params, raw, root)
    subjects = sources.index_subjects(params, root)
    sources.split_subjects([s["id"] for s in subjects], params.data.val_subjects, params.data.seed)  # fail early
    check_subjects(subjects, params, root)
    with atomic_path(raw) as tmp:
        tmp.mkdir()
        write_json(tmp / INDEX_NAME, {"source": params.data.source, "subjects": subjects})
    return subjects


def check_subjects(subjects: list[dict], params, root: Path) -> None:
    """Load every pair with all checks, so bad data fails here and not halfway through preprocess."""
    for s in tqdm(subjects, desc="prepare: checking NIfTI pairs", unit="subject"):
        nifti.load_pair(root / s["image"], root / s["label"], params.data.label_values)
