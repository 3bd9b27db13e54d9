"""CUDA defaults and operations, as far as a CPU can check them: train.tf32 / train.compile /
train.deterministic (validated, no-ops on the CPU, wired on CUDA, in or out of the run's identity),
torch.compile training, the GPU lines of `voxdiff doctor`, nvidia-ml-py, the process-group timeout,
evaluation metrics on a device.

Not run here (no GPU): TF32 and deterministic kernels on a real CUDA device, cudnn.benchmark's effect,
inductor's generated code for the 3D UNet (it compiled the tiny network in 227 s on one busy core of the
reference machine, so the training test uses dynamo's eager backend: the same graph capture, no code
generation), the metrics' CUDA path; benchmarks/gpu.sh measures those on a GPU.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch

from conftest import REPO, make_params, raw_params
from voxdiff.runtime.errors import ParamsError
from voxdiff.params import validate
from voxdiff.runtime import distributed

NEW_KEYS = ("tf32", "compile", "deterministic")


@pytest.mark.parametrize("key", NEW_KEYS)
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_new_keys_must_be_booleans(key, value):
    with pytest.raises(ParamsError, match=rf"train\.{key} must be true or false"):
        validate(raw_params(**{f"train.{key}": value}))


@pytest.mark.parametrize("key", NEW_KEYS)
def test_new_keys_are_required_and_shipped(key):
    import yaml

    raw = raw_params()
    del raw["train"][key]
    with pytest.raises(ParamsError, match=rf"missing key train\.{key}"):
        validate(raw)
    expected = {"tf32": True, "compile": False, "deterministic": False}[key]
    for name in ("params.yaml", "params-gpu.yaml"):
        assert yaml.safe_load((REPO / name).read_text())["train"][key] is expected, name


def _backend_state() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def test_cuda_settings_are_noops_on_the_cpu(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _backend_state()
    for tf32 in (True, False):
        for deterministic in (True, False):
            assert distributed.configure_backends(torch.device("cpu"), tf32, deterministic) == {}
    assert _backend_state() == before


def test_cuda_settings_are_wired_for_a_cuda_device(monkeypatch):
    """The switches themselves are process-wide flags that exist without a GPU: set them as for CUDA,
    check each, then put every one back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _backend_state()
    cuda = torch.device("cuda")
    try:
        done = distributed.configure_backends(cuda, tf32=True, deterministic=False)
        assert done["tf32"] is True and torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        # what inductor reads when it compiles must stay readable (2.13 raises after the per-backend API)
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision != "tf32"  # the CPU's oneDNN matmuls untouched
        assert torch.backends.cudnn.benchmark
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        distributed.configure_backends(cuda, tf32=False, deterministic=True)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own deterministic choice stays
        distributed.configure_backends(cuda, tf32=False, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        m, c, bench, det, algos, _, _ = before
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = bench, det
        torch.use_deterministic_algorithms(algos)
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert _backend_state() == before


def test_run_identity_holds_tf32_and_deterministic_but_not_compile(tiny_root):
    """tf32 and deterministic change a CUDA run's numbers (and what it can claim): a checkpoint made with
    one value does not stand for the other. torch.compile is the same maths: operational, like the device."""
    from voxdiff.data.cache import open_cache
    from voxdiff.report.groups import NOT_TRAINING_KEYS
    from voxdiff.training.trainer import OPERATIONAL_KEYS, Trainer

    def fingerprint(**train):
        p = make_params({f"train.{k}": v for k, v in train.items()})
        return Trainer(p, tiny_root, distributed.init_runtime("cpu", "fp32"),
                       open_cache(tiny_root / "data" / "processed")).fingerprint()

    base = fingerprint()
    assert fingerprint(tf32=False) != base and fingerprint(deterministic=True) != base
    assert fingerprint(compile=True) == base
    assert "compile" in OPERATIONAL_KEYS and "tf32" not in OPERATIONAL_KEYS and "deterministic" not in OPERATIONAL_KEYS
    assert "train.compile" in NOT_TRAINING_KEYS and "train.tf32" not in NOT_TRAINING_KEYS


def test_compiled_training_follows_the_eager_trajectory(tiny_root, monkeypatch):
    """train.compile: true trains through torch.compile (dynamo's eager backend here: see the module
    docstring) with the same losses as eager, and logs the compile's seconds."""
    from voxdiff.pipeline.train import run_training

    calls = []
    real = torch.compile

    def compile_eager(model, **kw):
        calls.append(type(model).__name__)
        return real(model, backend="eager", **kw)

    cfg = {"train.max_samples": 12, "train.batch_size": 2, "train.accumulate_every": 2,
           "train.gns_buckets_every_samples": 0, "train.phema_sigma_rels": []}
    eager = run_training(make_params(cfg), tiny_root, progress=False)
    eager_curve = (tiny_root / "metrics" / "train_curve.tsv").read_text()
    monkeypatch.setattr(torch, "compile", compile_eager)
    try:
        _compiled_runs(cfg, tiny_root, calls, eager, eager_curve)
    finally:
        torch._dynamo.reset()  # no compiled graphs left for other tests


def _compiled_runs(cfg, tiny_root, calls, eager, eager_curve):
    from voxdiff.pipeline.train import run_training

    compiled = run_training(make_params({**cfg, "train.compile": True}), tiny_root, progress=False)
    assert calls == ["DiffusionModelUNet"]
    # compile is operational: the finished eager checkpoint stands for it ("nothing to train")...
    assert compiled["total_steps"] == eager["total_steps"] and compiled["compile_seconds"] is None
    compiled = run_training(make_params({**cfg, "train.compile": True}), tiny_root, progress=False, restart=True)
    assert calls == ["DiffusionModelUNet"] * 2
    compiled_curve = (tiny_root / "metrics" / "train_curve.tsv").read_text()
    losses = lambda text: [float(r.split("\t")[3]) for r in text.splitlines()[1:]]  # noqa: E731
    np.testing.assert_allclose(losses(compiled_curve), losses(eager_curve), rtol=1e-6)
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-6)
    assert compiled["compile_seconds"] is not None and compiled["compile_seconds"] >= 0
    assert eager["compile_seconds"] is None


