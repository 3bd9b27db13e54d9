"""Tables from results.json: the console summary, RESULTS.md, and the eager-vs-compiled table of gpu.sh.

    python benchmarks/report.py benchmarks/results.json            # print the summary
    python benchmarks/report.py --md benchmarks/results.json       # regenerate RESULTS.md next to it
    python benchmarks/report.py --compare eager.json compiled.json # one table, a column per file
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ORDER = ("memory", "accumulation", "data", "tracking", "gns", "gns_probe", "sampling", "growth", "medddpm", "speed", "phema",
         "advise", "conv_batch1", "study_step", "segmenter")
GPU_NOTE = ("`benchmarks/gpu.sh` measures voxdiff on CUDA at med-ddpm's size (params-gpu.yaml: 128^3, 64 base channels, "
            "batch 1, bf16 autocast) in one short slot: eager and `torch.compile` step time, memory, accumulation "
            "exactness, overheads, a loss curve (benchmarks/results-gpu.json). It has not been run: the machine that "
            "produced these results has no GPU.")


def fmt(v, unit: str | None = None) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if unit == "x":
        return f"{v:.3f}×" if abs(v) < 10 else f"{v:.1f}×"  # 3 decimals: 0.997 must not print as 1.00
    if unit == "%":
        return f"{v:.2f} %"
    if unit == "":
        return f"{v:+.3f}"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in v.items())
    return str(v)


def verdict(g: dict) -> str:
    return {True: "met", False: "MISSED", None: "info"}[g["met"]]


def summary(results: dict) -> list[dict]:
    """One line per goal of every benchmark, in the issue's order (a failed benchmark gives one error line)."""
    out = []
    for i, name in enumerate(ORDER, 1):
        b = results["benchmarks"].get(name)
        if b is None:
            continue
        if "error" in b:
            out.append({"n": i, "bench": name, "name": "(failed)", "value": "–", "goal": "", "verdict": "ERROR",
                        "why": b["error"]})
        for g in b.get("goals", []):
            out.append({"n": i, "bench": name, "name": g["name"], "value": fmt(g["value"], g["unit"]),
                        "goal": g["goal"], "verdict": verdict(g), "why": g["why"]})
    return out


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def md_table(rows: list[list[str]]) -> str:
    head, *body = rows
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body])


def console(results: dict) -> str:
    rows = [["#", "benchmark", "figure", "measured", "goal", "verdict"]]
    rows += [[str(s["n"]), s["bench"], s["name"], s["value"], s["goal"], s["verdict"]] for s in summary(results)]
    m = results["machine"]
    return (f"{text_table(rows)}\n\n{results['profile']} run, {results['elapsed_s'] / 60:.1f} min on {m['cpu']} "
            f"({m['cores_logical']} cores), torch {m['torch']}, device {m['device']}")


def detail_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return md_table([keys] + [[fmt(r.get(k)) for k in keys] for r in rows])


