"""Segmentation Dice (evaluation/segmenter.py): two reference generators score where they should on both Dice
figures, against a known answer: the segmenter trained on the real volumes segments the real validation volumes
with GM and WM Dice >= 0.8 (the issue's bar for a metric that can tell good from bad).

The data are the demo's (the built-in pseudo-subjects, 12 at 32^3: 10 train, 2 validation) and the segmenters
the demo's (params.yaml's evaluate.segmenter_*), one seed: the module's fixture trains 5 segmenters (~25 s on one
CPU thread) and both generators share the cached real-trained one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import make_params

SEEDS = 1


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    """(params, root, cache) of the demo's data with one segmenter seed."""
    from voxdiff.data import prepare, preprocess
    from voxdiff.data.cache import open_cache

    root = tmp_path_factory.mktemp("segmenter")
    params = make_params({"evaluate.segmenter_seeds": SEEDS}, tiny=False)
    prepare.run_prepare(params, root)
    preprocess.run_preprocess(params, root)
    return params, root, open_cache(root / "data" / "processed")


def tissue_mean_generator(cache):
    from voxdiff.evaluation.references import tissue_mean_image, tissue_means

    table = tissue_means(cache)
    return lambda labels, first: tissue_mean_image(table, np.asarray(labels))


def noise_generator(labels, first):
    from voxdiff.evaluation.references import noise_image

    return np.stack([noise_image(labels.shape[1:], 7000 + first + b) for b in range(len(labels))])


def subjects_of(cache, generate, per_map: int = 2) -> list[dict]:
    """evaluate's entries for the validation subjects, with `generate`'s volumes as the samples."""
    out = []
    for r in cache.split_indices("val"):
        label = np.asarray(cache.labels[r])
        out.append({"id": cache.subjects[r]["id"], "label": label, "real": np.asarray(cache.images[r], np.float32),
                    "samples": list(generate(np.stack([label] * per_map), 1000 * int(r)))})
    return out


@pytest.fixture(scope="module")
def scored(demo_data):
    """{generator name: dice_metrics} for the tissue-mean and the noise generator, and the seconds each took."""
    from voxdiff.evaluation import segmenter
    from voxdiff.pipeline.evaluate import class_keys

    params, root, cache = demo_data
    _, keys = class_keys(params, list(cache.label_values))
    out = {}
    for name, gen in (("tissue_mean", tissue_mean_generator(cache)), ("noise", noise_generator)):
        out[name] = segmenter.dice_metrics(params, root, cache, subjects_of(cache, gen), keys, "cpu", gen)
    return out


def test_real_trained_segmenter_reaches_the_known_answer(scored):
    m = scored["tissue_mean"]
    assert m["eval_dice_fidelity_gm_ceiling"] >= 0.8 and m["eval_dice_fidelity_wm_ceiling"] >= 0.8, m
    assert m["eval_dice_tstr_real_gm"] >= 0.8 and m["eval_dice_tstr_real_wm"] >= 0.8  # the same segmenter, all val
    # The references are the generator's business only through its samples: both runs share them.
    same = [k for k in m if k.startswith("eval_dice_fidelity_") and k.endswith(("_ceiling", "_floor_noise",
                                                                               "_tissue_mean"))]
    assert len(same) == 12 and all(m[k] == scored["noise"][k] for k in same)
    assert m["eval_dice_fidelity_mean_floor_noise"] < 0.25 < m["eval_dice_fidelity_mean_ceiling"] - 0.4


def test_label_fidelity_puts_noise_at_the_floor_and_the_tissue_mean_image_high(scored):
    tm, noise = scored["tissue_mean"], scored["noise"]
    # Noise (other draws than the floor's) scores at the floor, far below the real volumes.
    for k in ("csf", "gm", "wm", "mean"):
        assert noise[f"eval_dice_fidelity_{k}"] == pytest.approx(noise[f"eval_dice_fidelity_{k}_floor_noise"], abs=0.05)
    assert noise["eval_dice_fidelity_mean"] < noise["eval_dice_fidelity_mean_ceiling"] - 0.5
    # The tissue-mean image is trivially segmentable: its samples are the reference itself, at or above the real
    # volumes' Dice on GM and WM (label fidelity cannot tell it from a good generator: SSIM and diversity do).
    for k in ("csf", "gm", "wm", "mean"):
        assert tm[f"eval_dice_fidelity_{k}"] == tm[f"eval_dice_fidelity_{k}_tissue_mean"]
    assert tm["eval_dice_fidelity_gm"] >= 0.8 and tm["eval_dice_fidelity_wm"] >= 0.8
    assert tm["eval_dice_fidelity_gm"] > tm["eval_dice_fidelity_gm_ceiling"] - 0.02


