"""Bad data: each case fails with a one-line DataError/ParamsError that names the file (or key),
and leaves no partial output directory behind."""

from __future__ import annotations

import gzip
import re
import tracemalloc

import nibabel as nib
import numpy as np
import pytest

from datagen import leftovers, phantom, ras_affine, user_params, write_dataset, write_nifti
from voxdiff.data import nifti
from voxdiff.data import prepare
from voxdiff.data import preprocess
from voxdiff.runtime.errors import DataError, ParamsError


@pytest.fixture
def repo(tmp_path):
    """A repo root with three good subjects in data/mine/{images,labels}/s{0,1,2}.nii.gz (s1 is LPS)."""
    root = tmp_path / "repo"
    write_dataset(root / "data" / "mine", n=3)
    return root


def src(root):
    return root / "data" / "mine"


def fails_cleanly(root, params, error, *names, stage=prepare.run_prepare):
    """Run a stage, expect ``error`` naming every one of ``names``; no output dir may be left."""
    before = (root / "data" / "raw").exists()
    with pytest.raises(error) as info:
        stage(params, root)
    message = str(info.value)
    assert "\n" not in message  # one line
    for name in names:
        assert str(name) in message, f"{name!r} not in {message!r}"
    if stage is prepare.run_prepare:
        assert (root / "data" / "raw").exists() == before
    assert not (root / "data" / "processed").exists()
    assert leftovers(root / "data") == []
    return message


# --- the source directory -----------------------------------------------------------------------
def test_missing_source_dir(tmp_path):
    fails_cleanly(tmp_path, user_params("nothere"), DataError, tmp_path / "data" / "nothere")


def test_empty_source_dir(tmp_path):
    (tmp_path / "data" / "empty").mkdir(parents=True)
    fails_cleanly(tmp_path, user_params("empty"), DataError, tmp_path / "data" / "empty", "empty")


def test_no_file_matches_the_glob(repo):
    fails_cleanly(repo, user_params("mine", **{"data.image_glob": "t1/*.nii.gz"}), DataError,
                  "data.image_glob", "t1/*.nii.gz")


def test_source_inside_the_pipeline_outputs(repo):
    write_dataset(repo / "data" / "raw" / "x", n=2)
    fails_cleanly(repo, user_params("raw/x"), DataError, repo / "data" / "raw")


# --- pairing ------------------------------------------------------------------------------------
def test_image_without_label(repo):
    write_nifti(src(repo) / "images" / "s9.nii.gz", phantom()[0], ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, src(repo) / "images" / "s9.nii.gz", "has no label")


def test_label_without_image(repo):
    (src(repo) / "images" / "s1.nii.gz").unlink()
    fails_cleanly(repo, user_params("mine"), DataError, src(repo) / "labels" / "s1.nii.gz", "has no image")


def test_manifest_duplicate_id(repo):
    (src(repo) / "m.csv").write_text("image,label\nimages/s0.nii.gz,labels/s0.nii.gz\n"
                                     "images/s0.nii.gz,labels/s1.nii.gz\n")
    fails_cleanly(repo, user_params("mine", **{"data.manifest": "m.csv"}), DataError, src(repo) / "m.csv",
                  "line 3", "listed twice")


def test_manifest_missing_file(repo):
    (src(repo) / "m.csv").write_text("image,label\nimages/s0.nii.gz,labels/nope.nii.gz\n")
    fails_cleanly(repo, user_params("mine", **{"data.manifest": "m.csv"}), DataError,
                  src(repo) / "labels" / "nope.nii.gz", "m.csv")


def test_manifest_without_the_columns(repo):
    (src(repo) / "m.csv").write_text("t1,seg\nimages/s0.nii.gz,labels/s0.nii.gz\n")
    fails_cleanly(repo, user_params("mine", **{"data.manifest": "m.csv"}), DataError, "m.csv", "label")


def test_missing_manifest(repo):
    fails_cleanly(repo, user_params("mine", **{"data.manifest": "list.csv"}), DataError, src(repo) / "list.csv")


def test_glob_ids_collide(tmp_path):
    """Two files, one id: a/a/b and a/b/b both give "a/b" once repeats collapse."""
    s = tmp_path / "data" / "mine"
    for name in ("a/a/b.nii.gz", "a/b/b.nii.gz"):
        write_nifti(s / name, phantom()[0], ras_affine())
    fails_cleanly(tmp_path, user_params("mine", **{"data.image_glob": "*/*/*.nii.gz",
                                                   "data.label_glob": "*/*/*.nii.gz"}),
                  DataError, s / "a" / "b" / "b.nii.gz", "'a/b'", "also matches")


def test_fewer_subjects_than_the_split_needs(tmp_path):
    write_dataset(tmp_path / "data" / "mine", n=2)
    fails_cleanly(tmp_path, user_params("mine", **{"data.val_subjects": 2}), ParamsError,
                  "data.val_subjects", "at least 3", "has 2")


# --- file contents --------------------------------------------------------------------------------
def test_not_a_nifti_file(repo):
    bad = src(repo) / "images" / "s1.nii.gz"
    bad.write_bytes(b"<html>404 not found</html>")
    fails_cleanly(repo, user_params("mine"), DataError, bad, "not a readable NIfTI")


def test_gzip_of_something_else(repo):
    bad = src(repo) / "labels" / "s2.nii.gz"
    bad.write_bytes(gzip.compress(b"just some text " * 100))
    fails_cleanly(repo, user_params("mine"), DataError, bad)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_file(repo, keep):
    bad = src(repo) / "images" / "s0.nii.gz"
    data = bad.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)])
    fails_cleanly(repo, user_params("mine"), DataError, bad)


