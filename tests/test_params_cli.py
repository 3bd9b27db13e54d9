"""params.yaml validation and the CLI's one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import REPO, raw_params
from voxdiff.runtime.errors import ParamsError
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
    ({"model.channels": [16, 32, 48], "model.num_head_channels": 32}, "model.num_head_channels"),
    ({"train.adam_betas": [0.9, 1.0]}, "train.adam_betas"),
    ({"train.adam_betas": [0.9]}, "train.adam_betas"),
    ({"train.lr_scaling": "sqrt2"}, "train.lr_scaling"),
])
def test_bad_values_name_their_key(overrides, key):
    with pytest.raises(ParamsError, match=re.escape(key)):
        validate(raw_params(**overrides))


def test_exponent_floats_as_dvc_writes_them_load_as_numbers(tmp_path):
    """`dvc exp run -S train.lr=1e-5` writes `lr: 1e-05` (YAML 1.2); PyYAML's YAML 1.1 would read a string
    and the run would fail as a bad value: params.load reads it as the number."""
    raw = raw_params()
    text = yaml.safe_dump(raw).replace(f"lr_min: {raw['train']['lr_min']}", "lr_min: 1e-05")
    text = text.replace(f"lr: {raw['train']['lr']}", "lr: 2e-3", 1)
    assert "lr_min: 1e-05" in text and "lr: 2e-3" in text
    (tmp_path / "params.yaml").write_text(text)
    p = load(tmp_path / "params.yaml")
    assert p.train.lr_min == 1e-05 and p.train.lr == 2e-3


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


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_precision_on_cpu_follows_native_bf16(monkeypatch, native, expected):
    """auto = bf16 only on CPUs whose bf16 is native (AVX512-BF16/AMX: 1.7-6.7x faster here), else fp32;
    an explicit choice always wins."""
    from voxdiff.runtime import distributed

    monkeypatch.setattr(distributed, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    dtype, why = distributed.auto_precision(cpu)
    assert dtype is expected and ("native bf16" in why)
    assert distributed.pick_precision("auto", cpu) is expected
    assert distributed.pick_precision("fp32", cpu) is None and distributed.pick_precision("bf16", cpu) is torch.bfloat16


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_precision_on_gpus_without_bf16_falls_back_to_fp16(monkeypatch, bf16, expected):
    from voxdiff.runtime import distributed

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert distributed.pick_precision("auto", torch.device("cuda:0")) is expected


def test_this_machine_reports_what_auto_picks():
    """The probe itself runs here (no monkeypatch): the answer is one of the two, with its reason."""
    from voxdiff.runtime.distributed import auto_precision, cpu_has_native_bf16

    dtype, why = auto_precision(torch.device("cpu"))
    assert (dtype is torch.bfloat16) == cpu_has_native_bf16() and why


def test_doctor_reports_device_precision_versions_and_store(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    out = run_cli("doctor", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip() and " " in line)
    for key in ("voxdiff", "device", "precision", "torch", "monai", "mlflow", "dvc"):
        assert key in fields, key
    assert "auto picks" in fields["precision"]
    assert "sqlite:///mlflow.db" in out.stdout and str(tmp_path) not in out.stdout
    # A server that does not answer: the same report, in this process (a second interpreter costs ~6 s of CPU).
    from click.testing import CliRunner

    from voxdiff.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    bad = CliRunner().invoke(main, ["doctor", "--root", str(tmp_path)])
    assert bad.exit_code == 0 and "NOT reachable" in bad.output, bad.output
