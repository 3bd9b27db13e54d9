"""The benchmarks of the issue, one function each: ctx -> {"goals": [...], "rows": [...], "notes": [...], ...}.

A goal is {"name", "value", "unit" ("x" ratio, "%" share), "goal" (text), "met" (bool or None for
informational lines), "why" (a measured explanation, shown when missed)}.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from advise_bench import advise
from harness import (SCRATCH, conv_path, data_root, environ, goal, info, med, run_worker, step_budget, stopwatch,
                     timed, with_overrides)
from medddpm import MedDDPMLoop, NiftiPairs, train_pairs


def worker_job(ctx, raw: dict, root: Path, overrides: dict, steps: int) -> dict:
    return {"raw": raw, "root": str(root), "overrides": overrides, "steps": steps, "device": str(ctx.device),
            "precision": ctx.base.train.precision, "compile": ctx.compile}


# --- 1 -------------------------------------------------------------------------------------------
def memory(ctx) -> dict:
    """Peak memory of micro-batch b x accumulate k against k = 1 and against one batch of k*b, each
    configuration in a fresh process (CPU: peak RSS, nothing subtracted; CUDA: max allocated)."""
    b, ks, steps = ctx.base.train.batch_size, ctx.profile["memory_ks"], ctx.profile["memory_steps"]
    jobs = [("accumulate", b, k) for k in ks] + [("one batch", b * k, 1) for k in ks if k > 1]
    rows = []
    for kind, micro, k in jobs:
        r = run_worker(worker_job(ctx, ctx.raw, ctx.root, step_budget(micro, k), steps))
        rows.append({"run": kind, "micro_batch": micro, "accumulate_every": k, "samples_per_step": micro * k,
                     "peak_mb": r["peak_mb"], "baseline_mb": r["baseline_mb"],
                     "growth_mb": r["peak_mb"] - r["baseline_mb"], "oom": r["oom"], "ru_maxrss_mb": r["ru_maxrss_mb"],
                     "first_step_s": r["step_s"][0] if r["step_s"] else None})
    ref = rows[0]
    for row in rows:
        row["vs_k1"] = row["peak_mb"] / ref["peak_mb"]
        row["growth_vs_k1"] = row["growth_mb"] / ref["growth_mb"] if ref["growth_mb"] > 0 else None
    acc = [r for r in rows if r["run"] == "accumulate"]
    worst = max(acc[1:], key=lambda r: r["vs_k1"], default=acc[0])
    big = [r for r in rows if r["run"] == "one batch"]
    why = (f"accumulate {worst['accumulate_every']} peaks at {worst['peak_mb']:.0f} MB against "
           f"{ref['peak_mb']:.0f} MB at k=1 (+{worst['peak_mb'] - ref['peak_mb']:.0f} MB; one fp32 copy of the parameters is "
           f"{ctx.param_mb:.0f} MB)")
    goals = [goal(f"peak memory, {b}x{worst['accumulate_every']} vs {b}x1 (worst k of {ks})", worst["vs_k1"], "<=", 1.15,
                  why=why)]
    for r in big:
        goals.append(info(f"peak memory, one batch {r['micro_batch']}x1 vs {b}x1", r["vs_k1"],
                          note=f"growth over the post-import baseline: {r['growth_vs_k1']:.2f}×"
                          if r["growth_vs_k1"] else ""))
    measure = ("peak RSS of a fresh process (VmHWM: its own ru_maxrss, see below)" if ctx.device.type == "cpu"
               else "torch.cuda.max_memory_allocated")
    return {"goals": goals, "rows": rows,
            "notes": [f"peak = {measure} after {steps} optimizer step(s); baseline = "
                      + ("RSS right after the imports" if ctx.device.type == "cpu" else "allocated after building the trainer")
                      + "; growth = peak - baseline."]
            + (["ru_maxrss itself is not used: Linux keeps it across execve, so a worker started from this "
                "(larger) process reports the parent's peak (ru_maxrss_mb in results.json shows it)."]
               if ctx.device.type == "cpu" else [])}


# --- 2 -------------------------------------------------------------------------------------------
def accumulation(ctx) -> dict:
    """samples/s of micro-batch b x accumulate k against one batch of k*b, interleaved in one process."""
    pairs = [tuple(p) for p in ctx.profile["accumulation_pairs"]]
    configs = sorted({*pairs, *((b * k, 1) for b, k in pairs), *((b, 1) for b, _ in pairs)})
    trainers = {c: ctx.trainer(*c) for c in configs}
    times = ctx.interleave({f"{b}x{k}": trainers[(b, k)].train_step for b, k in configs})
    sps = {(b, k): b * k / med(times[f"{b}x{k}"]) for b, k in configs}
    single = {b: s for (b, k), s in sps.items() if k == 1}
    best = max(single.values())
    fills = {b: s >= 0.9 * best for b, s in single.items()}  # within 10% of the best per-sample rate
    rows = [{"micro_batch": b, "accumulate_every": k, "samples_per_s": sps[(b, k)],
             "one_batch": b * k, "one_batch_samples_per_s": sps[(b * k, 1)], "ratio": sps[(b, k)] / sps[(b * k, 1)],
             "b_fills_device": fills[b]} for b, k in pairs]
    fill_rows = [{"micro_batch": b, "accumulate_every": 1, "samples_per_s": s, "vs_best": s / best} for b, s in single.items()]
    net, shape = trainers[configs[0]].net, ctx.cache.images.shape[1:]
    paths = {b: conv_path(net, b, shape, 1 + ctx.cache.num_classes, ctx.device) for b in sorted({b for b, _ in pairs})}

    def explain(r: dict) -> str:
        b, big, p = r["micro_batch"], r["one_batch"], paths[r["micro_batch"]]
        return (f"{b}x{r['accumulate_every']} runs {r['samples_per_s']:.2f} samples/s against {r['one_batch_samples_per_s']:.2f} "
                f"for one batch of {big}; one batch of {b} alone reaches {sps[(b, 1)] / best:.0%} of the best "
                f"single-batch rate; a forward at batch {b} runs "
                + " + ".join(f"{n} {kernel}" for kernel, n in p["kernels"].items())
                + (f" and a forward+backward page-faults {p['page_faults']} times" if "page_faults" in p else ""))

    filled = [r for r in rows if r["b_fills_device"]]
    judged = min(filled or [max(rows, key=lambda r: r["micro_batch"])], key=lambda r: r["ratio"])
    goals = [goal(f"accumulation vs one batch, {judged['micro_batch']}x{judged['accumulate_every']} vs "
                  f"{judged['one_batch']}x1" + (" (b fills the device)" if filled else " (largest b: none fills the device)"),
                  judged["ratio"], ">=", 0.95, why=explain(judged))]
    goals += [info(f"accumulation vs one batch, {r['micro_batch']}x{r['accumulate_every']} vs {r['one_batch']}x1"
                   + ("" if r["b_fills_device"] else " (b does not fill the device)"), r["ratio"], note=explain(r))
              for r in rows if r is not judged]
    return {"goals": goals, "rows": rows, "fill": fill_rows, "conv_path": {str(b): v for b, v in paths.items()},
            "notes": ["b fills the device when one batch of b reaches 90% of the best single-batch samples/s measured; "
                      "the goal is judged on the worst pair whose b fills it.",
                      "Why batch 1 is slow on the CPU: PyTorch (checked with 2.13) sends a batch-1 convolution to "
                      "slow_conv3d (im2col + GEMM, with large column buffers allocated, and page-faulted in, on every "
                      "call) unless N*C*D*H > 20480; batches > 1 always take mkldnn. At 32^3 most of the demo "
                      "network's convolutions fall under that threshold."]}


# --- 3 -------------------------------------------------------------------------------------------
def data(ctx) -> dict:
    """The preprocessed cache against a med-ddpm-style loader (decode + resize per access), and the
    share of a training step spent in the trainer's data path."""
    trainer = ctx.trainer()
    ds = NiftiPairs(train_pairs(ctx.cache, ctx.root), ctx.cache.images.shape[1:], ctx.cache.label_values)
    count = itertools.count()
    times = ctx.interleave({"cache": lambda: trainer.batch([next(count)]),
                            "nifti": lambda: ds[next(count) % len(ds)]}, rounds=ctx.profile["data_rounds"])
    cache_sps, nifti_sps = 1 / med(times["cache"]), 1 / med(times["nifti"])
    trainer.train_step()  # warm-up
    with stopwatch(trainer, "batch", ctx.device) as spent:
        steps = [timed(trainer.train_step, ctx.device) for _ in range(ctx.profile["data_steps"])]
    share = 100 * sum(spent) / sum(steps)
    return {"goals": [goal("cache vs med-ddpm-style NIfTI loader, samples/s", cache_sps / nifti_sps, ">=", 20,
                           why=f"cache {cache_sps:.0f} vs NIfTI {nifti_sps:.1f} samples/s"),
                      goal("training step spent waiting for data", share, "<", 2, unit="%",
                           why=f"Trainer.batch took {med(spent) * 1e3:.1f} ms per micro-batch")],
            "rows": [{"loader": "voxdiff cache (Trainer.batch: memmap + draws)", "ms_per_sample": med(times["cache"]) * 1e3,
                      "samples_per_s": cache_sps},
                     {"loader": "med-ddpm-style (nibabel decode + per-slice scale + resize)",
                      "ms_per_sample": med(times["nifti"]) * 1e3, "samples_per_s": nifti_sps},
                     {"loader": "share of a training step in Trainer.batch", "ms_per_sample": med(spent) * 1e3,
                      "step_s": med(steps), "share_pct": share}],
            "notes": ["Both read files already in the page cache (warm); a cold disk widens the gap."]}