def test_train_on_synthetic_orders_the_generators_honestly(scored):
    tm, noise = scored["tissue_mean"], scored["noise"]
    for m in (tm, noise):
        assert m["eval_dice_tstr_volumes"] == 10  # one per training label map (params.yaml)
        assert m["eval_dice_tstr_ratio"] == pytest.approx(m["eval_dice_tstr_synthetic"] / m["eval_dice_tstr_real"])
        assert m["eval_dice_tstr_real"] == tm["eval_dice_tstr_real"]  # the cached real-trained segmenters
        assert m["eval_dice_tstr_synthetic_std"] is None  # one seed: no spread
    # Trained on noise, a segmenter learns only where tissues tend to lie: far below real training (measured:
    # ratio 0.35), and noise added to the real volumes ("both") costs Dice.
    assert noise["eval_dice_tstr_ratio"] < 0.5
    assert noise["eval_dice_tstr_both"] < noise["eval_dice_tstr_real"]
    # Trained on tissue-mean images (no noise, no bias field), it transfers to the real volumes almost fully
    # (measured: ratio 0.91-1.05 across grids), so on this data train-on-synthetic cannot tell a tissue-mean
    # generator from a good one either; it does tell noise from both.
    assert 0.8 < tm["eval_dice_tstr_ratio"] < 1.1
    assert noise["eval_dice_tstr_synthetic"] < tm["eval_dice_tstr_synthetic"] - 0.3


def test_segmenters_are_cached_and_deterministic(demo_data, scored, tmp_path, monkeypatch):
    """The real-trained segmenter is loaded from models/segmenter/, and scores as the one just trained."""
    from voxdiff.evaluation import segmenter
    from voxdiff.pipeline.evaluate import class_keys

    params, root, cache = demo_data
    files = list((root / "models" / "segmenter").glob("*.pt"))
    assert len(files) == SEEDS
    fidelity_only = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, tstr_samples_per_map=0))
    again = segmenter.dice_metrics(fidelity_only, root, cache, subjects_of(cache, noise_generator),
                                   class_keys(params, list(cache.label_values))[1], "cpu")
    assert again["eval_segmenter_seconds"] is None  # nothing trained
    assert not any(k.startswith("eval_dice_tstr") for k in again)
    assert {k: v for k, v in scored["noise"].items() if k.startswith("eval_dice_fidelity")} == \
        {k: v for k, v in again.items() if k.startswith("eval_dice_fidelity")}
    # A queued DVC experiment evaluates in a temporary copy of the project (DVC_ROOT names the project): it loads
    # the project's segmenters and leaves no copy of them in the temporary one, which DVC deletes.
    queued_copy = tmp_path / "queue-copy"
    monkeypatch.setenv("DVC_ROOT", str(root))
    queued = segmenter.dice_metrics(fidelity_only, queued_copy, cache, subjects_of(cache, noise_generator),
                                    class_keys(params, list(cache.label_values))[1], "cpu")
    monkeypatch.delenv("DVC_ROOT")
    assert queued["eval_segmenter_seconds"] is None and not (queued_copy / "models").exists()
    # An unreadable cache file is trained again and replaced (with a warning), to the same weights.
    files[0].write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="unreadable"):
        third = segmenter.dice_metrics(fidelity_only, root, cache, subjects_of(cache, noise_generator),
                                       class_keys(params, list(cache.label_values))[1], "cpu")
    assert third["eval_dice_fidelity_mean"] == again["eval_dice_fidelity_mean"]
    # Training is seeded: the same seed gives the same weights, another seed others.
    images, labels = cache.stack(cache.split_indices("train")[:2])
    spec = dataclasses.replace(segmenter.spec_of(params, cache.num_classes), steps=3)
    a, b, c = (segmenter.train_segmenter(images[:, 0], labels, spec, s)[0] for s in (0, 0, 1))
    wa, wb, wc = (next(n.parameters()).detach() for n in (a, b, c))
    assert np.array_equal(wa.numpy(), wb.numpy()) and not np.array_equal(wa.numpy(), wc.numpy())


def test_side_by_side_evaluations_train_a_missing_segmenter_once(demo_data, tmp_path, monkeypatch):
    """Two queued experiments evaluating at once (`dvc queue start -j 2`) into the project's folder: one trains
    the missing segmenter, the other waits and loads it; a temporary folder that a killed evaluation left while
    writing the file is cleared. Without the lock both train (the negative control below)."""
    import threading

    import filelock
    import torch

    from voxdiff.evaluation import segmenter

    params, root, cache = demo_data
    images, labels = cache.stack(cache.split_indices("train")[:4])
    spec = dataclasses.replace(segmenter.spec_of(params, cache.num_classes), steps=4)

    def race(folder):
        """Two threads at a barrier, then real_segmenter each: the seconds each trained (None: loaded)."""
        start, out, errors = threading.Barrier(2), [], []

        def one():
            try:
                start.wait()
                out.append(segmenter.real_segmenter(folder, cache.fingerprint, images[:, 0], labels, spec, 0)[1])
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(2)]
        with torch.random.fork_rng():  # training seeds torch's global generator
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        assert len(out) == 2
        return out

    folder = tmp_path / "segmenter"
    key = segmenter.cache_key(cache.fingerprint, spec, 0, "cpu")
    left = folder / f".{key}.pt.killed.tmp"
    left.mkdir(parents=True)
    (left / f"{key}.pt").write_bytes(b"half a file")
    seconds = race(folder)
    assert sorted(s is None for s in seconds) == [False, True], seconds  # one trained, one loaded
    assert not left.exists() and [p.name for p in folder.glob("*.pt")] == [f"{key}.pt"]

    # Negative control: without the lock, both threads train (each waits inside training for the other, so
    # neither can have found the other's file).
    class NoLock:
        def __init__(self, *a, **k):
            pass

        def acquire(self, timeout=None):
            pass

        def release(self):
            pass

    both_training, train = threading.Barrier(2, timeout=60), segmenter.train_segmenter

    def train_when_both_do(*a, **k):
        both_training.wait()
        return train(*a, **k)

    monkeypatch.setattr(filelock, "FileLock", NoLock)
    monkeypatch.setattr(segmenter, "train_segmenter", train_when_both_do)
    assert all(s is not None for s in race(tmp_path / "unlocked"))


