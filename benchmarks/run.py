"""voxdiff benchmarks (`make bench`): side-by-side measurements, each reported as ratios.

    .venv/bin/python benchmarks/run.py                  # full run (< 15 min on 2 cores) -> results.json, RESULTS.md
    .venv/bin/python benchmarks/run.py --quick          # smoke run (< 2 min) -> .scratch/results-quick.json
    .venv/bin/python benchmarks/run.py --only memory,data
    benchmarks/gpu.sh                                   # CUDA at med-ddpm's size, eager and torch.compile

Data: the built-in MNI152 pseudo-subjects are prepared and preprocessed once into benchmarks/.scratch/
(kept between runs). Nothing under the repository's data/, models/ or mlflow.db is read or written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # prepare/preprocess progress bars would drown the report
logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store set-up lines, likewise
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

import harness  # noqa: E402
import report  # noqa: E402

PROFILES = {
    # rounds: interleaved rounds per comparison, after `warmup` rounds that are dropped
    "full": dict(rounds=6, warmup=2, memory_ks=[1, 2, 4, 8], memory_steps=2, accumulation_pairs=[[1, 2], [1, 4], [2, 2], [2, 4]],
                 data_rounds=30, data_steps=4, sampling_timesteps=None, ddim_steps=50, sampling_subjects=2,
                 train_samples=256, growth_sizes=[32, 48, 64], growth_steps=2, growth_rounds=3),
    "quick": dict(rounds=2, warmup=1, memory_ks=[1, 2], memory_steps=1, accumulation_pairs=[[1, 2], [2, 2]],
                  data_rounds=6, data_steps=2, sampling_timesteps=20, ddim_steps=4, sampling_subjects=1,
                  train_samples=16, growth_sizes=[32, 48], growth_steps=1, growth_rounds=1),
    # CUDA at 128^3 (gpu.sh): sized for about 5 minutes on one large GPU; the model is barely trained.
    "gpu": dict(rounds=3, warmup=1, memory_ks=[1, 2], memory_steps=2, accumulation_pairs=[[1, 2], [2, 2]],
                data_rounds=10, data_steps=3, sampling_timesteps=None, ddim_steps=50, sampling_subjects=1,
                train_samples=16, growth_sizes=[64, 128], growth_steps=2, growth_rounds=2),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer configurations and rounds (< 2 min)")
    ap.add_argument("--gpu", action="store_true", help="GPU profile (used by gpu.sh): CUDA, params-gpu.yaml")
    ap.add_argument("--only", default="", help=f"comma-separated benchmarks: {','.join(report.ORDER)}")
    ap.add_argument("--params", type=Path, help="params file (default params.yaml; params-gpu.yaml with --gpu)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params key (YAML value), e.g. --set data.subjects=6")
    ap.add_argument("--device", help="cpu | cuda | auto (default cpu; cuda with --gpu)")
    ap.add_argument("--precision", default="auto", help="auto (bf16 on CUDA and on CPUs with native bf16, else fp32) | fp32 | bf16 | fp16")
    ap.add_argument("--compile", action="store_true", help="torch.compile the networks being trained and sampled")
    ap.add_argument("--out", type=Path, help="results file (default results.json; .scratch/results-<profile>.json "
                                             "for --quick/--gpu); RESULTS*.md is written next to it")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one fresh-process measurement
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        harness.worker_main(json.loads(a.worker))
        return 0
    profile = "gpu" if a.gpu else "quick" if a.quick else "full"
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(report.ORDER)
    unknown = [n for n in names if n not in report.ORDER]
    if unknown:
        sys.exit(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(report.ORDER)}")
    params_path = a.params or harness.REPO / ("params-gpu.yaml" if a.gpu else "params.yaml")
    raw = harness.with_overrides(yaml.safe_load(params_path.read_text()),
                                 {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)})
    out = a.out or (harness.HERE / "results.json" if profile == "full" else harness.SCRATCH / f"results-{profile}.json")
    harness.SCRATCH.mkdir(exist_ok=True)

    started = time.time()
    print(f"[bench] {profile} run: {', '.join(names)}; preparing data in {harness.SCRATCH} ...", file=sys.stderr, flush=True)
    ctx = harness.Ctx(raw, a.device or ("cuda" if a.gpu else "cpu"), a.precision, a.compile, PROFILES[profile])
    results = {"profile": profile, "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": harness.machine(ctx.device),
               "config": config_text(ctx, params_path, a), "settings": PROFILES[profile], "benchmarks": {}}
    previous = json.loads(out.read_text()) if out.is_file() and a.only else {}
    merged = previous.get("profile") == profile and previous.get("machine", {}).get("device") == str(ctx.device)
    if merged:  # --only: update these benchmarks, keep the others and the header of the run that made them
        # the update names its own machine and configuration: the header's are those of the full run
        update = {k: results[k] for k in ("started", "command", "machine", "config")} | {"benchmarks": names}
        results.update({k: previous[k] for k in ("started", "command", "elapsed_s", "benchmarks", "machine", "config")
                        if k in previous}, updates=[*previous.get("updates", []), update])

    import suite

    for name in names:
        fn = suite.BENCHMARKS[name]
        print(f"[bench] {name}: {fn.__doc__.splitlines()[0]}", file=sys.stderr, flush=True)
        t0, load = time.time(), harness.load_average()
        try:
            entry = fn(ctx)
        except Exception as e:  # one failing benchmark (e.g. CUDA OOM) must not lose the others
            traceback.print_exc()
            entry = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        entry.update(title=" ".join(fn.__doc__.split()), elapsed_s=time.time() - t0, load_before=load,
                     load_after=harness.load_average())
        results["benchmarks"][name] = entry
        if "train_speedup_vs_fp32_baseline" in entry:  # the headline ratio, at the top for tools and the issue
            results["train_speedup_vs_fp32_baseline"] = entry["train_speedup_vs_fp32_baseline"]
        if not merged:
            results["elapsed_s"] = time.time() - started
        write(results, out)  # after every benchmark: an interrupted run keeps what it measured
        md = report.write_markdown(results, out)
        print(f"[bench] {name}: {entry['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    print(report.console(results))
    print(f"\n-> {out} and {md}")
    return 0


def config_text(ctx, params_path: Path, a) -> str:
    t, m = ctx.base.train, ctx.base.model
    return (f"{params_path.name}{' ' + ' '.join(a.set) if a.set else ''}: grid {list(ctx.base.preprocess.shape)}, "
            f"channels {list(m.channels)}, micro-batch {t.batch_size} x accumulate {t.accumulate_every}, "
            f"precision {ctx.rt.precision}, torch.compile {'on' if a.compile else 'off'}, "
            f"{ctx.param_mb:.1f} MB of parameters")


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