# --- 4 -------------------------------------------------------------------------------------------
def tracking(ctx) -> dict:
    """Step time with MLflow logging through voxdiff's RunTracker (real SQLite store) against none."""
    from voxdiff.tracking.runs import RunTracker

    trainer, every = ctx.trainer(), ctx.base.train.checkpoint_every
    with tempfile.TemporaryDirectory(prefix="mlflow-", dir=SCRATCH) as tmp_dir, \
            environ(MLFLOW_TRACKING_URI=f"sqlite:///{Path(tmp_dir) / 'mlflow.db'}", DVC_EXP_NAME=None):
        tmp = Path(tmp_dir)
        t0 = time.perf_counter()
        tracker = RunTracker.start(trainer.p, tmp, resume_run_id="", tags={"voxdiff.kind": "benchmark"}, extra_params={})
        start_s = time.perf_counter() - t0
        history, logged = [], []

        def on():  # train.py logs at every checkpoint; here after every step: the worst case
            record = trainer.train_step()
            record["timestamp"] = time.time()
            history.append(record)
            logged.append(timed(lambda: tracker.log_history(history), ctx.device))

        times = ctx.interleave({"off": trainer.train_step, "on": on})
        # train.py's cadence: one call with checkpoint_every new steps (copies of the last record).
        batched = []
        for _ in range(3):
            history += [{**history[-1], "step": history[-1]["step"] + 1 + i} for i in range(every)]
            batched.append(timed(lambda: tracker.log_history(history), ctx.device))
        batched = med(batched)
        # MLflow system metrics: one sample (collect) and one publish per interval, in a background thread.
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=1, tracking_uri=tracker.uri)
        collect = [timed(monitor.collect_metrics, ctx.device) for _ in range(10)]
        publish = [timed(lambda i=i: monitor.publish_metrics({"cpu_utilization_percentage": 1.0}), ctx.device)
                   for i in range(5)]
        tracker.finish()
    step = med(times["off"])
    per_step_worst, per_step_real = 100 * med(logged[1:] or logged) / step, 100 * batched / every / step
    interval = ctx.base.mlflow.system_metrics_interval_s
    system_share = 100 * (med(collect) + med(publish)) / interval
    return {"goals": [goal(f"MLflow logging as train.py does it (every {every} steps)", per_step_real, "<", 1, unit="%",
                           why=f"one log_history of {every} steps took {batched * 1e3:.0f} ms; a step {step:.2f} s"),
                      info("MLflow logging after every step (worst case)", per_step_worst, unit="%",
                           note=f"log_history of 1 step: {med(logged) * 1e3:.1f} ms"),
                      info("step time, logging on vs off (end to end, noisy)", med(times["on"]) / step),
                      goal(f"MLflow system metrics, one sample every {interval:g} s", system_share, "<", 1, unit="%",
                           why=f"collect {med(collect) * 1e3:.1f} ms + publish {med(publish) * 1e3:.1f} ms "
                               f"per {interval:g} s")],
            "rows": [{"what": "step, logging off", "ms": step * 1e3},
                     {"what": "step, logging after every step", "ms": med(times["on"]) * 1e3},
                     {"what": "log_history, 1 step", "ms": med(logged) * 1e3},
                     {"what": f"log_history, {every} steps (train.py's checkpoint cadence)", "ms": batched * 1e3},
                     {"what": "RunTracker.start (once per run: store, experiment, params)", "ms": start_s * 1e3},
                     {"what": "system metrics: collect one sample (CPU, memory, disk, network)", "ms": med(collect) * 1e3},
                     {"what": "system metrics: publish one sample to the store", "ms": med(publish) * 1e3}],
            "notes": ["The verdict uses the tracker's own time (measured around each call) over the step time: a "
                      "1% difference is below what end-to-end step times resolve on a shared machine.",
                      "System metrics run in a thread beside training: their share is the thread's work per "
                      "interval (collect + publish) over the interval, the time it can take from training."]}