def test_off_and_bad_input(demo_data, tmp_path):
    from voxdiff.data.cache import ProcessedCache
    from voxdiff.runtime.errors import DataError, VoxdiffError
    from voxdiff.evaluation import segmenter

    params, root, cache = demo_data
    keys = ["background", "csf", "gm", "wm"]
    off = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, segmenter_steps=0))
    assert segmenter.dice_metrics(off, root, cache, [], keys) == {}

    # No validation subjects: one line naming the manifest.
    manifest = {**cache.manifest, "subjects": [{**s, "split": "train"} for s in cache.subjects]}
    no_val = ProcessedCache(cache.root, cache.images, cache.labels, manifest)
    with pytest.raises(VoxdiffError, match="manifest.json: no validation subjects") as e:
        segmenter.dice_metrics(params, root, no_val, [], keys)
    assert "\n" not in str(e.value)

    # A validation label map with a class that no training map holds: the segmenter never saw it.
    labels = np.array(cache.labels)
    train = cache.split_indices("train")
    labels[train] = np.where(labels[train] == 1, 2, labels[train])  # no CSF in training
    unseen = ProcessedCache(cache.root, cache.images, labels, cache.manifest)
    with pytest.raises(DataError, match="holds label 1, which no training subject holds") as e:
        segmenter.dice_metrics(params, root, unseen, [], keys)
    assert "\n" not in str(e.value) and "evaluate.segmenter_steps: 0" in str(e.value)


@pytest.mark.parametrize("key, value, message", [
    ("segmenter_steps", -1, "evaluate.segmenter_steps must be an integer >= 0"),
    ("segmenter_channels", [16], "evaluate.segmenter_channels must be a list of at least 2"),
    ("segmenter_channels", [16, 0], "evaluate.segmenter_channels must be a list of integers >= 1"),
    ("segmenter_channels", [4, 8, 16, 32, 64, 128], "divisible by 32"),
    ("segmenter_seeds", 0, "evaluate.segmenter_seeds must be an integer >= 1"),
    ("tstr_samples_per_map", True, "evaluate.tstr_samples_per_map must be an integer >= 0"),
    ("tstr_sampling_steps", -2, "evaluate.tstr_sampling_steps must be an integer >= 0"),
])
def test_settings_are_validated_by_name(key, value, message):
    from voxdiff.runtime.errors import ParamsError

    with pytest.raises(ParamsError, match=message):
        make_params({f"evaluate.{key}": value, "preprocess.shape": [16, 16, 16]}, tiny=False)


def test_voxdiff_metrics_prints_both_dice_figures_with_their_references(tmp_path):
    import json

    from click.testing import CliRunner

    from voxdiff.cli import main

    detail = {"eval_ssim": 0.85, "eval_dice_fidelity_mean": 0.70, "eval_dice_fidelity_mean_ceiling": 0.78,
              "eval_dice_fidelity_mean_floor_noise": 0.12, "eval_dice_fidelity_mean_tissue_mean": 0.76,
              "eval_dice_tstr_ratio": 0.9, "eval_dice_tstr_ratio_std": 0.01, "eval_dice_tstr_synthetic": 0.7,
              "eval_dice_tstr_synthetic_std": 0.02, "eval_dice_tstr_real": 0.78, "eval_dice_tstr_real_std": 0.004,
              "eval_dice_tstr_both": 0.77, "eval_dice_tstr_both_std": None}
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval_detail.json").write_text(json.dumps(detail))
    res = CliRunner().invoke(main, ["metrics", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    fidelity = next(line for line in res.output.splitlines() if "label-fidelity Dice" in line)
    assert fidelity.endswith("0.7   (real volumes 0.780, noise 0.120; tissue-mean image 0.760: trivially segmentable)")
    tstr = next(line for line in res.output.splitlines() if "trained on synthetic / on real" in line)
    assert "0.9 ± 0.010   (synthetic 0.700 ± 0.020, real 0.780 ± 0.004, both 0.770)" in tstr
