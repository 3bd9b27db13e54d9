"""voxdiff at med-ddpm's size on one GPU, sized for a short slot (run by benchmarks/gpu.sh).

    benchmarks/gpu.sh                                   # CUDA, 128^3, bf16 -> benchmarks/results-gpu.json + table
    GPU_SMOKE=1 taskset -c 1 benchmarks/gpu.sh          # CPU smoke of the plumbing at 32^3 (not a measurement)
    .venv/bin/python benchmarks/gpu_bench.py --phases eager,memory --out /tmp/r.json [--smoke] [--set k=v]
    .venv/bin/python benchmarks/gpu_bench.py --table --out benchmarks/results-gpu.json

Phases (each writes the results file when it ends, so a run cut short keeps what finished):
  eager      training step time at params-gpu.yaml's setting (micro-batch 1 x accumulate 2, bf16 autocast,
             post-hoc EMA profiles and the accumulation noise-scale probe on, as trained): median of timed steps
             after warm-up steps, samples/s, peak CUDA memory
  memory     peak memory of a training step at micro-batch 1 and 2 (accumulate 1)
  exactness  2 x 1 against 1 x 2 on CUDA, same seed and samples, in fp32 (train.tf32 false) and in bf16:
             |w_2x1 - w_1x2| / |w_2x1 - w_0| after a few Adam steps (relative to the distance travelled), with
             the control 1 x 1 (another effective batch) that the tolerance must separate
  probe      the accumulation probe's cost per step (GradProbe on against off, interleaved) and the noise-scale
             probe's cost per single-sample gradient, scaled to params-gpu.yaml's probe and budget
  phema      post-hoc EMA: the profiles' update per step, one snapshot write, the reconstruction per snapshot,
             each scaled to params-gpu.yaml's 20 snapshots per profile and budget
  curve      training loss over 200 steps (fewer when the time limit nears), val loss before and after
  compiled   the same step under torch.compile: the first step (the compile) apart, then the median

Data: a synthetic cache (smooth tissue blobs, 4 classes, 6 subjects) at the grid being measured, made once
under benchmarks/.scratch/: timing and memory do not depend on the anatomy, and the built-in MNI152 data would
take minutes to synthesise and preprocess at 1.5 mm.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from harness import with_overrides

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRATCH = HERE / ".scratch"
PHASES = ("eager", "memory", "exactness", "probe", "phema", "curve", "compiled")

# Sizes: the real slot, and the CPU smoke (everything shrunk: 32^3, narrow channels, a few steps).
FULL = dict(shape=128, warmup=3, timed=10, exact_steps=5, curve_steps=200, probe_rounds=4, compile_warmup=2)
SMOKE = dict(shape=32, warmup=1, timed=2, exact_steps=2, curve_steps=6, probe_rounds=1, compile_warmup=1)
SMOKE_MODEL = {"model.channels": [8, 8, 16, 16, 32], "model.norm_num_groups": 4, "model.num_head_channels": 8}
# Tolerances of the exactness phase, relative to the distance the weights travelled. Set without a GPU at
# hand (CPU fp32: tests/test_trainer.py holds 2x2 = 1x4 = 4x1 to 1e-5 of the weights' norm): fp32 without
# TF32 only reorders sums; bf16 autocast rounds each activation to 8 bits, and batch-1 and batch-2 kernels
# may round differently. Each must also be at most CONTROL_SHARE of the control's difference.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}
CONTROL_SHARE = 0.1


# --- set-up ---------------------------------------------------------------------------------------
def synth_cache(root: Path, shape: int, n_train: int = 4, n_val: int = 2, classes: int = 4) -> Path:
    """data/processed in cache.py's format: smooth blobs, intensity by class, a little noise."""
    from scipy.ndimage import gaussian_filter, zoom

    from voxdiff.data.cache import FORMAT_VERSION

    out = root / "data" / "processed"
    if (out / "manifest.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n, grid = n_train + n_val, (shape,) * 3
    images = np.lib.format.open_memmap(out / "images.npy", "w+", np.float32, (n, *grid))
    labels = np.lib.format.open_memmap(out / "labels.npy", "w+", np.uint8, (n, *grid))
    low = min(shape, 32)  # smooth fields drawn at 32^3 and interpolated up: seconds, not a minute, at 128^3
    s = low / 16

    def smooth(sigma: float) -> np.ndarray:
        f = gaussian_filter(rng.standard_normal((low,) * 3).astype(np.float32), sigma)
        return zoom(f, shape / low, order=1) if low != shape else f

    for i in range(n):
        blob = smooth(3 * s)
        inside = blob > np.quantile(blob, 0.4)  # ~60 % "brain", like a head in its grid
        field = smooth(2 * s)
        tissue = 1 + np.digitize(field, np.quantile(field, [1 / 3, 2 / 3])).astype(np.uint8)
        lab = np.where(inside, tissue, 0).astype(np.uint8)
        labels[i] = lab
        means = np.array([-1.0, -0.4, 0.2, 0.7], np.float32)
        images[i] = np.clip(means[lab] + 0.05 * rng.standard_normal(grid).astype(np.float32), -1, 1)
    images.flush(), labels.flush()
    manifest = {"version": FORMAT_VERSION, "shape": list(grid), "spacing": [1.5] * 3, "label_values": list(range(classes)),
                "fingerprint": f"gpu-bench-synthetic-{shape}", "source": "synthetic",
                "subjects": [{"id": f"sub-{i:03d}", "index": i, "split": "train" if i < n_train else "val",
                              "affine": np.diag([1.5, 1.5, 1.5, 1.0]).tolist()} for i in range(n)]}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


class Bench:
    def __init__(self, args):
        from voxdiff.data.cache import open_cache
        from voxdiff.runtime.distributed import configure_backends, init_runtime

        self.smoke, self.size = args.smoke, SMOKE if args.smoke else FULL
        raw = yaml.safe_load((REPO / "params-gpu.yaml").read_text())
        overrides = {"preprocess.shape": [self.size["shape"]] * 3, "data.label_values": [0, 1, 2, 3],
                     "train.device": args.device, "train.precision": args.precision,
                     "train.max_steps": 10**6, "train.max_samples": 0,  # every window full; no budget effects
                     "train.gns_buckets_every_samples": 0}          # the bucket probe is measured apart
        if self.smoke:
            overrides.update(SMOKE_MODEL)
        overrides.update({k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)})
        self.raw = with_overrides(raw, overrides)
        self.preset = yaml.safe_load((REPO / "params-gpu.yaml").read_text())  # the budget the shares refer to
        self.root = SCRATCH / f"gpu-bench-{self.size['shape']}"
        self.cache = open_cache(synth_cache(self.root, self.size["shape"]))
        self.rt = init_runtime(args.device, args.precision)
        self.device = self.rt.device
        configure_backends(self.device, tf32=self.raw["train"]["tf32"], deterministic=self.raw["train"]["deterministic"])
        self.compile_backend = args.compile_backend

    def params(self, overrides: dict | None = None):
        from voxdiff.params import validate

        return validate(with_overrides(self.raw, overrides or {}))

    def trainer(self, overrides: dict | None = None, rt=None):
        from voxdiff.training.trainer import Trainer

        return Trainer(self.params(overrides), self.root, rt or self.rt, self.cache)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mb(self) -> float:
        from voxdiff.runtime.distributed import peak_memory_mb

        return peak_memory_mb(self.device)

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def budget_steps(self) -> int:
        t = self.preset["train"]
        return math.ceil(t["max_samples"] / (t["batch_size"] * t["accumulate_every"])) if t["max_samples"] else t["max_steps"]