# --- 5 -------------------------------------------------------------------------------------------
def gns(ctx) -> dict:
    """Step time with the gradient-noise-scale probe (GradProbe) on against off, same trainer."""
    from voxdiff.training.trainer import GradProbe

    trainer = ctx.trainer(k=max(2, ctx.base.train.accumulate_every))
    per_step: list[float] = []

    def run(on: bool):
        def step():
            trainer.gns_reason = None if on else "benchmark: probe off"  # the trainer's own switch
            n = len(spent)
            trainer.train_step()
            if on:
                per_step.append(sum(spent[n:]))
        return step

    with stopwatch(GradProbe, "record", ctx.device) as spent:
        times = ctx.interleave({"off": run(False), "on": run(True)})
    trainer.gns_reason = None
    step, probe = med(times["off"]), med(per_step[1:] or per_step)
    return {"goals": [goal("GradProbe time per step", 100 * probe / step, "<", 3, unit="%",
                           why=f"GradProbe.record took {probe * 1e3:.0f} ms per step of {step:.2f} s "
                               f"({trainer.budget.accumulate_every} micro-batches, {ctx.param_mb:.1f} MB of gradients)"),
                      info("step time, probe on vs off (end to end, noisy)", med(times["on"]) / step)],
            "rows": [{"what": "step, probe off", "ms": step * 1e3}, {"what": "step, probe on", "ms": med(times["on"]) * 1e3},
                     {"what": "GradProbe.record per step", "ms": probe * 1e3}],
            "notes": ["Verdict from the probe's own time (timed around GradProbe.record), as for tracking."]}


