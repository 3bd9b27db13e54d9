"""Built-in data: the MNI152 pseudo-subjects (2 subjects at 4 mm to stay fast)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from datagen import leftovers, make_params
from voxdiff.data import builtin
from voxdiff.data import cache
from voxdiff.data import prepare
from voxdiff.data import preprocess
from voxdiff.runtime.errors import ParamsError


def small(seed: int = 0, **overrides):
    """Two subjects at 4 mm, preprocessed to 24^3 at 8 mm: seconds, not minutes."""
    base = {"data.seed": seed, "data.subjects": 2, "data.synth_spacing": 4.0, "data.val_subjects": 1,
            "preprocess.spacing": [8.0, 8.0, 8.0], "preprocess.shape": [24, 24, 24]}
    base.update(overrides)
    return make_params(**base)


def files(root) -> dict[str, bytes]:
    raw = root / "data" / "raw"
    return {p.relative_to(raw).as_posix(): p.read_bytes() for p in sorted(raw.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Seed 0 prepared twice (separate roots) and seed 1 once."""
    roots = {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "other")}
    prepare.run_prepare(small(0), roots["a"])
    prepare.run_prepare(small(0), roots["b"])
    prepare.run_prepare(small(1), roots["other"])
    return roots


def test_layout_and_index(prepared):
    root = prepared["a"]
    assert sorted(files(root)) == ["images/sub-000.nii.gz", "images/sub-001.nii.gz", "index.json",
                                   "labels/sub-000.nii.gz", "labels/sub-001.nii.gz"]
    index = json.loads((root / "data" / "raw" / "index.json").read_text())
    assert index["source"] == "mni152"
    assert [s["id"] for s in index["subjects"]] == ["sub-000", "sub-001"]
    assert index["subjects"][1]["image"] == "data/raw/images/sub-001.nii.gz"
    assert leftovers(root / "data") == []


def test_same_seed_gives_identical_bytes(prepared):
    assert files(prepared["a"]) == files(prepared["b"])


def test_other_seed_gives_other_subjects(prepared):
    a, other = files(prepared["a"]), files(prepared["other"])
    assert a["images/sub-000.nii.gz"] != other["images/sub-000.nii.gz"]
    assert a["labels/sub-001.nii.gz"] != other["labels/sub-001.nii.gz"]


def test_subjects_are_plausible_brains(prepared):
    raw = prepared["a"] / "data" / "raw"
    for i, axes in ((0, ("R", "A", "S")), (1, ("L", "P", "S"))):
        image = nib.load(raw / "images" / f"sub-00{i}.nii.gz")
        label = nib.load(raw / "labels" / f"sub-00{i}.nii.gz")
        assert nib.aff2axcodes(image.affine) == axes  # odd subjects are stored LPS
        assert np.allclose(image.affine, label.affine)
        assert image.get_data_dtype() == np.float32 and label.get_data_dtype() == np.uint8
        assert image.header.get_zooms() == (4.0, 4.0, 4.0)
        img, lab = image.get_fdata(), np.asarray(label.dataobj)
        assert set(np.unique(lab)) == {0, 1, 2, 3}
        assert np.all(img[lab == 0] == 0)  # background exactly 0
        means = [img[lab == k].mean() for k in (1, 2, 3)]
        assert means[0] < means[1] < means[2]  # T1 contrast: CSF < GM < WM
        volume_ml = (lab > 0).sum() * 4.0**3 / 1000
        assert 1000 < volume_ml < 2200  # an adult brain


def test_lps_subject_has_the_same_world_geometry(prepared):
    """Even and odd subjects differ by a few mm of deformation, not by a flip: brain centres agree."""
    raw = prepared["a"] / "data" / "raw"
    centres = []
    for i in (0, 1):
        label = nib.load(raw / "labels" / f"sub-00{i}.nii.gz")
        vox = np.array([w.mean() for w in np.nonzero(np.asarray(label.dataobj) == 3)])
        centres.append(label.affine[:3, :3] @ vox + label.affine[:3, 3])
    assert np.linalg.norm(centres[0] - centres[1]) < 10.0


def test_builtin_preprocesses_into_the_cache(prepared):
    root = prepared["a"]
    manifest = preprocess.run_preprocess(small(0), root)
    c = cache.open_cache(root / "data" / "processed")
    assert c.images.shape == (2, 24, 24, 24)
    assert [s["original_orientation"] for s in manifest["subjects"]] == ["RAS", "LPS"]
    assert sorted(s["split"] for s in manifest["subjects"]) == ["train", "val"]
    assert set(np.unique(c.labels)) == {0, 1, 2, 3}
    assert (root / "data" / "processed" / "preview.png").stat().st_size > 1000


def test_builtin_label_values_must_match(tmp_path):
    with pytest.raises(ParamsError, match="data.label_values"):
        prepare.run_prepare(small(0, **{"data.label_values": [0, 1, 2, 4]}), tmp_path)
    assert not (tmp_path / "data" / "raw").exists()


def test_to_lps_keeps_world_coordinates():
    data = np.arange(24).reshape(2, 3, 4)
    affine = np.diag([2.0, 3.0, 4.0, 1.0])
    affine[:3, 3] = [10, 20, 30]
    flipped, new = builtin.to_lps(data, affine)
    assert nib.aff2axcodes(new) == ("L", "P", "S")
    for ijk in np.ndindex(*data.shape):
        world = affine @ [*ijk, 1]
        new_ijk = np.rint(np.linalg.solve(new, world)[:3]).astype(int)
        assert flipped[tuple(new_ijk)] == data[ijk]