# --- phases ---------------------------------------------------------------------------------------
def step_times(b: Bench, tr, warmup: int, timed: int) -> tuple[list[float], list[float]]:
    warm = [b.timed(tr.train_step) for _ in range(warmup)]
    return warm, [b.timed(tr.train_step) for _ in range(timed)]


def phase_eager(b: Bench) -> dict:
    tr = b.trainer()
    b.reset_peak()
    warm, times = step_times(b, tr, b.size["warmup"], b.size["timed"])
    eff = tr.budget.effective_batch
    out = {"step_s": statistics.median(times), "step_times_s": times, "warmup_s": warm,
           "samples_per_s": eff / statistics.median(times), "peak_memory_mb": b.peak_mb(),
           "setting": f"micro-batch {tr.budget.micro_batch} x accumulate {tr.budget.accumulate_every}, {b.rt.precision}"}
    del tr
    b.release()
    return out


def phase_memory(b: Bench) -> dict:
    rows = {}
    for micro in (1, 2):
        b.release()
        b.reset_peak()
        try:
            tr = b.trainer({"train.batch_size": micro, "train.accumulate_every": 1})
            for _ in range(2):
                tr.train_step()
            b.sync()
            rows[f"micro_batch_{micro}"] = {"peak_memory_mb": b.peak_mb(), "oom": False}
            del tr
        except torch.OutOfMemoryError:
            rows[f"micro_batch_{micro}"] = {"peak_memory_mb": None, "oom": True}
        b.release()
    if b.device.type == "cuda":
        rows["device_memory_mb"] = torch.cuda.get_device_properties(b.device).total_memory / 2**20
    return rows


