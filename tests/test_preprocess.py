"""Preprocessing: orientation, resampling, label integrity, normalisation and the cache format."""

from __future__ import annotations

import hashlib
import json

import nibabel as nib
import numpy as np
import pytest

from datagen import (CUBE, ORIGIN, flip_to_lps, phantom, ras_affine, user_params, world_of_voxel,
                     write_dataset, write_nifti, write_pair)
from voxdiff.data import cache
from voxdiff.data import prepare
from voxdiff.data import preprocess


def centroid(mask: np.ndarray) -> np.ndarray:
    return np.array([w.mean() for w in np.nonzero(mask)])


def cube_world_centre() -> np.ndarray:
    return world_of_voxel(ras_affine(), [(s.start + s.stop - 1) / 2 for s in CUBE])


def test_lps_cube_lands_at_its_ras_position(tmp_path):
    """An LPS 2 mm file: the cube's world position survives, and the grid is RAS (positive diagonal)."""
    image_path, label_path = write_pair(tmp_path / "img.nii.gz", tmp_path / "lab.nii.gz", lps=True)
    assert nib.aff2axcodes(nib.load(image_path).affine) == ("L", "P", "S")
    image, classes, affine, prov = preprocess.preprocess_pair(image_path, label_path, user_params(tmp_path))
    assert prov["original_orientation"] == "LPS" and prov["original_shape"] == [24, 24, 20]
    assert np.allclose(affine[:3, :3], np.diag([2.0, 2.0, 2.0]))  # RAS axes, 2 mm
    assert image.shape == classes.shape == (16, 16, 16)
    centre_vox = centroid(classes == 2)
    assert np.allclose(world_of_voxel(affine, centre_vox), cube_world_centre(), atol=1e-6)
    # The cube is right (+x), posterior (-y) and superior (+z) of the head centre: so is its voxel.
    assert centre_vox[0] > 8 and centre_vox[1] < 8 and centre_vox[2] > 8
    assert (classes == 2).sum() == 27


def test_lps_and_ras_files_of_one_head_give_identical_arrays(tmp_path):
    params = user_params(tmp_path)
    ras = preprocess.preprocess_pair(*write_pair(tmp_path / "a_i.nii.gz", tmp_path / "a_l.nii.gz"), params)
    lps = preprocess.preprocess_pair(*write_pair(tmp_path / "b_i.nii.gz", tmp_path / "b_l.nii.gz", lps=True),
                                     params)
    np.testing.assert_allclose(ras[0], lps[0], atol=1e-6)
    np.testing.assert_array_equal(ras[1], lps[1])
    np.testing.assert_allclose(ras[2], lps[2])


def test_resampling_1mm_to_2mm_keeps_position_and_size(tmp_path):
    """An 8 mm cube at 1 mm becomes 4^3 voxels at 2 mm, centred on the same world point."""
    shape = (48, 48, 40)
    image = np.zeros(shape, np.float32)
    label = np.zeros(shape, np.uint8)
    image[8:40, 8:40, 8:32] = 50 + np.arange(24, dtype=np.float32)  # a gradient: not constant
    label[8:40, 8:40, 8:32] = 1
    label[30:38, 12:20, 20:28] = 2
    affine = ras_affine(zoom=1.0, origin=ORIGIN)
    affine_lps = flip_to_lps(label, affine)[1]
    image_path = write_nifti(tmp_path / "i.nii.gz", flip_to_lps(image, affine)[0], affine_lps)
    label_path = write_nifti(tmp_path / "l.nii.gz", flip_to_lps(label, affine)[0], affine_lps)
    out_image, classes, out_affine, prov = preprocess.preprocess_pair(image_path, label_path,
                                                                      user_params(tmp_path))
    assert prov["original_spacing"] == [1.0, 1.0, 1.0]
    assert (classes == 2).sum() == 64
    world = world_of_voxel(out_affine, centroid(classes == 2))
    assert np.allclose(world, world_of_voxel(affine, [33.5, 15.5, 23.5]), atol=0.51)


