"""Indexing user data: the three layouts users have, glob translation, paths and hashes."""

from __future__ import annotations

import json

import pytest

from datagen import user_params, write_pair
from voxdiff.data import prepare
from voxdiff.data import preprocess
from voxdiff.data import sources
from voxdiff.runtime.errors import ParamsError
from voxdiff.runtime.fsutil import sha256_file

BRATS = [f"BraTS2021_0130{i}" for i in range(3)]


def test_med_ddpm_folder_per_modality(tmp_path):
    """dataset/brats2021/t1/<id>_t1.nii.gz + seg/<id>_seg.nii.gz, source relative to data/."""
    root = tmp_path / "repo"
    src = root / "data" / "brats2021"
    for i, sid in enumerate(BRATS):
        write_pair(src / "t1" / f"{sid}_t1.nii.gz", src / "seg" / f"{sid}_seg.nii.gz", seed=i, lps=True)
    params = user_params("brats2021", **{"data.image_glob": "t1/*_t1.nii.gz", "data.label_glob": "seg/*_seg.nii.gz"})
    subjects = sources.index_subjects(params, root)
    assert [s["id"] for s in subjects] == BRATS
    assert subjects[0]["image"] == f"data/brats2021/t1/{BRATS[0]}_t1.nii.gz"  # relative to the repo
    assert subjects[0]["label"] == f"data/brats2021/seg/{BRATS[0]}_seg.nii.gz"
    assert subjects[0]["image_sha256"] == sha256_file(src / "t1" / f"{BRATS[0]}_t1.nii.gz")
    # prepare writes only index.json for user data; preprocess reads it.
    prepare.run_prepare(params, root)
    raw = root / "data" / "raw"
    assert [p.name for p in raw.iterdir()] == ["index.json"]
    index = json.loads((raw / "index.json").read_text())
    assert index == {"source": "brats2021", "subjects": subjects}
    manifest = preprocess.run_preprocess(params, root)
    assert [s["id"] for s in manifest["subjects"]] == BRATS


def test_brats_folder_per_subject_outside_the_repo(tmp_path):
    """<id>/<id>_t1.nii.gz: both wildcards match the same text, which the id keeps once."""
    root, src = tmp_path / "repo", tmp_path / "elsewhere" / "BraTS2021"
    root.mkdir()
    for i, sid in enumerate(BRATS):
        write_pair(src / sid / f"{sid}_t1.nii.gz", src / sid / f"{sid}_seg.nii.gz", seed=i)
    params = user_params(src, **{"data.image_glob": "*/*_t1.nii.gz", "data.label_glob": "*/*_seg.nii.gz"})
    subjects = sources.index_subjects(params, root)
    assert [s["id"] for s in subjects] == BRATS
    assert subjects[1]["image"] == str(src / BRATS[1] / f"{BRATS[1]}_t1.nii.gz")  # absolute outside the repo
    prepare.run_prepare(params, root)
    assert preprocess.run_preprocess(params, root)["subjects"][2]["label"] == subjects[2]["label"]


def test_folder_per_subject_with_fixed_file_names(tmp_path):
    """sub-01/anat/T1w.nii.gz + sub-01/anat/seg.nii.gz: the id is the folder."""
    src = tmp_path / "bids"
    for i in range(2):
        write_pair(src / f"sub-0{i}" / "anat" / "T1w.nii.gz", src / f"sub-0{i}" / "anat" / "seg.nii.gz", seed=i)
    params = user_params(src, **{"data.image_glob": "*/anat/T1w.nii.gz", "data.label_glob": "*/anat/seg.nii.gz"})
    assert [s["id"] for s in sources.index_subjects(params, tmp_path)] == ["sub-00", "sub-01"]


def test_csv_manifest(tmp_path):
    root = tmp_path / "repo"
    src = root / "data" / "mine"
    write_pair(src / "a" / "scan.nii.gz", src / "a" / "mask.nii.gz", seed=0)
    write_pair(src / "b" / "scan.nii", src / "b" / "mask.nii", seed=1, lps=True)
    write_pair(src / "c" / "scan.nii.gz", src / "c" / "mask.nii.gz", seed=2)
    (src / "list.csv").write_text("image,label\na/scan.nii.gz,a/mask.nii.gz\nb/scan.nii,b/mask.nii\n\n"
                                  "c/scan.nii.gz,c/mask.nii.gz\n")
    params = user_params("mine", **{"data.manifest": "list.csv"})
    subjects = sources.index_subjects(params, root)
    assert [s["id"] for s in subjects] == ["a/scan", "b/scan", "c/scan"]
    assert subjects[1]["label"] == "data/mine/b/mask.nii"
    prepare.run_prepare(params, root)
    assert len(preprocess.run_preprocess(params, root)["subjects"]) == 3


def test_csv_manifest_with_id_column(tmp_path):
    src = tmp_path / "src"
    write_pair(src / "x1.nii.gz", src / "y1.nii.gz", seed=0)
    write_pair(src / "x2.nii.gz", src / "y2.nii.gz", seed=1)
    (src / "m.csv").write_text("id,image,label\npatient-2,x2.nii.gz,y2.nii.gz\npatient-1,x1.nii.gz,y1.nii.gz\n")
    params = user_params(src, **{"data.manifest": "m.csv"})
    subjects = sources.index_subjects(params, tmp_path)
    assert [(s["id"], s["image"]) for s in subjects] == [("patient-1", "src/x1.nii.gz"),
                                                         ("patient-2", "src/x2.nii.gz")]


@pytest.mark.parametrize("pattern, path, groups", [
    ("t1/*_t1.nii.gz", "t1/BraTS2021_01306_t1.nii.gz", ("BraTS2021_01306",)),
    ("*/*_seg.nii.gz", "B_1/B_1_seg.nii.gz", ("B_1", "B_1")),
    ("img/sub-??.nii", "img/sub-07.nii", ("0", "7")),
    ("img/[ab]*.nii", "img/a12.nii", ("a", "12")),
    ("im.g/*(1).nii", "im.g/x(1).nii", ("x",)),
])
def test_glob_regex_captures_the_wildcards(pattern, path, groups):
    assert sources.glob_regex(pattern, "data.image_glob").match(path).groups() == groups


@pytest.mark.parametrize("pattern, path", [("t1/*.nii.gz", "t1/x/y.nii.gz"), ("im.g/*.nii", "imxg/a.nii"),
                                           ("*.nii", "a.nii.gz")])
def test_glob_regex_does_not_overmatch(pattern, path):
    assert sources.glob_regex(pattern, "data.image_glob").match(path) is None


@pytest.mark.parametrize("pattern", ["**/*.nii.gz", "images/a.nii.gz"])
def test_unsupported_globs_name_the_key(pattern):
    with pytest.raises(ParamsError, match="data.label_glob"):
        sources.glob_regex(pattern, "data.label_glob")


def test_source_resolution(tmp_path):
    assert sources.source_dir(user_params("brats2021"), tmp_path) == tmp_path / "data" / "brats2021"
    assert sources.source_dir(user_params(tmp_path / "abs"), tmp_path / "r") == tmp_path / "abs"
    builtin = user_params("mni152", **{"data.label_values": [0, 1, 2, 3]})
    assert sources.source_dir(builtin, tmp_path) == tmp_path / "data" / "raw"