def _weights(tr) -> dict:
    return {k: v.detach().double().clone() for k, v in tr.net.state_dict().items() if v.is_floating_point()}


def _distance(a: dict, c: dict) -> float:
    return math.sqrt(sum(float((a[k] - c[k]).square().sum()) for k in a))


def phase_exactness(b: Bench) -> dict:
    """2 x 1 against 1 x 2 (and the control 1 x 1) from the same initial weights over the same samples."""
    from voxdiff.runtime.distributed import Runtime, configure_backends

    out = {}
    steps = b.size["exact_steps"]
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        if b.device.type == "cpu" and precision == "bf16":
            # On the reference CPU, oneDNN's bf16 kernels gave NaN gradients for this 5-level network at 32^3
            # (the demo's 3 levels train fine): bf16's exactness is a CUDA measurement.
            out[precision] = {"skipped": "measured on CUDA only"}
            continue
        configure_backends(b.device, tf32=False if precision == "fp32" else b.raw["train"]["tf32"],
                           deterministic=b.raw["train"]["deterministic"])
        rt = Runtime(b.device, 0, 1, dtype, use_scaler=False)
        runs = {}
        for name, micro, k in (("2x1", 2, 1), ("1x2", 1, 2), ("1x1", 1, 1)):
            tr = b.trainer({"train.batch_size": micro, "train.accumulate_every": k, "train.grad_clip": 0.0,
                            "train.precision": precision, "train.phema_sigma_rels": []}, rt=rt)
            w0 = _weights(tr)
            losses = [tr.train_step()["train_loss"] for _ in range(steps)]
            runs[name] = (w0, _weights(tr), losses)
            del tr
            b.release()
        w0, ref, ref_losses = runs["2x1"]
        travelled = _distance(ref, w0)
        diff = _distance(ref, runs["1x2"][1]) / travelled
        control = _distance(ref, runs["1x1"][1]) / travelled
        tol = TOLERANCE[precision]
        out[precision] = {
            "steps": steps, "rel_diff_2x1_vs_1x2": diff, "rel_diff_control_2x1_vs_1x1": control,
            "tolerance": tol, "max_loss_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(ref_losses, runs["1x2"][2])),
            "same_initial_weights": _distance(w0, runs["1x2"][0]) == 0.0,
            "met": bool(diff <= tol and diff <= CONTROL_SHARE * control),
            "tf32": "off" if precision == "fp32" else ("on" if b.raw["train"]["tf32"] else "off")}
    configure_backends(b.device, tf32=b.raw["train"]["tf32"], deterministic=b.raw["train"]["deterministic"])
    return out