def test_labels_keep_declared_values_only(tmp_path):
    """BraTS-style values [0, 1, 2, 4] at a non-integer spacing ratio: classes 0..3, nothing fractional."""
    image, label = phantom()
    label[CUBE] = 4
    label[5:8, 5:8, 5:8] = 2
    image_path = write_nifti(tmp_path / "i.nii.gz", image, ras_affine())
    label_path = write_nifti(tmp_path / "l.nii.gz", label.astype(np.float64), ras_affine())  # float on disk
    params = user_params(tmp_path, **{"data.label_values": [0, 1, 2, 4], "preprocess.spacing": [2.7, 3.1, 2.3]})
    _, classes, _, _ = preprocess.preprocess_pair(image_path, label_path, params)
    assert classes.dtype == np.uint8
    assert set(np.unique(classes)) == {0, 1, 2, 3}


def test_intensity_scaled_to_unit_range_with_background_minus_one(tmp_path):
    params = user_params(tmp_path)
    image, classes, _, prov = preprocess.preprocess_pair(
        *write_pair(tmp_path / "i.nii.gz", tmp_path / "l.nii.gz"), params)
    assert image.dtype == np.float32
    assert image.min() == -1.0 and image.max() == 1.0
    assert np.all(image[classes == 0] == -1.0)
    assert prov["intensity_clip"][0] < prov["intensity_clip"][1]


def test_to_original_grid_restores_the_label_map(tmp_path):
    image_path, label_path = write_pair(tmp_path / "i.nii.gz", tmp_path / "l.nii.gz", lps=True)
    _, classes, affine, _ = preprocess.preprocess_pair(image_path, label_path, user_params(tmp_path))
    original = nib.load(label_path)
    back = preprocess.to_original_grid(classes, affine, original, order=0)
    assert back.shape == original.shape
    np.testing.assert_array_equal(back, np.asarray(original.dataobj))


def test_preprocess_label_alone_uses_the_same_grid_rule(tmp_path):
    _, label_path = write_pair(tmp_path / "i.nii.gz", tmp_path / "l.nii.gz", lps=True)
    classes, placement, prov = preprocess.preprocess_label(label_path, user_params(tmp_path))
    assert classes.shape == (16, 16, 16) and prov["original_orientation"] == "LPS"
    assert np.allclose(world_of_voxel(placement.affine, centroid(classes == 2)), cube_world_centre(), atol=1e-6)


def test_run_preprocess_writes_the_cache_format(tmp_path):
    root = tmp_path / "repo"
    ids = write_dataset(root / "data" / "mine", n=4)
    params = user_params("mine")
    prepare.run_prepare(params, root)
    manifest = preprocess.run_preprocess(params, root)
    out = root / "data" / "processed"
    assert sorted(p.name for p in out.iterdir()) == ["images.npy", "labels.npy", "manifest.json", "preview.png"]
    c = cache.open_cache(out)
    assert c.images.dtype == np.float32 and c.labels.dtype == np.uint8
    assert c.images.shape == (4, 16, 16, 16)
    assert [s["id"] for s in c.subjects] == ids
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert c.manifest["version"] == cache.FORMAT_VERSION
    assert c.manifest["shape"] == [16, 16, 16] and c.manifest["spacing"] == [2.0, 2.0, 2.0]
    assert c.label_values == [0, 1, 2]
    split = json.dumps([[s["id"], s["split"]] for s in c.subjects]).encode()
    h = hashlib.sha256(np.asarray(c.images).tobytes() + np.asarray(c.labels).tobytes() + split).hexdigest()[:16]
    assert c.fingerprint == h
    assert len(c.split_indices("val")) == 1 and len(c.split_indices("train")) == 3
    keys = {"id", "index", "split", "image", "label", "image_sha256", "label_sha256", "original_shape",
            "original_spacing", "original_orientation", "affine"}
    for i, s in enumerate(c.subjects):
        assert keys <= set(s) and s["index"] == i
        assert np.asarray(s["affine"]).shape == (4, 4)
    assert [s["original_orientation"] for s in c.subjects] == ["RAS", "LPS", "RAS", "LPS"]
    # Same head in RAS and LPS (s0 and s1 differ only in noise seed): same placement on the grid.
    assert c.subjects[0]["affine"] == c.subjects[1]["affine"]


