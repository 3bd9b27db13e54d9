"""`voxdiff sample` against `evaluate` and training's preprocessing (issue 19, items 6 and 15).

- the same checkpoint + seed give the same volume through `evaluate` and through `voxdiff sample`,
  at the training's precision (bf16 autocast here: without it the volume differs);
- the grid is placed by training's rule (preprocess.place_grid), and a label map much smaller than the
  grid, which training would have centred on the head rather than on the labels, gets a warning;
- nothing is written before the inputs are checked.
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import TINY, make_params, raw_params, write_tiny_cache
from datagen import CUBE, HEAD, phantom, ras_affine, user_params, write_nifti

# One label map centred in the 16^3 grid (bounding box voxels 1..14 on every axis), so that `sample`
# places it exactly where the cache has it: the same class grid through both commands.
CENTRED = np.zeros((16, 16, 16), np.uint8)
CENTRED[1:15, 1:15, 1:15] = 1
CENTRED[3:9, 6:13, 4:10] = 2
# x0 prediction: a barely trained epsilon network's samples are clipped to +-1 almost everywhere, whatever
# the precision; an x0 network's are its last prediction, where bf16 and fp32 differ.
OVERRIDES = {"train.precision": "bf16", "diffusion.prediction": "sample", "evaluate.subjects": 1,
             "evaluate.samples_per_condition": 1, "evaluate.sampling_steps": 5}


def run_cli(*args):
    from voxdiff.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def bf16_project(tmp_path_factory):
    """(root, params) of a tiny bf16 project: the trainer's checkpoint after its 8-sample budget (train's
    code path without MLflow, whose store costs ~15 s here and changes nothing that is checked) and one
    run of evaluate on it; the first validation subject's label map is CENTRED."""
    from voxdiff.data.cache import open_cache
    from voxdiff.pipeline.evaluate import run_evaluate
    from voxdiff.training import checkpoint
    from voxdiff.runtime.distributed import init_runtime
    from voxdiff.training.trainer import Trainer

    root = tmp_path_factory.mktemp("bf16")
    cache = write_tiny_cache(root)
    labels, images = np.load(cache / "labels.npy"), np.load(cache / "images.npy")
    labels[4] = CENTRED  # row 4 = the first validation subject, the one evaluate samples as subject 0
    images[4] = np.where(CENTRED == 0, -1.0, np.where(CENTRED == 1, -0.2, 0.6))
    np.save(cache / "labels.npy", labels)
    np.save(cache / "images.npy", images)
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**TINY, **OVERRIDES}), sort_keys=False))
    params = make_params(OVERRIDES)
    torch.set_num_threads(1)
    rt = init_runtime(params.train.device, params.train.precision)
    assert rt.precision == "bf16"
    trainer = Trainer(params, root, rt, open_cache(cache))
    while trainer.counters.samples_seen < trainer.budget.total_samples:  # 2 optimizer steps of 4 samples
        trainer.train_step()
    checkpoint.save(root / "models" / "checkpoint.pt", trainer.state(True, None))
    with pytest.warns(UserWarning, match="no MLflow run id"):
        run_evaluate(params, root, progress=False)
    return root, params


def sample(ckpt, label, out, *args):
    return run_cli("sample", "--checkpoint", ckpt, "--label", label, "--out", out, "--no-progress", *args)


def test_sample_gives_evaluates_volume_at_the_training_precision(bf16_project, tmp_path):
    from voxdiff.diffusion import sampling
    from voxdiff.training import checkpoint

    root, params = bf16_project
    ckpt, yaml_path = root / "models" / "checkpoint.pt", root / "params.yaml"
    label = write_nifti(tmp_path / "centred.nii.gz", CENTRED.astype(np.int16), np.diag([6.0, 6.0, 6.0, 1.0]))
    evaluated = nib.load(root / "samples" / "sub-004_s0.nii.gz").get_fdata()
    state = checkpoint.load(ckpt)
    assert state["precision_resolved"] == "bf16"
    res = sample(ckpt, label, tmp_path / "gen.nii.gz", "--steps", 5, "--seed", params.seed, "--params", yaml_path)
    assert res.exit_code == 0, res.output
    np.testing.assert_array_equal(nib.load(tmp_path / "gen.nii.gz").get_fdata(), evaluated)
    assert ", bf16," in res.stderr and "warning" not in res.stderr, res.stderr

    # The check has teeth: the same network, noise and steps without the autocast give another volume.
    net, _, diff = sampling.load_ema_network(state, "cpu")
    cond = torch.from_numpy(CENTRED.astype(np.int64))[None]
    fp32 = sampling.generate(net, diff, cond, 3, 5, params.seed, progress=False)[0, 0].numpy()
    assert not np.array_equal(fp32, evaluated)  # measured: every voxel differs, by up to 1.3e-3

    state.pop("format_version")
    older = tmp_path / "no_precision.pt"  # a checkpoint from before precision_resolved: params.yaml's, resolved
    checkpoint.save(older, {k: v for k, v in state.items() if k != "precision_resolved"})
    res = sample(older, label, tmp_path / "older.nii.gz", "--steps", 5, "--seed", params.seed, "--params", yaml_path)
    assert res.exit_code == 0 and ", bf16," in res.stderr, res.output
    np.testing.assert_array_equal(nib.load(tmp_path / "older.nii.gz").get_fdata(), evaluated)

    resolved = tmp_path / "fp32.pt"  # the checkpoint's word wins over params.yaml's
    checkpoint.save(resolved, {**state, "precision_resolved": "fp32"})
    res = sample(resolved, label, tmp_path / "gen32.nii.gz", "--steps", 5, "--seed", params.seed, "--params", yaml_path)
    assert res.exit_code == 0 and ", fp32," in res.stderr, res.output
    np.testing.assert_array_equal(nib.load(tmp_path / "gen32.nii.gz").get_fdata(), fp32)
    checkpoint.save(resolved, {**state, "precision_resolved": "fp64"})
    res = sample(resolved, label, tmp_path / "x" / "o.nii.gz", "--params", yaml_path)
    assert res.exit_code == 2 and "precision_resolved 'fp64' is not one of" in res.stderr, res.output
    assert not (tmp_path / "x").exists()