def phase_probe(b: Bench) -> dict:
    """The accumulation probe (GradProbe, every full window) as a share of the step, interleaved on one
    trainer; the bucket probe per single-sample gradient, scaled to params-gpu.yaml's counts and cadence."""
    tr = b.trainer({"train.phema_sigma_rels": []})
    reason = tr.gns_reason
    for _ in range(b.size["warmup"]):
        tr.train_step()
    on, off = [], []
    for r in range(b.size["probe_rounds"] * 2):
        for with_probe in ((True, False) if r % 2 == 0 else (False, True)):
            tr.gns_reason = reason if with_probe else "off for the measurement"
            (on if with_probe else off).append(b.timed(tr.train_step))
    tr.gns_reason = reason
    t = b.preset["train"]
    small = {"gns_buckets": 2, "gns_bucket_samples": 3, "gns_probe_samples": 4}  # 2 x (2 x 3 + 4) = 20 gradients
    del tr
    b.release()
    tr = b.trainer({"train.phema_sigma_rels": [], **{f"train.{k}": v for k, v in small.items()}})
    tr.train_step()
    b.reset_peak()
    base = torch.cuda.memory_allocated(b.device) / 2**20 if b.device.type == "cuda" else None
    seconds = b.timed(tr.bucket_noise_scale)
    gradients = 2 * (small["gns_buckets"] * small["gns_bucket_samples"] + small["gns_probe_samples"])
    preset_gradients = 2 * (t["gns_buckets"] * t["gns_bucket_samples"] + t["gns_probe_samples"])
    probes = math.ceil(t["max_samples"] / t["gns_buckets_every_samples"]) if t["gns_buckets_every_samples"] else 0
    per_gradient = seconds / gradients
    step_on = statistics.median(on)
    out = {"step_with_grad_probe_s": step_on, "step_without_s": statistics.median(off),
           "grad_probe_share_of_step": step_on / statistics.median(off) - 1,
           "bucket_probe_seconds_per_gradient": per_gradient, "preset_probe_gradients": preset_gradients,
           "preset_probe_s": per_gradient * preset_gradients, "preset_probes_per_run": probes,
           "preset_probe_share_of_training": probes * per_gradient * preset_gradients / (b.budget_steps() * step_on)}
    if base is not None:
        out["probe_peak_extra_mb"] = torch.cuda.max_memory_allocated(b.device) / 2**20 - base
        out["weights_fp32_mb"] = sum(p.numel() for p in tr.net.parameters()) * 4 / 2**20  # one gradient copy
    del tr
    b.release()
    return out