def gns_probe(ctx) -> dict:
    """The single-sample noise-scale probe (Trainer.bucket_noise_scale -> gns.probe_noise_scale): gradient
    copies it holds (live tensor bytes at every gradient it asks for, above what was alive at the first
    one of each group; on CUDA also the allocator's peak) and its time against the demo's training."""
    import gc

    from voxdiff.training import gns as gns_mod

    def live_bytes() -> int:
        import warnings

        storages = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated torch module attributes warns
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    st = obj.untyped_storage()
                    storages[(st.device.type, st.data_ptr())] = st.nbytes()
        return sum(storages.values())

    grad_bytes = sum(p.numel() * p.element_size() for p in ctx.trainer().net.parameters() if p.requires_grad)
    held: dict[int, list[int]] = {}  # marginal draw count -> live bytes above the baseline at each gradient request
    real = gns_mod.two_pass_estimate

    def counting(gradient, count, level):
        # baseline: what is alive at the group's first gradient request (the weights, this group's draws)
        rows, base = held.setdefault(marginal, []), []

        def wrapped(i):
            now = live_bytes()
            if not base:
                base.append(now)
            rows.append(now - base[0])
            return gradient(i)
        return real(wrapped, count, level)

    cuda_extra = None
    small = {"train.gns_buckets": 1, "train.gns_bucket_samples": 3}  # the held memory does not depend on counts
    for marginal in (3, 9):
        trainer = ctx.trainer(overrides={**small, "train.gns_probe_samples": marginal})
        gc.collect()
        gns_mod.two_pass_estimate = counting
        try:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
                start = torch.cuda.memory_allocated(ctx.device)
            trainer.bucket_noise_scale()
            if ctx.device.type == "cuda":
                probe_peak = torch.cuda.max_memory_allocated(ctx.device) - start
        finally:
            gns_mod.two_pass_estimate = real
        if ctx.device.type == "cuda" and cuda_extra is None:  # against one single-sample gradient, kept alive
            params = [q for q in trainer.net.parameters() if q.requires_grad]
            s, t, noise = trainer.val_set[0]
            torch.cuda.reset_peak_memory_stats(ctx.device)
            start = torch.cuda.memory_allocated(ctx.device)
            g = torch.autograd.grad(trainer.losses(trainer.net, *trainer.on_device([s], [t], [noise])).sum(), params)
            one_peak = torch.cuda.max_memory_allocated(ctx.device) - start
            del g
            cuda_extra = (probe_peak - one_peak) / grad_bytes
    copies = {n: max(rows) / grad_bytes for n, rows in held.items()}
    worst = max(copies.values())
    # Time: a probe is its 2 x draws single-sample gradients (the dot products are small beside them), so
    # time a small uninstrumented one and scale per gradient to the params' counts (a full one is minutes on a CPU).
    trainer = ctx.trainer(overrides={**small, "train.gns_probe_samples": 3})
    per_grad = med([timed(trainer.bucket_noise_scale, ctx.device) for _ in range(2)]) / (2 * (3 + 3))
    step_s = med([timed(trainer.train_step, ctx.device) for _ in range(3)][1:])
    t = ctx.base.train
    n_grad = 2 * (t.gns_buckets * t.gns_bucket_samples + t.gns_probe_samples)
    probe_s = per_grad * n_grad
    steps = max(t.max_samples / trainer.budget.effective_batch, 1)
    every = t.gns_buckets_every_samples  # each multiple crossed, and the end (once when it is a multiple)
    probes = (t.max_samples // every + (1 if t.max_samples % every else 0)) if every else 0
    old_copies = 5 * t.gns_bucket_samples  # list of N flat fp32 + float64 stack (2N) + its finite-row copy (2N)
    rows = [{"what": f"peak copies alive at a gradient request ({len(rs)} requests; marginal {n} draws, bucket 3)",
             "copies": copies[n]} for n, rs in held.items()]
    rows += [{"what": f"one gradient copy ({grad_bytes / 2**20:.1f} MB)", "MB": grad_bytes / 2**20},
             {"what": "one single-sample gradient inside the probe", "ms": per_grad * 1e3},
             {"what": f"probe at the params ({n_grad} single-sample gradients, scaled)", "ms": probe_s * 1e3},
             {"what": "training step", "ms": step_s * 1e3}]
    goals = [goal("gradient copies the probe holds (peak, incl. the one being computed)", worst + 1, "<=", 2.05,
                  why=f"{worst:.2f} copies alive when a gradient was requested, by draw count: {copies}"),
             info("probe time against the demo's training", 100 * probes * probe_s / (steps * step_s), unit="%",
                  note=f"{probes} probes of {probe_s:.1f} s ({n_grad} gradients of {per_grad * 1e3:.0f} ms) against "
                       f"{steps:.0f} steps of {step_s:.2f} s"),
             info("gradient copies before (Gram design, per bucket of gns_bucket_samples)", float(old_copies))]
    if cuda_extra is not None:
        goals.append(info("CUDA peak above one single-sample gradient, in gradient copies", cuda_extra))
    return {"goals": goals, "rows": rows,
            "notes": ["Copies = bytes of live tensor storages (gc scan) above those alive at the group's first gradient "
                      "request, in units of the trainable parameters' bytes, taken each time the probe asks for a "
                      "gradient: the running sum S (pass 1 and 2), nothing that grows with the draw count. Per-tensor "
                      "temporaries of the dot products are below one parameter tensor each and are not counted.",
                      f"Before: the Gram design held N flat fp32 gradients, their float64 stack and its finite-row "
                      f"copy: about 5 N copies (N = {t.gns_bucket_samples}: {old_copies}; N = 32: 160)."]}


# --- 6 -------------------------------------------------------------------------------------------
def sampling(ctx) -> dict:
    """DDIM (ddim_steps) against the full ancestral sampler: time per volume and SSIM to the real volume."""
    from voxdiff.pipeline import evaluate
    from voxdiff.diffusion import sampling as smp

    prof = ctx.profile
    overrides = {"diffusion.timesteps": prof["sampling_timesteps"]} if prof["sampling_timesteps"] else {}
    trainer = ctx.trainer(2, 1, overrides)  # micro-batch 2: the fast convolution path on the CPU
    train_s = timed(lambda: [trainer.train_step() for _ in range(prof["train_samples"] // 2)], ctx.device)
    val_loss = trainer.validation_loss()
    net = trainer.ema.module.eval()
    net = torch.compile(net) if ctx.compile else net
    cache, diff, K = ctx.cache, trainer.p.diffusion, ctx.base.evaluate.samples_per_condition
    ssim = evaluate.BrainSSIM(cache.images.shape[1:])
    # As evaluate runs them: DDIM samples the K volumes of a label map in one batch, the ancestral
    # sampler one volume at a time; "ddim x1" is DDIM at batch 1, like for like with ancestral.
    runs = [("ddim", K), ("ancestral", 1), ("ddim x1", 1)]
    rows = []
    for s, r in enumerate(cache.split_indices("val")[: prof["sampling_subjects"]]):
        label = np.asarray(cache.labels[r])
        real = np.asarray(cache.images[r], np.float32)
        for name, n in (runs if s % 2 == 0 else runs[::-1]):
            rec: list = []
            labels = torch.from_numpy(label.astype(np.int64))[None].expand(n, *label.shape)
            vols = smp.generate(net, diff, labels, cache.num_classes, prof["ddim_steps"], ctx.base.seed,
                                name.split()[0], progress=False, subject=s, record=rec)
            rows.append({"subject": cache.subjects[r]["id"], "sampler": name, "batch": n, "steps": rec[0]["steps"],
                         "s_per_volume": rec[0]["seconds"],
                         "peak_mb": rec[0]["peak_memory_mb"] if ctx.device.type == "cuda" else None,
                         "ssim": float(np.mean([evaluate.fidelity(v[0].numpy(), real, label > 0, ssim)["ssim"]
                                                for v in vols]))})
    by = {name: [r for r in rows if r["sampler"] == name] for name, _ in runs}
    sec = {k: med([r["s_per_volume"] for r in v]) for k, v in by.items()}
    ss = {k: float(np.mean([r["ssim"] for r in v])) for k, v in by.items()}
    n_ddim, n_anc = by["ddim"][0]["steps"], by["ancestral"][0]["steps"]
    per_step = {k: sec[k] / by[k][0]["steps"] * 1e3 for k in sec}
    why = (f"ms per step and volume: DDIM {per_step['ddim']:.0f} (batch {K}), DDIM {per_step['ddim x1']:.0f} "
           f"(batch 1), ancestral {per_step['ancestral']:.0f} (batch 1): one network evaluation per step each, so "
           f"at equal batch the speed-up is bounded by the step ratio {n_anc}/{n_ddim} = {n_anc / n_ddim:g}×")
    trained = prof["train_samples"] > 0
    goals = [goal(f"ancestral ({n_anc} steps) vs DDIM ({n_ddim} steps, {K} volumes per batch as evaluate), "
                  "time per volume", sec["ancestral"] / sec["ddim"], ">=", 5, why=why),
             info("same, DDIM at batch 1 (like for like)", sec["ancestral"] / sec["ddim x1"], note=why),
             goal("SSIM to the real volume, DDIM minus ancestral (no worse)", ss["ddim"] - ss["ancestral"], ">=", 0,
                  unit="", why=f"SSIM DDIM {ss['ddim']:.3f} ({len(by['ddim']) * K} volumes) vs ancestral "
                               f"{ss['ancestral']:.3f} ({len(by['ancestral'])} volumes)"
                               + ("" if trained else "; the model is untrained, so SSIM means nothing"))]
    return {"goals": goals, "rows": rows,
            "model": {"trained_samples": prof["train_samples"], "train_s": train_s, "ema_val_loss": val_loss,
                      "timesteps": diff.timesteps},
            "notes": [f"Model: voxdiff Trainer, micro-batch 2, {prof['train_samples']} samples ({train_s:.0f} s), "
                      f"EMA weights, validation loss {val_loss:.4f}" + ("" if trained else " (untrained)")
                      + (f"; quick run: diffusion.timesteps {diff.timesteps} and DDIM {n_ddim} steps keep the "
                         f"{n_anc // n_ddim}:1 step ratio" if prof["sampling_timesteps"] else ""),
                      "voxdiff.diffusion.sampling.generate as evaluate calls it (no autocast); SSIM: evaluate.fidelity."]}


# --- 7 -------------------------------------------------------------------------------------------
def growth(ctx) -> dict:
    """Time and peak memory per training sample at several grids (same field of view, demo network)."""
    from voxdiff.data.cache import open_cache

    b, cuda = ctx.base.train.batch_size, ctx.device.type == "cuda"
    n0, sp0 = ctx.base.preprocess.shape[0], ctx.base.preprocess.spacing[0]
    sizes = ctx.profile["growth_sizes"]
    grids = {n: {"preprocess.shape": [n] * 3, "preprocess.spacing": [sp0 * n0 / n] * 3} for n in sizes}
    roots = {n: data_root(with_overrides(ctx.raw, g)) for n, g in grids.items()}
    # Memory: a fresh process per grid. Time: all grids interleaved in this process.
    mem = {n: run_worker({**worker_job(ctx, with_overrides(ctx.raw, grids[n]), roots[n], step_budget(b, 1),
                                       ctx.profile["growth_steps"]), "conv_path": True}) for n in sizes}
    trainers = {n: ctx.trainer(b, 1, grids[n], open_cache(roots[n] / "data" / "processed"), roots[n]) for n in sizes}
    times = ctx.interleave({n: trainers[n].train_step for n in sizes}, rounds=ctx.profile["growth_rounds"])
    rows = []
    for n in sizes:
        r = mem[n]
        rows.append({"grid": f"{n}^3", "voxels": n**3, "micro_batch": b, "s_per_sample": med(times[n]) / b,
                     "peak_mb": r["peak_mb"], "growth_mb": r["peak_mb"] - r["baseline_mb"],
                     "growth_mb_per_sample": (r["peak_mb"] - r["baseline_mb"]) / b, "oom": r["oom"],
                     "page_faults_per_sample": None if cuda else med(r["page_faults"][1:] or r["page_faults"]) / b,
                     "conv_kernels": r.get("conv", {}).get("kernels")})
    first, last = rows[0], rows[-1]
    for row in rows:
        row["voxels_rel"] = row["voxels"] / first["voxels"]
        row["time_rel"] = row["s_per_sample"] / first["s_per_sample"]
        row["growth_rel"] = row["growth_mb"] / first["growth_mb"]
    return {"goals": [info(f"time per sample, {last['grid']} vs {first['grid']} ({last['voxels_rel']:.1f}× the voxels)",
                           last["time_rel"], note=f"{last['s_per_sample']:.2f} s/sample, peak {last['peak_mb']:.0f} MB"),
                      info(f"memory growth, {last['grid']} vs {first['grid']}", last["growth_rel"])],
            "rows": rows,
            "notes": [f"Micro-batch {b}, accumulate 1; spacing scaled so every grid covers the same field of view. "
                      "Time: median optimizer step, grids interleaved in one process. Memory: a fresh process per "
                      f"grid, {ctx.profile['growth_steps']} step(s)."]}


# --- 8 -------------------------------------------------------------------------------------------
def medddpm(ctx) -> dict:
    """voxdiff's Trainer against a med-ddpm-style step (decode per step, loss/k, EMA every 10 steps)."""
    from voxdiff.training.trainer import GradProbe

    trainer = ctx.trainer()
    ds = NiftiPairs(train_pairs(ctx.cache, ctx.root), ctx.cache.images.shape[1:], ctx.cache.label_values)
    base = MedDDPMLoop(trainer.p, ctx.rt, ds, ctx.compile)
    dev, k = ctx.device, trainer.budget.accumulate_every
    with stopwatch(NiftiPairs, "__getitem__", dev) as decode, stopwatch(trainer, "batch", dev) as batch, \
            stopwatch(trainer, "optimizer_step", dev) as opt, stopwatch(GradProbe, "record", dev) as probe:
        times = ctx.interleave({"voxdiff": trainer.train_step, "med-ddpm": base.train_step})
    ours, theirs = med(times["voxdiff"]), med(times["med-ddpm"])
    n = trainer.budget.effective_batch
    parts = {"decode": med(decode) * n, "batch": med(batch) * k, "optimizer_step": med(opt),
             "probe": med(probe) * k if probe else 0.0}
    why = (f"voxdiff {ours:.2f} s vs med-ddpm {theirs:.2f} s per step of {n} samples. Per step, voxdiff spends "
           f"{parts['batch'] * 1e3:.0f} ms in Trainer.batch, {parts['optimizer_step'] * 1e3:.0f} ms in optimizer_step "
           f"(clip, Adam, EMA every step) and {parts['probe'] * 1e3:.0f} ms in GradProbe; med-ddpm "
           f"{parts['decode'] * 1e3:.0f} ms decoding NIfTI; the rest is the same network's forward and backward")
    return {"goals": [goal("voxdiff Trainer vs med-ddpm-style step, samples/s", theirs / ours, ">=", 1.0, why=why),
                      info("same, if med-ddpm's DataLoader workers hid all decoding", (theirs - parts["decode"]) / ours,
                           note="upper bound for a machine with spare cores for the workers")],
            "rows": [{"loop": "voxdiff Trainer.train_step", "s_per_step": ours, "samples_per_s": n / ours,
                      "data_s": parts["batch"], "optimizer_step_s": parts["optimizer_step"], "grad_probe_s": parts["probe"]},
                     {"loop": "med-ddpm-style step", "s_per_step": theirs, "samples_per_s": n / theirs,
                      "data_s": parts["decode"]}],
            "notes": [f"Both: micro-batch {trainer.budget.micro_batch} x accumulate {k}, same network, seed, data and "
                      "precision. med-ddpm's DataLoader has num_workers=4; here 0, so its decoding stays in the step "
                      "(on 2 cores there is no spare core to hide it on).", why]}


# --- 9 -------------------------------------------------------------------------------------------
def _network_step(net, batch: int, shape, channels: int, device, dtype, channels_last: bool = False):
    """One forward+backward of the bare network (no optimizer, data or probe) for the efficiency rows."""
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    x = torch.randn(batch, channels, *shape, device=device).contiguous(memory_format=fmt)
    t = torch.zeros(batch, dtype=torch.long, device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = net(x, timesteps=t)
        out.float().abs().mean().backward()
        net.zero_grad(set_to_none=True)

    return step


def _matmul_peak(device, dtype, n: int = 2048) -> float:
    """GFLOP/s of a large square matmul: the attainable peak of this device in that precision."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = min(timed(lambda: a @ b, device) for _ in range(5))
    return 2 * n ** 3 / best / 1e9


def speed(ctx) -> dict:
    """Training samples/s of the demo configuration against the old path (fp32, micro-batch 2), interleaved
    in one process; micro-batch 1 in both precisions; achieved GFLOP/s against the device's matmul peak."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    from voxdiff.runtime.distributed import Runtime, auto_precision
    from voxdiff.diffusion.model import build_network

    t = ctx.base.train
    fp32 = Runtime(ctx.device, 0, 1, None, False)
    auto_dtype, why_auto = auto_precision(ctx.device)
    auto = Runtime(ctx.device, 0, 1, auto_dtype, auto_dtype is torch.float16)
    # The old demo path: fp32 at micro-batch 2 x accumulate 2 (what params.yaml shipped before bf16).
    old = (2, 2)
    new = (t.batch_size, t.accumulate_every)
    saved_rt = ctx.rt
    trainers = {}
    for name, (b, k), rt in (("old: fp32 2x2", old, fp32), (f"new: {auto.precision} {new[0]}x{new[1]}", new, auto),
                             ("fp32 1x4", (1, 4), fp32), (f"{auto.precision} 1x4", (1, 4), auto)):
        ctx.rt = rt
        trainers[name] = (ctx.trainer(b, k), b * k)
    ctx.rt = saved_rt
    times = ctx.interleave({name: tr.train_step for name, (tr, _) in trainers.items()})
    sps = {name: n / med(times[name]) for name, (_, n) in trainers.items()}
    names = list(trainers)
    ratio = sps[names[1]] / sps[names[0]]
    b1 = sps[names[3]] / sps[names[2]]

    # Efficiency: FLOPs of one sample's forward+backward (torch's flop counter), the bare network's
    # step time per precision, and the matmul peak of the same precision.
    shape, channels = tuple(ctx.cache.images.shape[1:]), 1 + ctx.cache.num_classes
    net = build_network(ctx.base.model, ctx.cache.num_classes).to(ctx.device)
    counter = FlopCounterMode(display=False)
    with counter:
        _network_step(net, 1, shape, channels, ctx.device, None)()
    gflop = counter.get_total_flops() / 1e9
    b = t.batch_size
    cases = {"fp32": (None, False), auto.precision: (auto_dtype, False)}
    if auto_dtype is not None and ctx.device.type == "cpu":
        cases[f"{auto.precision} + channels_last_3d"] = (auto_dtype, True)
    steps = {name: _network_step(copy.deepcopy(net).to(memory_format=torch.channels_last_3d) if cl else net,
                                 b, shape, channels, ctx.device, dtype, cl) for name, (dtype, cl) in cases.items()}
    net_times = ctx.interleave(steps)
    peaks = {"fp32": _matmul_peak(ctx.device, torch.float32)}
    if auto_dtype is not None:
        peaks[auto.precision] = _matmul_peak(ctx.device, auto_dtype)
    eff_rows = []
    for name in cases:
        achieved = gflop * b / med(net_times[name])
        peak = peaks[name.split(" ")[0]]
        eff_rows.append({"network step": name, "micro_batch": b, "gflop_per_sample": gflop,
                         "achieved_gflop_s": achieved, "matmul_peak_gflop_s": peak, "of_peak": achieved / peak})
    best = max(eff_rows, key=lambda r: r["achieved_gflop_s"])
    rows = [{"path": name, "micro_batch": trainers[name][0].budget.micro_batch,
             "accumulate_every": trainers[name][0].budget.accumulate_every, "samples_per_s": sps[name],
             "vs_old": sps[name] / sps[names[0]]} for name in names]
    return {"goals": [goal(f"demo training samples/s, {names[1]} vs {names[0]}", ratio, ">=", 3.0,
                           why=f"{sps[names[1]]:.2f} vs {sps[names[0]]:.2f} samples/s; the network's convolutions "
                               f"run at {best['of_peak']:.0%} of the {best['network step'].split(' ')[0]} matmul peak "
                               f"({best['achieved_gflop_s']:.0f} of {best['matmul_peak_gflop_s']:.0f} GFLOP/s), so "
                               "kernel speed alone cannot give 3x"),
                      info(f"micro-batch 1 x 4, {names[3].split(' ')[0]} vs fp32", b1,
                           note="bf16 sends batch-1 convolutions to oneDNN instead of the slow im2col path"),
                      info(f"efficiency: {best['network step']} network step, GFLOP/s of the matmul peak",
                           100 * best["of_peak"], unit="%",
                           note=f"{best['achieved_gflop_s']:.0f} of {best['matmul_peak_gflop_s']:.0f} GFLOP/s; "
                                f"{gflop:.1f} GFLOP per sample (forward+backward, torch.utils.flop_counter)")],
            "rows": rows, "efficiency": eff_rows, "train_speedup_vs_fp32_baseline": ratio,
            "notes": [f"precision auto = {auto.precision} here ({why_auto}).",
                      "Trainer rows: whole optimizer steps (data, forward, backward, probe, clip, Adam, EMA), "
                      "interleaved; efficiency rows: the bare network's forward+backward at the demo micro-batch.",
                      "torch.compile (inductor, CPU) is not in this table: on the reference machine it compiled "
                      "for 112 s and then ran 3 % faster than eager bf16, a loss within a 5-minute demo."]}


def conv_batch1(ctx) -> dict:
    """fp32 training at micro-batch 1 with batch-1 convolutions sent to oneDNN (diffusion/cpu_conv.py) against
    PyTorch's own pick (slow_conv3d), interleaved in one process; micro-batch 2 beside them for scale."""
    from voxdiff.diffusion.cpu_conv import BatchOneConv3d
    from voxdiff.runtime.distributed import Runtime

    if ctx.device.type != "cpu":
        return {"goals": [], "rows": [], "notes": ["CPU only: CUDA convolutions do not take this path."]}
    saved_rt, ctx.rt = ctx.rt, Runtime(ctx.device, 0, 1, None, False)  # fp32: the path autocast does not cover
    trainers = {"fp32 1x4, oneDNN at batch 1": (ctx.trainer(1, 4), 4), "fp32 1x4, PyTorch's pick": (ctx.trainer(1, 4), 4),
                "fp32 2x2": (ctx.trainer(2, 2), 4)}
    ctx.rt = saved_rt
    for m in trainers["fp32 1x4, PyTorch's pick"][0].net.modules():
        if type(m) is BatchOneConv3d:
            m.__class__ = torch.nn.Conv3d
    shape, channels = tuple(ctx.cache.images.shape[1:]), 1 + ctx.cache.num_classes
    kernels = {name: conv_path(tr.net, 1, shape, channels, ctx.device, faults=False)["kernels"]
               for name, (tr, _) in trainers.items()}
    times = ctx.interleave({name: tr.train_step for name, (tr, _) in trainers.items()})
    sps = {name: n / med(times[name]) for name, (_, n) in trainers.items()}
    fast, plain, two = (sps[n] for n in trainers)
    rows = [{"path": name, "samples_per_s": sps[name], "s_per_sample": 1 / sps[name], "vs_pytorch_pick": sps[name] / plain,
             "batch1_conv_kernels": ", ".join(f"{k} {v}" for k, v in kernels[name].items())} for name in trainers]
    return {"goals": [goal("fp32 micro-batch 1 samples/s, oneDNN at batch 1 vs PyTorch's pick", fast / plain, ">=", 2.0,
                           why=f"{fast:.2f} vs {plain:.2f} samples/s"),
                      goal("fp32 micro-batch 1 vs micro-batch 2, samples/s", fast / two, ">=", 0.9,
                           why=f"{fast:.2f} vs {two:.2f} samples/s: micro-batch 1 still costs more per sample")],
            "rows": rows,
            "notes": ["PyTorch sends an fp32 3D convolution to oneDNN only when batch > 1 or N*C*D*H > 20480 "
                      "(a heuristic written for 2D); below that it runs slow_conv3d, forward and backward. "
                      "Kernels counted on one batch-1 forward of the network."]}


def _channels_last(trainer) -> None:
    """The trainer's network and every input it sees in channels_last_3d (NDHWC): weights converted once, inputs
    by a forward pre-hook, so training, validation and the probe all take the NDHWC kernels."""
    fmt = torch.channels_last_3d
    trainer.net.to(memory_format=fmt)

    def to_ndhwc(module, args, kwargs):
        return tuple(a.contiguous(memory_format=fmt) if torch.is_tensor(a) and a.dim() == 5 else a
                     for a in args), kwargs

    trainer.net.register_forward_pre_hook(to_ndhwc, with_kwargs=True)


def study_step(ctx) -> dict:
    """The study's training step (med-ddpm's regime: epsilon, L1, no clipping, micro-batch 1 x 1) eager against
    torch.compile and channels_last_3d, interleaved in one process, in the precision this CPU resolves and in fp32;
    and whether each path's losses match eager's over the same steps (same init, data and draws)."""
    from voxdiff.runtime.distributed import Runtime, auto_precision

    regime = {"diffusion.prediction": "epsilon", "diffusion.loss": "l1", "train.grad_clip": 0.0,
              "train.gns_probe_samples": 0, "train.gns_buckets_every_samples": 0}
    auto_dtype, why_auto = auto_precision(ctx.device)
    runtimes = {"fp32": Runtime(ctx.device, 0, 1, None, False)}
    if auto_dtype is not None:
        runtimes[str(auto_dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")] = \
            Runtime(ctx.device, 0, 1, auto_dtype, auto_dtype is torch.float16)
    saved_rt = ctx.rt
    rows, goals, compile_s = [], [], {}
    steps = ctx.profile["rounds"] * 2
    for prec, rt in runtimes.items():
        ctx.rt = rt
        trainers = {}
        for path in ("eager", "channels_last_3d", "torch.compile"):
            tr = ctx.trainer(1, 1, regime)
            if path == "channels_last_3d":
                _channels_last(tr)
            elif path == "torch.compile":
                tr.model = torch.compile(tr.net)
                t0 = time.perf_counter()
                tr.train_step()  # the compile (and a first step): timed apart, then left out
                compile_s[prec] = time.perf_counter() - t0
            trainers[path] = tr
        # Losses over the same steps: every trainer starts from the same init (seeded) and sees the same draws.
        # The compiled one has taken one step already: bring the others level before comparing.
        for path in ("eager", "channels_last_3d"):
            trainers[path].train_step()
        losses = {p: [] for p in trainers}
        step_fns = {p: (lambda tr=tr, p=p: losses[p].append(tr.train_step()["train_loss"])) for p, tr in trainers.items()}
        times = ctx.interleave(step_fns, rounds=steps)
        n = min(len(v) for v in losses.values())
        eager_s = med(times["eager"])
        for path in trainers:
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[path][:n], losses["eager"][:n]))
            speed = eager_s / med(times[path])
            rows.append({"precision": prec, "path": path, "s_per_step": med(times[path]), "vs_eager": speed,
                         "max_rel_loss_diff_vs_eager": diff, "compile_s": compile_s.get(prec) if path == "torch.compile" else None,
                         "steps_compared": n})
            if path != "eager":
                goals.append(info(f"study step, {prec} {path} vs eager (micro-batch 1)", speed,
                                  note=f"adopted only at >= 1.2x with matching losses; max relative loss difference "
                                       f"{diff:.1e} over {n} steps" + (f"; compile {compile_s[prec]:.0f} s"
                                                                       if path == "torch.compile" else "")))
    ctx.rt = saved_rt
    return {"goals": goals, "rows": rows,
            "notes": [f"precision auto = {next(reversed(runtimes))} here ({why_auto}). Grid {list(ctx.base.preprocess.shape)}, "
                      f"network channels {list(ctx.base.model.channels)}, med-ddpm's regime (epsilon, L1, no clipping), "
                      "micro-batch 1 x accumulate 1, the probes off: the step the data-size arm repeats ~10^5 times.",
                      "Steps interleaved (A B C, C B A, ...); the losses of the first steps compared with eager's "
                      "(same init, data and draws), so a path that changed the maths would show here.",
                      "fp32 on a CPU without native bf16 (AVX2 only) is the other machine the study runs on: rerun "
                      "`benchmarks/run.py --only study_step` there to add its rows."]}


# --- 10 ------------------------------------------------------------------------------------------
def phema(ctx) -> dict:
    """Post-hoc EMA: the profile updates per step, a snapshot, the checkpoint's growth and the reconstruction at the end."""
    import io

    from voxdiff.training.posthoc_ema import ProfileTracker

    t = ctx.base.train
    with tempfile.TemporaryDirectory(prefix="phema-", dir=SCRATCH) as tmp:
        trainer, bare = ctx.trainer(root=Path(tmp)), ctx.trainer(overrides={"train.phema_sigma_rels": []})
        with stopwatch(ProfileTracker, "update", ctx.device) as spent:
            times = ctx.interleave({"off": bare.train_step, "on": trainer.train_step})
        snap = med([timed(trainer.phema.snapshot, ctx.device) for _ in range(3)])  # same step: same files
        snap_mb = sum(p.stat().st_size for p in trainer.phema.snapshots()) / 2**20

        def ckpt_mb(tr) -> float:
            buf = io.BytesIO()
            torch.save(tr.state(False, None), buf)
            return buf.tell() / 2**20

        with_mb, without_mb = ckpt_mb(trainer), ckpt_mb(bare)
        per_profile = t.phema_snapshots  # a demo run's worth: reconstruction reads them all (once)
        for _ in range(per_profile - 1):
            trainer.train_step()
            trainer.phema.snapshot()
        t0 = time.perf_counter()
        trainer.posthoc_val_losses()
        reconstruct_s = time.perf_counter() - t0
    step, update = med(times["off"]), med(spent[1:] or spent)
    steps_per_snapshot = t.max_samples / t.phema_snapshots / trainer.budget.effective_batch
    run_steps = t.max_samples / trainer.budget.effective_batch
    n_lengths = len(t.phema_eval_sigma_rels)
    return {"goals": [goal("profile updates per step", 100 * update / step, "<", 3, unit="%",
                           why=f"ProfileTracker.update took {update * 1e3:.1f} ms per step of {step:.2f} s "
                               f"({len(t.phema_sigma_rels)} profiles)"),
                      goal(f"snapshots ({t.phema_snapshots} per profile per run)",
                           100 * snap / (steps_per_snapshot * step), "<", 1, unit="%",
                           why=f"one snapshot took {snap * 1e3:.0f} ms, every {steps_per_snapshot:g} steps of {step:.2f} s"),
                      info(f"reconstruction + val loss at {n_lengths} lengths, against the demo's training",
                           100 * reconstruct_s / (run_steps * step), unit="%",
                           note=f"{reconstruct_s:.1f} s once at the end, against {run_steps:.0f} steps of {step:.2f} s"),
                      info("checkpoint size with the profiles vs without", with_mb / without_mb),
                      info("step time, post-hoc EMA on vs off (end to end, noisy)", med(times["on"]) / step)],
            "rows": [{"what": "step, post-hoc EMA off", "ms": step * 1e3},
                     {"what": "step, post-hoc EMA on", "ms": med(times["on"]) * 1e3},
                     {"what": f"ProfileTracker.update ({len(t.phema_sigma_rels)} profiles) per step", "ms": update * 1e3},
                     {"what": f"one snapshot ({len(t.phema_sigma_rels)} files, {snap_mb:.1f} MB)", "ms": snap * 1e3},
                     {"what": f"reconstruction + val loss at {n_lengths} lengths from {per_profile} snapshots per profile",
                      "ms": reconstruct_s * 1e3},
                     {"what": "checkpoint without post-hoc EMA", "MB": without_mb},
                     {"what": "checkpoint with its profiles", "MB": with_mb}],
            "notes": ["Verdicts from the tracker's own time (timed around ProfileTracker.update and snapshot), "
                      "as for tracking and the noise-scale probe; the reconstruction reads each (fp16) snapshot "
                      "once for all lengths."]}


# --- 15 ------------------------------------------------------------------------------------------
def segmenter(ctx) -> dict:
    """Segmentation Dice (evaluation/segmenter.py): training one segmenter, its Dice on the real validation volumes,
    and what the Dice metrics add to evaluate's time (the segmenters and the synthetic volumes they train on)."""
    from voxdiff.evaluation import segmenter as seg

    ev, cache = ctx.base.evaluate, ctx.cache
    spec = seg.spec_of(ctx.base, cache.num_classes)
    images, labels = cache.stack(cache.split_indices("train"))
    val_x, val_y = cache.stack(cache.split_indices("val"))
    rows = []
    for s in range(ev.segmenter_seeds):
        c0 = time.process_time()
        net, wall = seg.train_segmenter(images[:, 0], labels, spec, s, ctx.device)
        cpu = time.process_time() - c0
        d = seg.scores([net], val_x[:, 0], val_y, cache.num_classes)
        rows.append({"what": f"segmenter seed {s}: train", "s": wall, "cpu_s": cpu, "steps": spec.steps,
                     "dice_csf": float(d[0]), "dice_gm": float(d[1]), "dice_wm": float(d[2])})
    # The synthetic volumes train-on-synthetic samples: evaluate's DDIM on the demo network (its cost does not depend
    # on the weights), GEN_BATCH volumes per call on one CPU thread, as segmenter.synthesize runs them.
    steps = ev.tstr_sampling_steps or ev.sampling_steps
    net = ctx.trainer(2, 1).ema.module.eval()
    gen = seg.ddim_generator(net, ctx.base.diffusion, cache.num_classes, steps, ctx.base.seed)
    batch = min(seg.GEN_BATCH, len(labels) * max(1, ev.tstr_samples_per_map))
    maps = np.repeat(labels, max(1, ev.tstr_samples_per_map), axis=0)[:batch]
    c0, t0 = time.process_time(), time.perf_counter()
    with seg._one_thread(ctx.device):
        gen(maps, 0)
    gen_s, gen_cpu = (time.perf_counter() - t0) / batch, (time.process_time() - c0) / batch
    rows.append({"what": f"synthetic volume (DDIM {steps} steps, batch {batch})", "s": gen_s, "cpu_s": gen_cpu})
    train_s, train_cpu = med([r["s"] for r in rows[:-1]]), med([r["cpu_s"] for r in rows[:-1]])
    n_vol = len(labels) * ev.tstr_samples_per_map
    n_tstr = 2 * ev.segmenter_seeds if ev.tstr_samples_per_map else 0  # the synthetic and both arms
    first = ev.segmenter_seeds * train_s + n_tstr * train_s + n_vol * gen_s
    again = n_tstr * train_s + n_vol * gen_s
    first_cpu = (ev.segmenter_seeds + n_tstr) * train_cpu + n_vol * gen_cpu
    worst_gm, worst_wm = min(r["dice_gm"] for r in rows[:-1]), min(r["dice_wm"] for r in rows[:-1])
    why = "too few optimizer steps or too small a network for this grid: raise evaluate.segmenter_steps or _channels"
    return {"goals": [goal("real-trained segmenter, GM Dice on the real validation volumes (worst seed)", worst_gm,
                           ">=", 0.8, unit=None, why=why),
                      goal("real-trained segmenter, WM Dice on the real validation volumes (worst seed)", worst_wm,
                           ">=", 0.8, unit=None, why=why),
                      info("one segmenter's training (s)", train_s, unit="s",
                           note=f"{spec.steps} Adam steps of batch {spec.batch}, channels {list(spec.channels)}, "
                                + ("one CPU thread" if ctx.device.type == "cpu" else f"on {ctx.device}")),
                      info("Dice metrics' time in evaluate, first run (s)", first, unit="s",
                           note=f"{ev.segmenter_seeds} real-trained segmenters (then cached) + {n_tstr} trained on "
                                f"synthetic / both + {n_vol} synthetic volumes at {gen_s:.1f} s"),
                      info("Dice metrics' time in evaluate, real segmenters cached (s)", again, unit="s"),
                      info("Dice metrics' CPU time in evaluate, first run (s)", first_cpu, unit="s",
                           note="the process's CPU seconds for the same work: a segmenter trains on one thread, so on "
                                "idle cores its wall time is its CPU time; under a load the wall time above is longer")],
            "rows": rows,
            "notes": [f"Grid {list(ctx.base.preprocess.shape)}, {len(labels)} training and {len(val_y)} validation "
                      f"subjects; Dice per tissue of each seed's segmenter on the real validation volumes (MONAI "
                      f"DiceMetric). The time estimate = the median training time x the segmenters evaluate trains "
                      f"+ the synthetic volumes x the measured time per volume; evaluate's own sampling, floors and "
                      f"figures come on top (eval_seconds_per_volume)."]}


BENCHMARKS = {"memory": memory, "accumulation": accumulation, "data": data, "tracking": tracking, "gns": gns,
              "gns_probe": gns_probe,
              "sampling": sampling, "growth": growth, "medddpm": medddpm, "speed": speed,
              "phema": phema, "conv_batch1": conv_batch1, "study_step": study_step,
              "segmenter": segmenter,
              "advise": advise}  # benchmark 11, in its own file (advise_bench.py): voxdiff advise against the grid
