"""Find the user's image/label pairs (globs or a CSV manifest) and split them into train/val.

Pairing never guesses: every image needs exactly one label with the same subject id and vice versa,
otherwise a DataError names the file that is alone.
"""

from __future__ import annotations

import csv
import hashlib
import re
from pathlib import Path

from voxdiff.runtime.errors import DataError, ParamsError
from voxdiff.runtime.fsutil import sha256_file

BUILTIN_IMAGE_GLOB = "images/*.nii.gz"  # what builtin.py writes, whatever data.image_glob says
BUILTIN_LABEL_GLOB = "labels/*.nii.gz"
NIFTI_SUFFIXES = (".nii.gz", ".nii")

Pair = tuple[str, Path, Path]  # (subject id, image path, label path)


# --- where the data is --------------------------------------------------------------------------
def raw_dir(root: str | Path) -> Path:
    """prepare's output: the built-in NIfTIs and/or index.json."""
    return Path(root) / "data" / "raw"


def source_dir(params, root: str | Path) -> Path:
    """data.source as a directory: "mni152" -> data/raw, relative -> under data/, absolute as is."""
    if params.data.builtin:
        return raw_dir(root)
    given = Path(params.data.source).expanduser()
    return given if given.is_absolute() else Path(root) / "data" / given


def check_source_dir(path: Path, root: str | Path) -> None:
    if not path.is_dir():
        raise DataError(f"{path}: data.source directory not found (a relative data.source is looked up "
                        f"under {Path(root) / 'data'})")
    if not any(path.iterdir()):
        raise DataError(f"{path}: data.source directory is empty")
    # prepare replaces data/raw and preprocess data/processed: the user's data must not live there.
    resolved = path.resolve()
    for stage_out in (raw_dir(root), Path(root) / "data" / "processed"):
        out = stage_out.resolve()
        if resolved == out or out in resolved.parents or resolved in out.parents:
            raise DataError(f"{path}: data.source overlaps {stage_out}, which the pipeline overwrites; "
                            "keep your data in its own folder under data/")


# --- glob pairing -------------------------------------------------------------------------------
def glob_regex(pattern: str, key: str) -> re.Pattern:
    """fnmatch-style glob -> regex whose groups are the wildcard matches (`*` stays inside one folder)."""
    if "**" in pattern:
        raise ParamsError(f"params.yaml: {key} {pattern!r}: '**' is not supported, use one '*' per folder level")
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out.append("([^/]*)")
        elif c == "?":
            out.append("([^/])")
        elif c == "[" and "]" in pattern[i + 2:]:  # character class, as pathlib.glob reads it
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"([{body.replace(chr(92), chr(92) * 2)}])")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    if not any(g.startswith("(") for g in out):
        raise ParamsError(f"params.yaml: {key} {pattern!r} needs a wildcard (*): its match is the subject id")
    return re.compile("^" + "".join(out) + "$")


def subject_id(groups: tuple[str, ...]) -> str:
    """Wildcard matches joined by "/". Repeats collapse (BraTS' <id>/<id>_t1 gives <id>), empty matches
    drop and a trailing NIfTI suffix goes, so `images/*` pairs with `labels/*` whatever the extension."""
    parts: list[str] = []
    for g in groups[:-1] + (strip_nifti_suffix(groups[-1]),):
        if g and (not parts or parts[-1] != g):
            parts.append(g)
    return "/".join(parts)


def files_by_id(src: Path, pattern: str, key: str) -> dict[str, Path]:
    """Files under src matching the glob, keyed by subject id; two files with one id is an error."""
    regex = glob_regex(pattern, key)
    found: dict[str, Path] = {}
    for path in sorted(src.glob(pattern)):
        if not path.is_file():
            continue
        m = regex.match(path.relative_to(src).as_posix())
        if m is None:  # pathlib and our regex disagree only on exotic patterns; skip rather than guess
            continue
        sid = subject_id(m.groups())
        if sid in found:
            raise DataError(f"{path}: subject id {sid!r} (from {key} {pattern!r}) also matches {found[sid]}")
        found[sid] = path
    return found