def test_truncated_uncompressed_file(repo):
    image, label = phantom()
    good = src(repo) / "images" / "s0.nii.gz"
    good.unlink()
    bad = write_nifti(src(repo) / "images" / "s0.nii", image, ras_affine())
    bad.write_bytes(bad.read_bytes()[:-1000])
    fails_cleanly(repo, user_params("mine", **{"data.image_glob": "images/*"}), DataError, bad, "truncated")


def test_4d_image(repo):
    image, _ = phantom()
    bad = write_nifti(src(repo) / "images" / "s1.nii.gz", np.stack([image, image], axis=-1), ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, bad, "4D")


def test_trailing_singleton_4th_dim_is_accepted(repo):
    image, _ = phantom()
    write_nifti(src(repo) / "images" / "s2.nii.gz", image[..., None], ras_affine())
    prepare.run_prepare(user_params("mine"), repo)
    assert preprocess.run_preprocess(user_params("mine"), repo)["subjects"][2]["original_shape"] == [24, 24, 20]


def test_shape_mismatch(repo):
    image, _ = phantom()
    bad = write_nifti(src(repo) / "images" / "s2.nii.gz", image[:, :, :18], ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, bad, src(repo) / "labels" / "s2.nii.gz", "shapes differ")


def test_affine_mismatch(repo):
    image, _ = phantom()
    shifted = ras_affine()
    shifted[0, 3] += 0.5  # half a millimetre: a different grid
    bad = write_nifti(src(repo) / "images" / "s2.nii.gz", image, shifted)
    fails_cleanly(repo, user_params("mine"), DataError, bad, src(repo) / "labels" / "s2.nii.gz", "affines differ")


def test_tiny_affine_difference_is_tolerated(repo):
    image, _ = phantom()
    close = ras_affine()
    close[0, 3] += 1e-5  # float32 rounding between tools
    write_nifti(src(repo) / "images" / "s2.nii.gz", image, close)
    prepare.run_prepare(user_params("mine"), repo)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_voxels(repo, value):
    image, _ = phantom()
    image[3, 4, 5] = value
    bad = write_nifti(src(repo) / "images" / "s0.nii.gz", image, ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, bad, "NaN or infinite")


def test_label_values_outside_the_mapping(repo):
    _, label = phantom()
    label[0, 0, 0] = 7
    label[1, 0, 0] = 5
    bad = write_nifti(src(repo) / "labels" / "s0.nii.gz", label, ras_affine())
    message = fails_cleanly(repo, user_params("mine"), DataError, bad, "data.label_values")
    assert re.search(r"label values 5, 7 are not in", message)


def test_fractional_label_values(repo):
    _, label = phantom()
    label = label.astype(np.float32)
    label[2, 2, 2] = 0.5
    bad = write_nifti(src(repo) / "labels" / "s0.nii.gz", label, ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, bad, "0.5")


def absurd_header(path, shape=(100000, 100000, 100000)):
    """A NIfTI-2 file whose header claims ``shape`` (4e15 voxels) but holds a few bytes."""
    header = nib.Nifti2Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.float32)
    header["vox_offset"] = 544
    path.write_bytes(header.binaryblock + b"\0" * 4 + b"\0" * 64)
    return path


def test_absurd_header_size_is_rejected_without_allocating(tmp_path):
    path = absurd_header(tmp_path / "huge.nii")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="implausible size"):
            nifti.load_volume(path, "image")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20  # the claimed volume would be 16 PB


def test_absurd_header_in_a_dataset(repo):
    (src(repo) / "images" / "s1.nii.gz").unlink()
    bad = absurd_header(src(repo) / "images" / "s1.nii", shape=(4000, 10, 10))
    fails_cleanly(repo, user_params("mine", **{"data.image_glob": "images/*"}), DataError, bad,
                  "implausible size")


# --- preprocess-time failures -------------------------------------------------------------------
def test_data_changed_after_prepare(repo):
    prepare.run_prepare(user_params("mine"), repo)
    image, _ = phantom(seed=5)
    changed = write_nifti(src(repo) / "images" / "s1.nii.gz", image, ras_affine())
    fails_cleanly(repo, user_params("mine"), DataError, changed, "rerun prepare", stage=preprocess.run_preprocess)


def test_preprocess_without_prepare(repo):
    fails_cleanly(repo, user_params("mine"), DataError, repo / "data" / "raw" / "index.json",
                  stage=preprocess.run_preprocess)


def test_source_changed_in_params_after_prepare(repo):
    prepare.run_prepare(user_params("mine"), repo)
    write_dataset(repo / "data" / "other", n=3)
    fails_cleanly(repo, user_params("other"), DataError, "index.json", "'mine'", stage=preprocess.run_preprocess)


def test_constant_image_fails_halfway_without_output(repo):
    """The third subject fails inside the stage: the two written rows must not survive."""
    write_nifti(src(repo) / "images" / "s2.nii.gz", np.full((24, 24, 20), 5.0, np.float32), ras_affine())
    prepare.run_prepare(user_params("mine"), repo)
    fails_cleanly(repo, user_params("mine"), DataError, src(repo) / "images" / "s2.nii.gz", "constant",
                  stage=preprocess.run_preprocess)


def test_empty_foreground(repo):
    write_nifti(src(repo) / "images" / "s2.nii.gz", np.zeros((24, 24, 20), np.float32), ras_affine())
    write_nifti(src(repo) / "labels" / "s2.nii.gz", np.zeros((24, 24, 20), np.uint8), ras_affine())
    prepare.run_prepare(user_params("mine"), repo)
    fails_cleanly(repo, user_params("mine"), DataError, src(repo) / "images" / "s2.nii.gz", "no foreground",
                  stage=preprocess.run_preprocess)