def phase_phema(b: Bench) -> dict:
    """Post-hoc EMA's parts, each scaled to params-gpu.yaml's run."""
    tr = b.trainer()
    for _ in range(b.size["warmup"]):
        tr.train_step()
    tracker = tr.phema
    tracker.folder = b.root / "phema-bench"
    for old in tracker.folder.glob("*.pt") if tracker.folder.is_dir() else ():
        old.unlink()
    updates = [b.timed(tracker.update) for _ in range(b.size["timed"])]
    step = statistics.median([b.timed(tr.train_step) for _ in range(b.size["timed"])])
    writes = []
    for _ in range(2):
        tr.train_step()
        writes.append(b.timed(tracker.snapshot))
    files = len(tracker.snapshots())
    recon = b.timed(lambda: tracker.reconstruct(tuple(b.preset["train"]["phema_eval_sigma_rels"])))
    t = b.preset["train"]
    snapshots, profiles = t["phema_snapshots"], len(t["phema_sigma_rels"])
    steps = b.budget_steps()
    out = {"update_s": statistics.median(updates), "step_s": step, "update_share_of_step": statistics.median(updates) / step,
           "snapshot_write_s": statistics.median(writes), "reconstruct_s_per_file": recon / files,
           "preset_snapshot_files": snapshots * profiles,
           "preset_snapshots_s": snapshots * statistics.median(writes),
           "preset_reconstruct_s": recon / files * snapshots * profiles,
           "snapshot_bytes_each": sum(f.stat().st_size for f in tracker.snapshots()) // max(files, 1)}
    total = steps * step
    out["preset_share_of_training"] = (steps * out["update_s"] + out["preset_snapshots_s"] + out["preset_reconstruct_s"]) / total
    for f in tracker.snapshots():
        f.unlink(missing_ok=True)
    del tr
    b.release()
    return out


def phase_curve(b: Bench, deadline: float) -> dict:
    tr = b.trainer({"train.phema_sigma_rels": []})
    val0 = tr.validation_loss(tr.net)
    losses, t0 = [], time.perf_counter()
    for i in range(b.size["curve_steps"]):
        losses.append(tr.train_step()["train_loss"])
        left = deadline - time.monotonic()
        per = (time.perf_counter() - t0) / (i + 1)
        if left < 3 * per + 15:  # room for the validation and the write
            break
    val1 = tr.validation_loss(tr.net)
    n = len(losses)
    w = max(1, min(20, n // 4))
    out = {"steps": n, "asked_steps": b.size["curve_steps"], "train_loss": losses, "val_loss_start": val0,
           "val_loss_end": val1, "first_mean": float(np.mean(losses[:w])), "last_mean": float(np.mean(losses[-w:])),
           "seconds": time.perf_counter() - t0}
    out["falls"] = out["last_mean"] < out["first_mean"]
    del tr
    b.release()
    return out


def phase_compiled(b: Bench) -> dict:
    import functools

    backend = b.compile_backend
    real = torch.compile
    if backend != "inductor":
        torch.compile = functools.partial(real, backend=backend)
    try:
        tr = b.trainer({"train.compile": True})
        b.reset_peak()
        first = b.timed(tr.train_step)
        warm, times = step_times(b, tr, b.size["compile_warmup"], b.size["timed"])
    finally:
        torch.compile = real
    step = statistics.median(times)
    out = {"backend": backend, "first_step_s": first, "compile_s": max(0.0, first - step), "step_s": step,
           "step_times_s": times, "warmup_s": warm, "peak_memory_mb": b.peak_mb(),
           "samples_per_s": tr.budget.effective_batch / step}
    del tr
    b.release()
    return out


# --- results and table ----------------------------------------------------------------------------
def machine(b: Bench) -> dict:
    import monai

    out = {"device": str(b.device), "torch": torch.__version__, "monai": monai.__version__,
           "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if b.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(b.device)
    return out


def load(out: Path) -> dict:
    return json.loads(out.read_text()) if out.is_file() else {}


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float) + "\n")
    tmp.replace(out)


def f(v, digits: int = 3, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return (f"{v:.{digits}g}" if isinstance(v, float) else str(v)) + unit


def table(results: dict) -> str:
    m, p = results.get("machine", {}), results.get("phases", {})
    who = m.get("gpu") or m.get("device", "?")
    head = (f"voxdiff on {who} ({m.get('device', '?')}), grid {results.get('grid')}, {results.get('precision')}: "
            f"{results.get('measurement', '')}")
    rows = [("measurement", "value", "note")]

    def add(name, value, note=""):
        rows.append((name, value, note))

    if "eager" in p and "error" not in p["eager"]:
        e = p["eager"]
        add("step time, eager", f(e["step_s"], unit=" s"), f"{e['setting']}; {f(e['samples_per_s'])} samples/s")
        add("peak memory, training setting", f(e["peak_memory_mb"], 4, " MB"))
    if "compiled" in p and "error" not in p["compiled"]:
        c = p["compiled"]
        speed = p.get("eager", {}).get("step_s")
        add("step time, torch.compile", f(c["step_s"], unit=" s"),
            f"backend {c['backend']}" + (f"; {f(speed / c['step_s'])}x eager" if speed else ""))
        add("compile (first step less a step)", f(c["compile_s"], unit=" s"), f"first step {f(c['first_step_s'], unit=' s')}")
    if "memory" in p and "error" not in p["memory"]:
        for k in ("micro_batch_1", "micro_batch_2"):
            r = p["memory"].get(k, {})
            add(f"peak memory, {k.replace('_', ' ')}", "OOM" if r.get("oom") else f(r.get("peak_memory_mb"), 4, " MB"),
                f"of {f(p['memory'].get('device_memory_mb'), 4, ' MB')}" if p["memory"].get("device_memory_mb") else "")
    if "exactness" in p and "error" not in p["exactness"]:
        for prec, r in p["exactness"].items():
            if not isinstance(r, dict):
                continue  # elapsed_s
            if "skipped" in r:
                add(f"2x1 vs 1x2, {prec}", "skipped", r["skipped"])
                continue
            add(f"2x1 vs 1x2, {prec} (tf32 {r['tf32']})", f(r["rel_diff_2x1_vs_1x2"]),
                f"tolerance {r['tolerance']:g} of the update; control 1x1 {f(r['rel_diff_control_2x1_vs_1x1'])}; "
                f"{'met' if r['met'] else 'MISSED'}")
    if "probe" in p and "error" not in p["probe"]:
        r = p["probe"]
        add("accumulation probe (GradProbe)", f(100 * r["grad_probe_share_of_step"], 2, " %"), "of a training step")
        add("noise-scale probe", f(r["preset_probe_s"], unit=" s"),
            f"{r['preset_probe_gradients']} gradients x {f(r['bucket_probe_seconds_per_gradient'], unit=' s')}; "
            f"{r['preset_probes_per_run']} a run = {f(100 * r['preset_probe_share_of_training'], 2, ' %')} of training"
            + (f"; peak +{f(r['probe_peak_extra_mb'], 4)} MB (one gradient: {f(r['weights_fp32_mb'], 4)} MB)"
               if "probe_peak_extra_mb" in r else ""))
    if "phema" in p and "error" not in p["phema"]:
        r = p["phema"]
        add("post-hoc EMA update", f(100 * r["update_share_of_step"], 2, " %"), "of a training step")
        add("post-hoc EMA snapshot", f(r["snapshot_write_s"], unit=" s"),
            f"{f(r['snapshot_bytes_each'] / 1e6, 3)} MB each; reconstruction {f(r['preset_reconstruct_s'], unit=' s')} "
            f"for {r['preset_snapshot_files']} files")
        add("post-hoc EMA, whole run", f(100 * r["preset_share_of_training"], 2, " %"), "of params-gpu.yaml's training")
    if "curve" in p and "error" not in p["curve"]:
        r = p["curve"]
        add(f"loss curve, {r['steps']} steps", f"{f(r['first_mean'])} -> {f(r['last_mean'])}",
            f"val {f(r['val_loss_start'])} -> {f(r['val_loss_end'])}; {'falls' if r['falls'] else 'DOES NOT FALL'}")
    for name, r in p.items():
        if "error" in r:
            add(f"{name}: failed", "–", r["error"])
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [head, ""] + ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(3, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    timing = ", ".join(f"{k} {v.get('elapsed_s', 0):.0f} s" for k, v in p.items())
    lines += ["", f"(phases: {timing})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default=",".join(PHASES[:-1]), help=f"comma-separated: {','.join(PHASES)}")
    ap.add_argument("--out", type=Path, default=HERE / "results-gpu.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="bf16", help="train.precision for every phase but exactness (both)")
    ap.add_argument("--smoke", action="store_true", default=os.environ.get("GPU_SMOKE") == "1",
                    help="shrink everything (32^3, narrow channels, a few steps): plumbing, not a measurement")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled phase (the smoke uses eager: no code generation)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop the loss curve early to end by then")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a params-gpu.yaml key")
    ap.add_argument("--table", action="store_true", help="print the table of --out and write RESULTS-gpu*.md beside it")
    a = ap.parse_args(argv)
    if a.table:
        results = load(a.out)
        if not results:
            print(f"{a.out}: no results", file=sys.stderr)
            return 1
        text = table(results)
        (a.out.parent / (a.out.stem.replace("results", "RESULTS") + ".md")).write_text(text + "\n")
        print(text)
        return 0
    deadline = time.monotonic() + a.budget_s
    names = [n.strip() for n in a.phases.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        sys.exit(f"unknown phase {unknown[0]!r}; choose from {', '.join(PHASES)}")
    os.environ.setdefault("TQDM_DISABLE", "1")
    b = Bench(a)
    results = load(a.out)
    if results.get("machine", {}).get("device") != str(b.device) or results.get("smoke") != b.smoke:
        results = {}  # another device's or size's results are not merged with these
    results.update({"started": results.get("started") or datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(b), "smoke": b.smoke, "grid": [b.size["shape"]] * 3, "precision": b.rt.precision,
                    "measurement": ("CPU SMOKE RUN of the plumbing (GPU_SMOKE=1: 32^3, narrow channels, a few steps): "
                                    "NOT a GPU measurement") if b.smoke or b.device.type != "cuda"
                    else f"measured on {torch.cuda.get_device_name(b.device)}",
                    "params": "params-gpu.yaml" + (" with GPU_SMOKE's shrinking" if b.smoke else "") +
                              (f" and {' '.join(a.set)}" if a.set else ""),
                    "tolerances": {"exactness": TOLERANCE, "control_share": CONTROL_SHARE}})
    results.setdefault("phases", {})
    for name in names:
        print(f"[gpu-bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            entry = phase_curve(b, deadline) if name == "curve" else globals()[f"phase_{name}"](b)
        except Exception as e:  # an OOM or a compile failure must not lose the other phases
            import traceback

            traceback.print_exc()
            entry = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            b.release()
        entry["elapsed_s"] = time.time() - t0
        results["phases"][name] = entry
        write(results, a.out)
        print(f"[gpu-bench] {name}: {entry['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