def _elsewhere(update: dict, machine: dict) -> str:
    """Where an --only rerun ran on another machine than the full run: which, and its configuration."""
    other = update.get("machine")
    if not other or all(other.get(k) == machine.get(k) for k in ("cpu", "cores_logical", "device", "native_bf16")):
        return ""
    bf16 = {True: ", native bf16", False: ", no native bf16"}.get(other.get("native_bf16"), "")
    return (f" on another machine ({other['cpu']}, {other['cores_logical']} cores{bf16}; "
            f"{update.get('config', '')}): its rows are not comparable with the others'")


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# voxdiff benchmarks", "",
             f"Generated from `{results.get('results_file', 'results.json')}` by `benchmarks/report.py` — do not edit; "
             "rerun `make bench` (or `.venv/bin/python benchmarks/run.py`).", "",
             f"- Run: {results['profile']} profile, {results['started']}, {results['elapsed_s'] / 60:.1f} min; "
             f"command `{results['command']}`",
             *(f"- Updated: {', '.join(u['benchmarks'])} rerun {u['started']} with `{u['command']}`" + _elsewhere(u, m)
               for u in results.get("updates", [])),
             f"- Machine: {m['cpu']}, {m['cores_logical']} logical / {m['cores_physical']} physical cores, "
             f"{m['memory_gb']} GB RAM, {m['os']}",
             f"- Software: Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), MONAI {m['monai']}, "
             f"MLflow {m['mlflow']}; device **{m['device']}**{' (' + m['gpu'] + ')' if m.get('gpu') else ''}",
             f"- Configuration: {results['config']}",
             "- Method: configurations compared run interleaved (A B, B A, ...) after dropped warm-up rounds; medians. "
             "The machine is shared, so the load average is recorded per benchmark.", "",
             "## Summary", ""]
    rows = [["#", "benchmark", "figure", "measured", "goal", "verdict"]]
    rows += [[str(s["n"]), s["bench"], s["name"], s["value"], s["goal"], s["verdict"]] for s in summary(results)]
    lines += [md_table(rows), ""]
    misses = [s for s in summary(results) if s["verdict"] in ("MISSED", "ERROR")]
    if misses:
        lines += ["## Misses, explained (from the measurements)", ""]
        lines += [f"- **{s['bench']}: {s['name']}** — {s['why']}" for s in misses]
        lines.append("")
    lines += ["## Details", ""]
    for i, name in enumerate(ORDER, 1):
        b = results["benchmarks"].get(name)
        if b is None:
            continue
        lines += [f"### {i}. {name}", "", b.get("title", ""), "",
                  f"{b.get('elapsed_s', 0):.0f} s; load average before/after {b.get('load_before')} / {b.get('load_after')}", ""]
        if "error" in b:
            lines += [f"Failed: `{b['error']}`", ""]
            continue
        lines += [detail_table(b["rows"]), ""]
        if b.get("efficiency"):
            lines += ["Efficiency of the bare network (forward+backward) against the matmul peak:", "",
                      detail_table(b["efficiency"]), ""]
        if b.get("fill"):
            lines += ["Single-batch throughput by micro-batch (does b fill the device?):", "", detail_table(b["fill"]), ""]
        notes = list(b.get("notes", [])) + [f"{g['name']}: {g['why']}" for g in b["goals"] if g["met"] is None and g["why"]]
        lines += [f"- {n}" for n in notes] + [""]
    lines += ["## GPU", "", GPU_NOTE if m["device"] == "cpu" else "Measured on the GPU above.", ""]
    return "\n".join(lines)


def compare(paths: list[Path], labels: list[str]) -> str:
    """One row per goal line, one measured column per results file (gpu.sh: eager vs compiled)."""
    runs = [summary(json.loads(p.read_text())) for p in paths]
    keys = list(dict.fromkeys((s["bench"], s["name"]) for run in runs for s in run))
    rows = [["benchmark", "figure", *labels, "goal"]]
    for bench, name in keys:
        cells = [next((f"{s['value']} {s['verdict']}" for s in run if (s["bench"], s["name"]) == (bench, name)), "–")
                 for run in runs]
        goal = next(s["goal"] for run in runs for s in run if (s["bench"], s["name"]) == (bench, name))
        rows.append([bench, name, *cells, goal])
    return text_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--md", action="store_true", help="write RESULTS.md next to the results file")
    ap.add_argument("--compare", action="store_true", help="one table with a column per results file")
    ap.add_argument("--labels", nargs="*", help="column names for --compare")
    a = ap.parse_args()
    if a.compare:
        print(compare(a.results, a.labels or [p.stem for p in a.results]))
        return
    results = json.loads(a.results[0].read_text())
    if a.md:
        write_markdown(results, a.results[0])
    print(console(results))


def write_markdown(results: dict, results_path: Path) -> Path:
    name = "RESULTS.md" if results_path.name == "results.json" else results_path.stem.replace("results", "RESULTS") + ".md"
    out = results_path.with_name(name)
    out.write_text(markdown({**results, "results_file": results_path.name}))
    return out


if __name__ == "__main__":
    main()