def test_a_label_map_alone_is_placed_by_trainings_rule(tmp_path):
    """Labels covering the head: the grid of the label map alone is training's grid, crop measure included.
    Tumour-style labels only (BraTS): training centres on the head, the label map alone can only centre on
    the labels, and says so."""
    from voxdiff.data import preprocess

    params = user_params(tmp_path)
    image, label = phantom()
    image_path = write_nifti(tmp_path / "i.nii.gz", image, ras_affine())
    label_path = write_nifti(tmp_path / "l.nii.gz", label, ras_affine())
    _, _, affine, prov = preprocess.preprocess_pair(image_path, label_path, params)
    _, placement, _ = preprocess.preprocess_label(label_path, params)
    np.testing.assert_array_equal(placement.affine, affine)
    assert placement.small_warning() is None and placement.cropped_fraction == prov["cropped_fraction"] == 0

    small = user_params(tmp_path, **{"preprocess.shape": [8, 8, 8]})  # 16 mm: the 32 x 32 x 24 mm head is cut
    _, _, affine, prov = preprocess.preprocess_pair(image_path, label_path, small)
    _, placement, _ = preprocess.preprocess_label(label_path, small)
    np.testing.assert_array_equal(placement.affine, affine)
    assert placement.cropped_fraction == pytest.approx(prov["cropped_fraction"], abs=1e-6)
    assert 0.5 < placement.cropped_fraction < 1 and "% of the foreground voxels lie outside" in prov["warning"]

    tumour = np.zeros_like(label)
    tumour[CUBE] = 2  # a 6 mm lesion off the head's centre, nothing else labelled
    tumour_path = write_nifti(tmp_path / "t.nii.gz", tumour, ras_affine())
    _, _, head_affine, _ = preprocess.preprocess_pair(image_path, tumour_path, params)
    _, placement, _ = preprocess.preprocess_label(tumour_path, params)
    assert not np.allclose(placement.affine, head_affine)  # what training would have done, it cannot
    assert "spans under 50% of the checkpoint's field of view" in placement.small_warning()
    head = np.zeros_like(label)
    head[HEAD] = 1
    assert preprocess.preprocess_label(write_nifti(tmp_path / "h.nii.gz", head, ras_affine()),
                                       params)[1].small_warning() is None


def test_sample_warns_in_one_line_for_a_small_label_map(bf16_project, tmp_path):
    root, params = bf16_project
    blob = np.zeros((40, 40, 40), np.int16)
    blob[18:24, 18:24, 18:24] = 2  # 18 mm at 3 mm in a 96 mm field of view
    label = write_nifti(tmp_path / "blob.nii.gz", blob, np.diag([3.0, 3.0, 3.0, 1.0]))
    res = run_cli("sample", "--checkpoint", root / "models" / "checkpoint.pt", "--label", label,
                  "--out", tmp_path / "blob_out.nii.gz", "--steps", 2, "--params", root / "params.yaml")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and str(label) in warnings[0] and "spans under 50%" in warnings[0], res.stderr


def test_sample_writes_nothing_before_its_inputs_are_checked(bf16_project, tmp_path):
    root, _ = bf16_project
    label = write_nifti(tmp_path / "centred.nii.gz", CENTRED.astype(np.int16), np.diag([6.0, 6.0, 6.0, 1.0]))
    bad_label = write_nifti(tmp_path / "seven.nii.gz", np.where(CENTRED > 0, 7, 0).astype(np.int16), np.eye(4))
    ckpt = root / "models" / "checkpoint.pt"
    for c, lab, text in [(tmp_path / "missing.pt", label, "checkpoint not found"),
                         (ckpt, bad_label, "label values 7 are not in"),
                         (ckpt, tmp_path / "missing.nii.gz", "file not found")]:
        out = tmp_path / "new" / "folder" / "o.nii.gz"
        res = run_cli("sample", "--checkpoint", c, "--label", lab, "--out", out, "--steps", 2,
                      "--params", root / "params.yaml")
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and text in lines[0], (text, res.output)
        assert not (tmp_path / "new").exists(), text


def test_sample_sets_the_cuda_backends_as_evaluate_does(bf16_project, tmp_path, monkeypatch):
    """`voxdiff sample` applies params.yaml's train.tf32 and train.deterministic through the same
    configure_backends as training and evaluate (a no-op on the CPU: recorded here, checked for CUDA in
    tests/test_cuda_settings.py); before, sample never called it, so TF32 stayed at PyTorch's defaults."""
    from voxdiff.runtime import distributed

    root, params = bf16_project
    calls = []
    real = distributed.configure_backends
    monkeypatch.setattr(distributed, "configure_backends", lambda d, t=True, det=False: calls.append((d.type, t, det))
                        or real(d, t, det))
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update(tf32=False, deterministic=True)
    custom = tmp_path / "params.yaml"
    custom.write_text(yaml.safe_dump(raw, sort_keys=False))
    label = write_nifti(tmp_path / "centred.nii.gz", CENTRED.astype(np.int16), np.diag([6.0, 6.0, 6.0, 1.0]))
    res = sample(root / "models" / "checkpoint.pt", label, tmp_path / "gen.nii.gz", "--steps", 2, "--params", custom)
    assert res.exit_code == 0, res.output
    assert calls == [("cpu", False, True)]