def test_run_preprocess_is_deterministic(tmp_path):
    root = tmp_path / "repo"
    write_dataset(root / "data" / "mine", n=3)
    params = user_params("mine")
    prepare.run_prepare(params, root)
    first = preprocess.run_preprocess(params, root)
    second = preprocess.run_preprocess(params, root)
    assert first == second


def test_fingerprint_changes_with_the_split(tmp_path):
    """data.seed and data.val_subjects change which volumes train and which validate, not one voxel: the
    data fingerprint (voxdiff.data_fingerprint, the MLflow dataset digest) must change with them."""
    from voxdiff.data.sources import split_subjects

    root = tmp_path / "repo"
    ids = write_dataset(root / "data" / "mine", n=4)
    prepare.run_prepare(user_params("mine"), root)
    seeds = [0, next(s for s in range(1, 20) if split_subjects(ids, 1, s) != split_subjects(ids, 1, 0))]
    runs = {}
    for name, overrides in [("seed0", {"data.seed": seeds[0]}), ("seed0 again", {"data.seed": seeds[0]}),
                            (f"seed{seeds[1]}", {"data.seed": seeds[1]}),
                            ("2 val", {"data.seed": seeds[0], "data.val_subjects": 2})]:
        manifest = preprocess.run_preprocess(user_params("mine", **overrides), root)
        c = cache.open_cache(root / "data" / "processed")
        runs[name] = (manifest["fingerprint"], np.asarray(c.images).copy(), [s["split"] for s in c.subjects])
    fps = [fp for fp, _, _ in runs.values()]
    assert fps[0] == fps[1]  # the same params: the same fingerprint
    assert len(set(fps[1:])) == 3, runs.keys()  # another split: another fingerprint
    for _, images, _ in runs.values():
        np.testing.assert_array_equal(images, runs["seed0"][1])  # ... though no voxel changed
    assert len({tuple(split) for _, _, split in runs.values()}) == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_split_is_by_subject_id(seed):
    from voxdiff.data.sources import split_subjects

    ids = [f"sub-{i:03d}" for i in range(10)]
    split = split_subjects(ids, 3, seed)
    assert sorted(k for k, v in split.items() if v == "val") == sorted(
        k for k, v in split_subjects(list(reversed(ids)), 3, seed).items() if v == "val")
    assert list(split.values()).count("val") == 3
    # Adding a subject moves at most one existing subject out of val.
    more = split_subjects(ids + ["sub-999"], 3, seed)
    moved = [i for i in ids if split[i] != more[i]]
    assert len(moved) <= 1


def test_foreground_of_an_image_that_is_not_skull_stripped():
    """Air around an unstripped head is Rician noise above 0: `> 0` took the whole field of view;
    Otsu's threshold separates the head from it."""
    import numpy as np

    from voxdiff.data.preprocess import otsu_threshold

    rng = np.random.default_rng(0)
    image = np.abs(rng.normal(0, 5, (40, 40, 40)))  # air: magnitude noise, all > 0
    image[10:30, 10:30, 10:30] = rng.normal(100, 10, (20, 20, 20))  # head
    t = otsu_threshold(image)
    head = np.zeros(image.shape, bool)
    head[10:30, 10:30, 10:30] = True
    assert (image > 0).mean() > 0.99  # the old rule: everything
    assert np.array_equal(image > t, head)
    assert otsu_threshold(np.full((4, 4, 4), 3.0)) == 3.0