def pair_by_glob(src: Path, image_glob: str, label_glob: str) -> list[Pair]:
    images = files_by_id(src, image_glob, "data.image_glob")
    labels = files_by_id(src, label_glob, "data.label_glob")
    if not images:
        raise DataError(f"{src}: no files match data.image_glob {image_glob!r}")
    if not labels:
        raise DataError(f"{src}: no files match data.label_glob {label_glob!r}")
    for sid, path in images.items():
        if sid not in labels:
            raise DataError(f"{path}: image of subject {sid!r} has no label (data.label_glob {label_glob!r})")
    for sid, path in labels.items():
        if sid not in images:
            raise DataError(f"{path}: label of subject {sid!r} has no image (data.image_glob {image_glob!r})")
    return [(sid, images[sid], labels[sid]) for sid in sorted(images)]


# --- manifest pairing ---------------------------------------------------------------------------
def strip_nifti_suffix(path: str) -> str:
    for suffix in NIFTI_SUFFIXES:
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def pair_by_manifest(src: Path, manifest: str) -> list[Pair]:
    """CSV with columns image,label (optional id); paths relative to the source dir."""
    path = Path(manifest) if Path(manifest).is_absolute() else src / manifest
    if not path.is_file():
        raise DataError(f"{path}: data.manifest file not found")
    try:
        reader = csv.DictReader(path.read_text(encoding="utf-8-sig").splitlines())
        header = {(f or "").strip() for f in reader.fieldnames or []}
        rows = [(reader.line_num, {(k or "").strip(): (v or "").strip() for k, v in row.items() if k is not None})
                for row in reader]
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None
    missing = {"image", "label"} - header
    if missing:
        raise DataError(f"{path}: the header needs columns image,label (optional id); missing {sorted(missing)}")
    if not rows:
        raise DataError(f"{path}: the manifest lists no subjects")
    pairs: dict[str, Pair] = {}
    for line, row in rows:
        if not row["image"] or not row["label"]:
            raise DataError(f"{path}: line {line} needs both an image and a label path")
        image, label = src / row["image"], src / row["label"]
        for f in (image, label):
            if not f.is_file():
                raise DataError(f"{f}: file not found (listed in {path}, line {line})")
        sid = row.get("id") or strip_nifti_suffix(row["image"])
        if sid in pairs:
            raise DataError(f"{path}: line {line}: subject id {sid!r} is listed twice")
        pairs[sid] = (sid, image, label)
    return [pairs[sid] for sid in sorted(pairs)]


# --- the index ------------------------------------------------------------------------------------
def shown_path(path: Path, root: str | Path) -> str:
    """Relative to the repo when inside it (portable index), else absolute."""
    path, root = Path(path).absolute(), Path(root).absolute()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def find_pairs(params, root: str | Path) -> list[Pair]:
    src = source_dir(params, root)
    d = params.data
    if d.builtin:
        if not src.is_dir():
            raise DataError(f"{src}: built-in data not found (run `dvc repro prepare`)")
        return pair_by_glob(src, BUILTIN_IMAGE_GLOB, BUILTIN_LABEL_GLOB)
    check_source_dir(src, root)
    return pair_by_manifest(src, d.manifest) if d.manifest else pair_by_glob(src, d.image_glob, d.label_glob)


def describe(pairs: list[Pair], root: str | Path, moved: tuple[Path, Path] | None = None) -> list[dict]:
    """Index records; ``moved=(tmp, final)`` records files by where they will be after a rename."""
    records = []
    for sid, image, label in pairs:
        show = [p if moved is None else moved[1] / p.relative_to(moved[0]) for p in (image, label)]
        records.append({"id": sid, "image": shown_path(show[0], root), "label": shown_path(show[1], root),
                        "image_sha256": sha256_file(image), "label_sha256": sha256_file(label)})
    return sorted(records, key=lambda r: r["id"])


def index_subjects(params, root: str | Path) -> list[dict]:
    """Every subject of data.source: id, image, label (paths) and their sha256, sorted by id."""
    return describe(find_pairs(params, root), root)


# --- split ------------------------------------------------------------------------------------------
def split_subjects(ids: list[str], val_subjects: int, seed: int) -> dict[str, str]:
    """id -> "train"/"val". Depends only on (seed, id), so adding a subject moves no other one
    unless it outranks it."""
    if len(set(ids)) != len(ids):
        raise DataError("subject ids are not unique: " + ", ".join(sorted({i for i in ids if ids.count(i) > 1})))
    if len(ids) < val_subjects + 1:
        raise ParamsError(f"params.yaml: data.val_subjects = {val_subjects} needs at least {val_subjects + 1} "
                          f"subjects (at least one left to train on), but the data has {len(ids)}")
    rank = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    val = set(rank[:val_subjects])
    return {i: ("val" if i in val else "train") for i in sorted(ids)}