def test_process_group_is_joined_with_an_explicit_timeout(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(seen))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    rt = distributed.init_runtime("cpu", "fp32")
    assert rt.world_size == 2 and seen["backend"] == "gloo"
    assert seen["timeout"] == distributed.PROCESS_GROUP_TIMEOUT
    assert distributed.PROCESS_GROUP_TIMEOUT.total_seconds() == 3600


def test_doctor_says_no_cuda_device_here():
    from voxdiff import doctor

    lines = dict(doctor.gpu_lines())
    assert lines["cuda"].startswith("no CUDA device")
    assert "nvml" not in lines or "not installed" in lines["nvml"]  # NVML has no driver here: nothing to say


def test_doctor_shows_the_gpu_memory_and_driver(monkeypatch):
    """A CUDA device as torch.cuda reports it and NVML's view of the machine, both faked."""
    from voxdiff import doctor

    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    mem = types.SimpleNamespace(used=2**30, total=141 * 2**30)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: "570.86.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12080, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlDeviceGetMemoryInfo=lambda h: mem,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    lines = dict(doctor.gpu_lines())
    assert lines["cuda"].startswith("1 device(s) visible to PyTorch")
    assert lines["cuda:0"] == "NVIDIA H200, 141.0 GiB, compute capability 9.0"
    assert lines["driver"] == "NVIDIA 570.86.15, supports CUDA 12.8"
    assert lines["gpu 0"] == "NVIDIA H200, 1.0 of 141.0 GiB in use (NVML)"
    fake.nvmlDeviceGetCount = lambda: 1 / 0  # a broken NVML is reported, never raised
    assert "error" in dict(doctor.gpu_lines())["nvml"]


