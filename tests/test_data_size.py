"""Training-set size as a study axis: data.train_subjects picks a nested, seeded subset of the training
split, leaves the validation subjects alone, and the between-subject variation is reported beside it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import write_tiny_cache


def test_training_subsets_are_nested_seeded_and_leave_validation_alone(tmp_path):
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.errors import DataError

    write_tiny_cache(tmp_path, n_train=12, n_val=3)
    cache = open_cache(tmp_path / "data" / "processed")
    every = cache.split_indices("train")
    assert list(cache.training_rows(0, seed=0)) == list(every)
    sizes = [cache.training_rows(n, seed=0) for n in (2, 5, 9, 12)]
    for small, large in zip(sizes, sizes[1:]):
        assert set(small) < set(large)  # nested
    assert [len(s) for s in sizes] == [2, 5, 9, 12]
    assert not set(sizes[-1]) & set(cache.split_indices("val"))
    assert list(cache.training_rows(5, seed=0)) == list(cache.training_rows(5, seed=0))  # deterministic
    # a seeded rank, not the first ids (real data is often ordered by site or date)
    picks = {tuple(cache.training_rows(5, seed=s)) for s in range(6)}
    assert len(picks) > 1
    with pytest.raises(DataError, match="data.train_subjects = 13"):
        cache.training_rows(13, seed=0)


def test_pairwise_dice_against_known_overlaps(tmp_path):
    from voxdiff.data.cache import open_cache

    write_tiny_cache(tmp_path, n_train=3, n_val=1)
    cache = open_cache(tmp_path / "data" / "processed")
    labels = np.zeros((4, 16, 16, 16), np.uint8)
    labels[0, :8] = 1          # 2048 voxels
    labels[1, :8] = 1          # identical to 0: Dice 1
    labels[2, 4:12] = 1        # half of it overlaps 0 and 1: Dice 0.5
    labels[:, 15, 15, 15] = 2  # class 2: one voxel, the same everywhere
    cache.labels = labels
    d = cache.pairwise_dice([0, 1, 2])
    assert d[1] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert d[2] == pytest.approx(1.0)
    assert cache.pairwise_dice([0]) == {1: None, 2: None}


def test_a_run_on_a_subset_draws_only_from_it(tiny_root):
    import torch

    from conftest import make_params
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.distributed import init_runtime
    from voxdiff.training.trainer import Trainer

    write_tiny_cache(tiny_root, n_train=8, n_val=2)
    cache = open_cache(tiny_root / "data" / "processed")
    params = make_params({"data.train_subjects": 3})
    trainer = Trainer(params, tiny_root, init_runtime("cpu", "fp32"), cache)
    allowed = set(cache.training_rows(3, params.data.seed))
    assert set(int(r) for r in trainer.train_rows) == allowed
    images = torch.from_numpy(np.asarray(cache.images))
    drawn = trainer.batch(list(range(40)))[0]
    for image in drawn:  # each drawn image is one of the 3 subjects'
        assert any(torch.equal(image[0], images[r]) for r in allowed)
    # and the run's identity changes with the size (another training set, another run)
    other = Trainer(make_params({"data.train_subjects": 4}), tiny_root, init_runtime("cpu", "fp32"), cache)
    assert other.fingerprint() != trainer.fingerprint()


def test_prepare_and_preprocess_on_every_core_write_what_one_core_writes(tmp_path):
    """The process pool (data/parallel.py) runs in a process without torch, as the stages are; its files are
    byte for byte those of the serial loop this test process runs (torch is loaded here)."""
    import hashlib
    import subprocess
    import sys

    import yaml

    from conftest import REPO, raw_params
    from voxdiff.data.preprocess import run_preprocess
    from voxdiff.data.prepare import run_prepare
    from voxdiff.params import validate

    raw = raw_params(**{"data.subjects": 8, "data.val_subjects": 2})
    digests = {}
    for mode in ("serial", "pool"):
        root = tmp_path / mode
        root.mkdir()
        if mode == "serial":
            run_prepare(validate(raw), root)
            run_preprocess(validate(raw), root)
        else:
            (root / "params.yaml").write_text(yaml.safe_dump(raw))
            code = ("import sys; from pathlib import Path; from voxdiff.params import load; "
                    "from voxdiff.data.prepare import run_prepare; from voxdiff.data.preprocess import run_preprocess; "
                    "from voxdiff.data import parallel; r = Path(sys.argv[1]); p = load(r / 'params.yaml'); "
                    "assert parallel.workers(8) == 2; run_prepare(p, r); run_preprocess(p, r); "
                    "assert 'torch' not in sys.modules")
            env = {"PATH": "/usr/bin:/bin", "VOXDIFF_DATA_WORKERS": "2", "TQDM_DISABLE": "1", "HOME": str(tmp_path)}
            subprocess.run([sys.executable, "-c", code, str(root)], check=True, env=env, cwd=REPO, timeout=600)
        digests[mode] = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in (".gz", ".npy")}
    assert len(digests["serial"]) == 2 * 8 + 2 and digests["pool"] == digests["serial"]
