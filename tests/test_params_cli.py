"""params.yaml validation and the CLI's one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, raw_params
from voxdiff.errors import ParamsError
from voxdiff.params import SCHEMA, flatten, load, validate


def test_shipped_params_files_are_valid():
    load(REPO / "params.yaml")
    load(REPO / "params-gpu.yaml")


def test_every_key_is_documented_in_params_yaml():
    """Every leaf key line carries a comment, and the schema and the file list the same keys."""
    text = (REPO / "params.yaml").read_text()
    for line in text.splitlines():
        m = re.match(r"^\s*([a-z_]+):\s*(\S.*)$", line)
        if m and not m.group(2).startswith("#"):
            assert "#" in m.group(2), f"undocumented key: {line.strip()}"
    file_keys = set(flatten(yaml.safe_load(text)))
    schema_keys = {f"{s}.{k}" if isinstance(v, dict) else s for s, v in SCHEMA.items()
                   for k in (v if isinstance(v, dict) else [None])}
    assert file_keys == schema_keys


@pytest.mark.parametrize("value", [0, -1, 2.5, "four", True, None])
def test_bad_accumulate_every_names_the_key(value):
    with pytest.raises(ParamsError, match=r"train\.accumulate_every must be an integer >= 1"):
        validate(raw_params(**{"train.accumulate_every": value}))


@pytest.mark.parametrize("overrides, key", [
    ({"train.max_steps": 10, "train.max_samples": 10}, "train.max_steps and train.max_samples"),
    ({"train.max_steps": 0, "train.max_samples": 0}, "train.max_steps and train.max_samples"),
    ({"train.lr_scaling": "cubic"}, "train.lr_scaling"),
    ({"train.precision": "fp8"}, "train.precision"),
    ({"train.device": "tpu"}, "train.device"),
    ({"preprocess.shape": [30, 32, 32]}, "preprocess.shape"),
    ({"model.attention_levels": [False, True]}, "model.attention_levels"),
    ({"model.norm_num_groups": 7}, "model.norm_num_groups"),
    ({"data.label_values": [0]}, "data.label_values"),
    ({"train.lr": -1.0}, "train.lr"),
    ({"diffusion.schedule": "quadratic"}, "diffusion.schedule"),
])
def test_bad_values_name_their_key(overrides, key):
    with pytest.raises(ParamsError, match=re.escape(key)):
        validate(raw_params(**overrides))


def test_missing_and_unknown_keys():
    raw = raw_params()
    del raw["train"]["lr"]
    with pytest.raises(ParamsError, match=r"missing key train\.lr"):
        validate(raw)
    with pytest.raises(ParamsError, match=r"unknown key train\.lr_warmup"):
        validate(raw_params(**{"train.lr_warmup": 3}))


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "voxdiff.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "four"])
def test_cli_bad_param_is_one_line_exit_2(tmp_path, value):
    text = (REPO / "params.yaml").read_text().replace("accumulate_every: 2 ", f"accumulate_every: {value} ")
    (tmp_path / "params.yaml").write_text(text)
    out = run_cli("train", "--root", str(tmp_path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: params.yaml: train.accumulate_every"), out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "models").exists()
    debug = run_cli("--debug", "train", "--root", str(tmp_path))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_help_explains_each_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("prepare", "preprocess", "train", "evaluate", "compare", "sample"):
        assert cmd in out.stdout
    assert "accumulate_every" in run_cli("train", "--help").stdout or "Resumes" in run_cli("train", "--help").stdout