def test_nvidia_ml_py_is_locked_declared_and_harmless_without_a_gpu():
    import re

    lock = (REPO / "requirements.lock").read_text()
    assert re.search(r"^nvidia-ml-py==\d+\.\d+\.\d+$", lock, re.M)
    assert '"nvidia-ml-py"' in (REPO / "pyproject.toml").read_text()
    import pynvml  # noqa: F401  installed from the lock
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor.__new__(SystemMetricsMonitor)
    assert monitor._initialize_gpu_monitor() is None  # no driver: MLflow skips GPU metrics, nothing raised


def test_exact_fp32_block_for_the_metrics_restores_the_training_switches():
    from voxdiff.pipeline.evaluate import ieee_fp32

    before = _backend_state()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with ieee_fp32(None):  # no device (the CPU path): nothing touched
            assert torch.backends.cudnn.allow_tf32
        with ieee_fp32(torch.device("cuda")):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
    assert _backend_state() == before


def test_metrics_on_a_device_agree_with_the_cpu_path():
    """evaluate on CUDA keeps SSIM, MS-SSIM, PSNR and MAE on the device (metric device = its CUDA device);
    the torch code path, run here with device "cpu", gives the numpy path's numbers; without a device
    (the CPU default) nothing changed."""
    from scipy.ndimage import gaussian_filter

    from voxdiff.pipeline.evaluate import fidelity, BrainMSSSIM, BrainSSIM

    rng = np.random.default_rng(0)
    real = np.clip(3 * gaussian_filter(rng.standard_normal((32, 32, 32)), 2), -1, 1).astype(np.float32)
    sample = np.clip(real + 0.2 * rng.standard_normal(real.shape), -1, 1).astype(np.float32)
    brain = real > -0.5
    host, dev = fidelity(sample, real, brain, BrainSSIM(real.shape)), fidelity(sample, real, brain, BrainSSIM(real.shape, "cpu"))
    assert BrainSSIM(real.shape).device is None
    for k in ("ssim", "psnr", "mae"):
        assert dev[k] == pytest.approx(host[k], rel=1e-6), k
    assert BrainMSSSIM(real.shape, "cpu")(sample, real, brain) == pytest.approx(
        BrainMSSSIM(real.shape)(sample, real, brain), rel=1e-6)


def test_gpu_benchmark_smoke_writes_which_device_made_it(tmp_path):
    """benchmarks/gpu_bench.py's table and device labels (the phases themselves: `GPU_SMOKE=1
    benchmarks/gpu.sh`, ~80 s, not run by the suite)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    results = {"machine": {"device": "cpu"}, "grid": [32] * 3, "precision": "fp32", "smoke": True,
               "measurement": "CPU SMOKE RUN of the plumbing: NOT a GPU measurement",
               "phases": {"eager": {"step_s": 1.0, "step_times_s": [1.0], "warmup_s": [2.0], "samples_per_s": 2.0,
                                    "peak_memory_mb": 100.0, "setting": "micro-batch 1 x accumulate 2, fp32",
                                    "elapsed_s": 3.0},
                          "exactness": {"fp32": {"steps": 2, "rel_diff_2x1_vs_1x2": 2e-7, "rel_diff_control_2x1_vs_1x1": 0.6,
                                                 "tolerance": 1e-3, "met": True, "tf32": "off"},
                                        "bf16": {"skipped": "measured on CUDA only"}, "elapsed_s": 5.0},
                          "compiled": {"error": "RuntimeError: boom", "elapsed_s": 1.0}}}
    text = gpu_bench.table(results)
    assert "NOT a GPU measurement" in text.splitlines()[0]
    assert "| step time, eager" in text and "met" in text and "compiled: failed" in text
    out = tmp_path / "results-gpu-smoke.json"
    gpu_bench.write(results, out)
    assert gpu_bench.main(["--table", "--out", str(out)]) == 0
    assert (tmp_path / "RESULTS-gpu-smoke.md").read_text().startswith("voxdiff on cpu")
