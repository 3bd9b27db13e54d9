"""voxdiff compare against a real SQLite MLflow store filled with synthetic training runs."""

import dataclasses
import math
import statistics
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from click.testing import CliRunner
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from voxdiff import params as params_mod
from voxdiff.report.compare import compare_command, compare_runs
from voxdiff.runtime.errors import VoxdiffError
from voxdiff.tracking.uri import resolve_tracking_uri

SAMPLES, VAL_EVERY_SAMPLES, MICRO = 256, 8, 1
# Val-loss floors per accumulate_every, one per seed (final = floor + 0.9 exp(-256 / 40k): +0.0015 at
# k=1, +0.037 at k=2). NOISY k=1 and k=2 finals overlap: means 0.115 and 0.117, spreads ~0.015.
CLEAR = {1: [0.100, 0.101, 0.102], 2: [0.110, 0.112, 0.111], 4: [0.200, 0.205, 0.210]}
NOISY = {1: [0.100, 0.130, 0.110], 2: [0.080, 0.090, 0.070], 4: [0.150]}
GNS_LAST = {2: [12.0, 13.0, 14.0], 4: [12.0, 13.0, 14.0]}  # by seed index


def val_curve(k: int, floor: float, tau: float = 40) -> list[tuple[int, float]]:
    """(optimizer step, val loss): decays per sample seen, slower for larger effective batch."""
    return [(s // (k * MICRO), floor + 0.9 * math.exp(-s / (tau * k)))
            for s in range(VAL_EVERY_SAMPLES, SAMPLES + 1, VAL_EVERY_SAMPLES)]


def log_training_run(client, exp_id, k, seed, floor=None, gns_last=None, finish=True, evals=None, buckets=None,
                     start_time=None, extra_params=None, tau=40):
    """A finished (or running) training run; `buckets` {"gns_t0": [early, middle, late], ...} logs the
    per-bucket noise scale at the end of each third of the budget."""
    tags = {"voxdiff.kind": "train", "voxdiff.dvc_exp_name": f"exp-k{k}-s{seed}", "voxdiff.device": "cpu"}
    rid = client.create_run(exp_id, start_time=start_time, tags=tags).info.run_id
    params = {"seed": seed, "train.accumulate_every": k, "train.batch_size": MICRO, "train.lr": 2e-4,
              "train.lr_scaling": "none", "train.max_samples": SAMPLES, "effective_batch_size": k * MICRO,
              "effective_lr": 2e-4, "world_size": 1, **(extra_params or {})}
    steps = SAMPLES // (k * MICRO)
    metrics = []
    for step in range(1, steps + 1):
        metrics += [Metric("samples_seen", step * k * MICRO, step, step),
                    Metric("wall_time", step * k * 0.5, step, step),
                    Metric("train_loss", 1.0 / step, step, step),
                    Metric("peak_memory_mb", 100.0 + k, step, step)]
        if gns_last is not None:
            metrics.append(Metric("gns", gns_last, step, step))
    for name, values in (buckets or {}).items():
        metrics += [Metric(name, v, 0, (i + 1) * steps // 3) for i, v in enumerate(values)]
    curve = val_curve(k, floor, tau) if floor is not None else []
    metrics += [Metric("val_loss", v, step, step) for step, v in curve]
    final = {"total_steps": steps, "total_samples": SAMPLES, "total_wall_time": steps * k * 0.5}
    if curve:
        final["final_val_loss"] = curve[-1][1]
    final.update(evals or {})
    metrics += [Metric(key, v, 0, steps) for key, v in final.items()]
    for i in range(0, len(metrics), 900):  # log_batch takes at most 1000 metrics
        client.log_batch(rid, metrics=metrics[i:i + 900],
                         params=[Param(key, str(v)) for key, v in params.items()] if i == 0 else [])
    if finish:
        client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exps = {name: client.create_experiment(name, artifact_location=(root / name).as_uri())
            for name in ("clear", "noisy", "empty")}
    ids = {}
    for name, floors in (("clear", CLEAR), ("noisy", NOISY)):
        for k, per_seed in floors.items():
            for seed, floor in enumerate(per_seed):
                gns = GNS_LAST[k][seed] if name == "clear" and k in GNS_LAST else None
                evals = {"eval_ssim": 0.5 + 0.1 * seed} if name == "clear" and k == 1 else None
                ids[(name, k, seed)] = log_training_run(client, exps[name], k, seed, floor, gns, evals=evals)
    for seed in range(2):  # a group whose runs never logged a validation loss
        ids[("clear", 8, seed)] = log_training_run(client, exps["clear"], 8, seed)
    ids["running"] = log_training_run(client, exps["clear"], 1, 9, 0.05, finish=False)
    return uri, client, ids


def table_row(report: str, key: str) -> list[str]:
    line = next(l for l in report.splitlines() if l.startswith(f"| train.accumulate_every={key} | {MICRO} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def expected_to_target(floors: dict[int, list[float]]):
    """Independent steps to reach the default target (highest of all runs' best val loss), linearly
    interpolated between the validations around the first crossing."""
    curves = {k: [val_curve(k, f) for f in fl] for k, fl in floors.items()}
    target = max(min(v for _, v in c) for cs in curves.values() for c in cs)

    def crossing(c):
        i = next(j for j, (_, v) in enumerate(c) if v <= target)
        if i == 0:
            return float(c[0][0])
        (s0, v0), (s1, v1) = c[i - 1], c[i]
        return s0 + (v0 - target) / (v0 - v1) * (s1 - s0)

    steps = {k: [crossing(c) for c in cs] for k, cs in curves.items()}
    return target, steps


def test_report_numbers_match_independent_computation(store, tmp_path):
    uri, _, _ = store
    result = compare_runs(uri, "clear", tmp_path / "report.md", log=False)
    report = result.report_path.read_text()
    target, steps = expected_to_target(CLEAR)
    assert result.target_val_loss == pytest.approx(target)
    assert [g.key for g in result.groups] == ["1", "2", "4", "8"]
    for k, floors in CLEAR.items():
        finals = [val_curve(k, f)[-1][1] for f in floors]
        row = table_row(report, str(k))
        # setting, micro-batch, k, effective batch, lr, seeds, final val loss, steps, samples, ...
        assert row[2:6] == [str(k), str(k * MICRO), "0.0002", "3"]
        assert row[6] == f"{statistics.mean(finals):.4g} ± {statistics.stdev(finals):.2g}"
        assert row[7] == f"{statistics.mean(steps[k]):.0f} ± {statistics.stdev(steps[k]):.0f}"
        samples = [s * k * MICRO for s in steps[k]]
        assert row[8] == f"{statistics.mean(samples):.0f} ± {statistics.stdev(samples):.0f}"
        group = next(g for g in result.groups if g.key == str(k))
        assert group.steps_to_target == pytest.approx(steps[k])
    assert "| train.accumulate_every=1 | 0.6 ± 0.1 |" in report  # eval_ssim of seeds 0.5, 0.6, 0.7


def test_noise_scale_implication(store, tmp_path):
    uri, _, _ = store
    result = compare_runs(uri, "clear", tmp_path / "report.md", log=False)
    assert result.b_noise == pytest.approx(13.0)
    assert result.balanced_accumulate_every == 16  # 13 / (1 x 1) -> nearest power of two
    report = result.report_path.read_text()
    assert "no small/big batch pair" in report  # the k=1 group
    assert "| 16 (k*) | 16 | 1.81 | 2.23 |" in report  # 1 + 13/16, 1 + 16/13


def test_missing_val_loss_and_unfinished_runs_are_reported_not_fatal(store, tmp_path):
    uri, _, ids = store
    result = compare_runs(uri, "clear", tmp_path / "report.md", log=False)
    report = result.report_path.read_text()
    missing = [m for m in result.messages if "train.accumulate_every=8" in m]
    assert len(missing) == 1 and "no val_loss logged" in missing[0] and missing[0] in report
    assert any("unfinished" in m and ids["running"][:8] in m for m in result.messages)
    assert ids["running"] not in report
    assert table_row(report, "8")[6] == "no val_loss"


def test_reading_separates_clear_differences_from_seed_noise(store, tmp_path):
    uri, _, _ = store
    clear = compare_runs(uri, "clear", tmp_path / "clear.md", log=False).report_path.read_text()
    line = next(l for l in clear.splitlines() if l.startswith("- train.accumulate_every=2: final val loss"))
    assert "clearly higher than train.accumulate_every=1" in line
    noisy = compare_runs(uri, "noisy", tmp_path / "noisy.md", log=False).report_path.read_text()
    line = next(l for l in noisy.splitlines() if l.startswith("- train.accumulate_every=2: final val loss"))
    assert "within seed noise" in line and "clearly" not in line
    line = next(l for l in noisy.splitlines() if l.startswith("- train.accumulate_every=4: final val loss"))
    assert "unreplicated" in line


def test_figures_are_valid_pngs(store, tmp_path):
    uri, _, _ = store
    result = compare_runs(uri, "clear", tmp_path / "out" / "report.md", log=False)
    names = {p.name for p in result.figure_paths}
    assert names == {f"report_{n}.png" for n in ("val_loss_vs_steps", "val_loss_vs_samples",
                                                 "val_loss_vs_wall_time", "gns_vs_samples")}
    report = result.report_path.read_text()
    for p in result.figure_paths:
        assert p.parent == result.report_path.parent and f"]({p.name})" in report
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(p).shape[0] > 300


def test_no_runs_is_a_one_line_error_naming_the_experiment(store, tmp_path):
    uri, _, _ = store
    for exp, filt in (("empty", None), ("missing-exp", None), ("clear", "params.seed = '42'")):
        with pytest.raises(VoxdiffError, match=exp) as err:
            compare_runs(uri, exp, tmp_path / "r.md", filter_string=filt, log=False)
        assert "\n" not in str(err.value)
    with pytest.raises(VoxdiffError, match="no MLflow database"):
        compare_runs(f"sqlite:///{tmp_path / 'nope.db'}", "clear", tmp_path / "r.md")
    assert not (tmp_path / "nope.db").exists() and not (tmp_path / "r.md").exists()


def test_compare_run_is_logged_with_report_and_figures(store, tmp_path):
    uri, client, ids = store
    result = compare_runs(uri, "noisy", tmp_path / "report.md", filter_string="params.seed = '0'")
    run = client.get_run(result.compare_run_id)
    assert run.data.tags["voxdiff.kind"] == "compare" and run.info.status == "FINISHED"
    assert run.data.params["group_by"] == "train.accumulate_every"
    assert run.data.params["filter"] == "params.seed = '0'"
    assert set(run.data.tags["voxdiff.compared_runs"].split(",")) == {ids[("noisy", k, 0)] for k in NOISY}
    logged = {a.path for a in client.list_artifacts(result.compare_run_id)}
    assert {"report.md", *(p.name for p in result.figure_paths)} <= logged
    # The compare run is not a training run: a later compare ignores it.
    again = compare_runs(uri, "noisy", tmp_path / "again.md", log=False)
    assert sum(len(g.run_ids) for g in again.groups) == 7


def test_cli_uses_params_experiment_and_env_tracking_uri(store, tmp_path, monkeypatch):
    uri, _, _ = store
    raw = params_mod.load(Path(__file__).parents[1] / "params.yaml").raw
    raw = {**raw, "mlflow": {**raw["mlflow"], "experiment": "clear", "tracking_uri": ""}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    res = CliRunner().invoke(compare_command, ["--out", "rep/compare.md", "--no-log"])
    assert res.exit_code == 0, res.output
    assert "train.accumulate_every" in res.stdout and "0.1025 ± 0.001" in res.stdout
    assert "no val_loss logged" in res.stderr
    assert (tmp_path / "rep" / "compare.md").is_file() and not (tmp_path / "mlflow.db").exists()


def test_dvc_exp_keeps_only_those_experiments_runs_from_mlflow_and_the_archive(store, tmp_path):
    """make sweep's report: --dvc-exp keeps the grid's runs (by tag voxdiff.dvc_exp_name) and leaves out the
    experiment's other runs; the same selection from the archive; a name with no finished run is one line."""
    from voxdiff.report.loading import open_client, write_archive

    uri, _, ids = store
    grid = [f"exp-k{k}-s{s}" for k in (1, 2) for s in (0, 1)]
    args = ["--experiment", "clear", "--tracking-uri", uri, "--no-log", "--out", str(tmp_path / "s.md")]
    res = CliRunner().invoke(compare_command, args + [a for name in grid for a in ("--dvc-exp", name)])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "s.md").read_text()
    assert "4 finished training run(s) in 2 group(s)" in report and "DVC experiments exp-k1-s0" in report
    runs = {key: rid for key, rid in ids.items() if isinstance(key, tuple) and key[0] == "clear"}
    kept = {rid for (_, k, s), rid in runs.items() if k in (1, 2) and s < 2}
    assert {r for r in kept if r in report} == kept
    left_out = [rid for (_, k, s), rid in runs.items() if k > 2 or s == 2]
    assert not any(r in report for r in left_out)
    # Negative control: without it, the same experiment gives every group.
    assert "in 4 group(s)" in compare_runs(uri, "clear", tmp_path / "all.md", log=False).report_path.read_text()
    write_archive(open_client(uri), "clear", None, uri, tmp_path / "runs")
    from_archive = compare_runs(None, None, tmp_path / "a.md", runs_dir=tmp_path / "runs", dvc_exps=tuple(grid))
    assert sorted(r for g in from_archive.groups for r in g.run_ids) == sorted(kept)
    from voxdiff.cli import main

    res = CliRunner().invoke(main, ["compare", *args, "--dvc-exp", "exp-k1-s0", "--dvc-exp", "nosuch-name"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = [l for l in res.output.splitlines() if "--dvc-exp" in l]
    assert "nosuch-name" in line and "exp-k1-s0" not in line


def test_resolve_tracking_uri_rule(tmp_path, monkeypatch):
    p = params_mod.load(Path(__file__).parents[1] / "params.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    blank = dataclasses.replace(p, mlflow=params_mod.Mlflow("voxdiff", "", True, 10.0))
    assert resolve_tracking_uri(blank, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "user"))
    assert resolve_tracking_uri(blank, tmp_path / "queue-tmp") == f"sqlite:///{tmp_path.resolve()}/user/mlflow.db"
    server = dataclasses.replace(p, mlflow=params_mod.Mlflow("voxdiff", "http://host:5000", True, 10.0))
    assert resolve_tracking_uri(server, tmp_path) == "http://host:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:1")
    assert resolve_tracking_uri(server, tmp_path) == "http://env:1"


def test_welch_and_holm_replace_two_standard_errors():
    """3 seeds a side, difference 0.2, spreads 0.1: the old 2 x pooled-SE rule (0.163) called this
    clearly different; Welch's t-test (df 4) gives p ~ 0.07, within seed noise."""
    from voxdiff.analysis.statistics import compare_means, holm

    kind, diff, p = compare_means([1.2, 1.3, 1.4], [1.0, 1.1, 1.2])
    assert kind == "tested" and diff == pytest.approx(0.2) and 0.05 < p < 0.1
    kind, _, p = compare_means([1.25, 1.35, 1.45], [1.0, 1.1, 1.2])
    assert p < 0.05
    assert compare_means([1.0], [1.0, 2.0])[0] == "unreplicated"
    assert holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert holm([0.5]) == [0.5]


def test_target_crossing_is_interpolated_between_validations():
    import numpy as np

    from voxdiff.report.loading import RunData

    r = RunData("r", {}, {}, {}, val_steps=np.array([1.0, 2.0, 4.0]), val_loss=np.array([1.0, 0.6, 0.2]),
                val_samples=np.array([8.0, 16.0, 32.0]), val_wall=np.array([1.0, 2.0, np.nan]),
                gns_samples=np.array([]), gns=np.array([]), peak_memory_mb=0.0)
    assert r.crossing(0.4, r.val_samples) == pytest.approx(24.0)  # halfway from 16 to 32, not 32
    assert r.crossing(0.4, r.val_steps) == pytest.approx(3.0)
    assert r.crossing(1.5, r.val_samples) == 8.0 and r.crossing(0.1, r.val_samples) is None
    assert math.isnan(r.crossing(0.4, r.val_wall))  # no wall time logged at the crossing: unknown


def test_phase_prediction_shows_the_median_beside_the_mean():
    """One run's near-zero |G|^2 estimate blows up its B_simple: the mean-based k* follows that outlier,
    the median beside it does not; the measured best setting comes from the val curves alone."""
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.rendering import phase_section

    def run(k, seed, t0_late):
        losses = np.array([0.9, 0.5, 0.3]) * k  # k = 1 is best at every phase
        return RunData(f"{k}-{seed}", {"train.batch_size": "2"}, {}, {"total_samples": 96.0},
                       val_steps=np.arange(3.0), val_loss=losses, val_samples=np.array([32.0, 64.0, 96.0]),
                       val_wall=np.full(3, np.nan), gns_samples=np.array([]), gns=np.array([]), peak_memory_mb=0.0,
                       bucket_gns={"gns_t0": (np.array([32.0, 64.0, 96.0]), np.array([0.5, 0.5, t0_late]))})

    by_key = {"1": [run(1, 0, 0.5), run(1, 1, 0.5)], "2": [run(2, 0, 0.5), run(2, 1, 250.0)]}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in phase_section(by_key, "k")
            if line.startswith("| early") or line.startswith("| late")}
    assert rows["early"][2:5] == ["0.5 / 0.5", "1 / 1", "1"]
    # late: mean (0.5 * 3 + 250) / 4 = 62.9 -> k* 32 at micro-batch 2; the median stays 0.5 -> k* 1
    assert rows["late"][2:5] == ["62.9 / 0.5", "32 / 1", "1"]


def test_sample_quality_cells_count_runs_beating_floors_and_collapse_constant_floors():
    from voxdiff.report.rendering import eval_cell

    assert eval_cell("eval_beats_floors", [1, 0, 1]) == "2/3"
    floor = 0.1 + 0.2  # the same floor in every run, up to float rounding in the mean
    assert eval_cell("eval_mae_floor_tissue_mean", [floor, 0.3, floor]) == "0.3"
    assert eval_cell("eval_ssim", [0.8, 0.9]) == "0.85 ± 0.071"
    assert eval_cell("eval_ssim", []) == "—"


# --- the run archive ------------------------------------------------------------------------------
FIXTURE = Path(__file__).parent / "fixtures" / "archive"


def test_export_writes_one_shareable_file_per_finished_run(store, tmp_path):
    import json

    from voxdiff.report.loading import open_client, write_archive

    uri, client, ids = store
    client.set_tag(ids[("noisy", 1, 0)], "mlflow.source.name", "/home/someone/voxdiff/stages/train.py")
    written = write_archive(open_client(uri), "noisy", None, uri, tmp_path / "runs")
    assert sorted(p.stem for p in written) == sorted(ids[("noisy", k, s)] for k in NOISY for s in range(len(NOISY[k])))
    record = json.loads((tmp_path / "runs" / f"{ids[('noisy', 1, 0)]}.json").read_text())
    assert record["params"]["train.accumulate_every"] == "1" and record["experiment"] == "noisy"
    assert "mlflow.source.name" not in record["tags"] and record["tags"]["voxdiff.kind"] == "train"
    rows = record["histories"]["val_loss"]
    assert rows[0] == [8, 8.0, 4.0, pytest.approx(val_curve(1, NOISY[1][0])[0][1])]  # [step, samples, wall, value]
    text = "".join(p.read_text() for p in written)
    assert "/home/" not in text and str(tmp_path) not in text


def test_report_from_the_archive_equals_the_report_from_mlflow(store, tmp_path):
    from voxdiff.report.loading import open_client, write_archive

    uri, _, _ = store
    write_archive(open_client(uri), "clear", None, uri, tmp_path / "runs")
    from_store = compare_runs(uri, "clear", tmp_path / "a" / "report.md", log=False).report_path.read_text()
    from_archive = compare_runs(None, None, tmp_path / "b" / "report.md", runs_dir=tmp_path / "runs",
                                root=tmp_path).report_path.read_text()
    # Only the source line differs, and the store's warning about its unfinished run (never exported).
    strip = lambda text: [l for l in text.splitlines()  # noqa: E731
                          if not l.startswith(("Source: ", "- left out 1 unfinished run"))]
    assert strip(from_store) == strip(from_archive)
    assert "Source: the run archive `runs`" in from_archive and "Source: MLflow store `sqlite:///" in from_store
    assert str(tmp_path) not in from_archive


def test_thin_histories_keeps_per_step_metrics_at_the_other_histories_steps_and_their_last():
    from voxdiff.report.loading import THINNED, thin_histories
    from voxdiff.tracking.runs import METRIC_KEYS

    row = lambda step, v=0.0: [step, 2.0 * step, 0.5 * step, v]  # noqa: E731
    per_step = lambda: [row(s, 1 / s) for s in range(1, 100)]  # noqa: E731  (99 steps: 99 is no anchor)
    histories = {"lr": per_step(), "train_loss": per_step(), "gns": per_step(),
                 "val_loss": [row(s) for s in range(10, 91, 10)],
                 "gns_marginal": [row(25), row(75)],
                 "system/cpu_utilization_percentage": [row(s) for s in range(0, 60)],
                 "final_val_loss": [row(0)]}
    thin = thin_histories(histories, max_rows=15)
    assert [r[0] for r in thin["lr"]] == [1, 10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 99]  # first and last too
    # Kept whole: the train loss (its means over stretches of single draws need every step), the noise
    # scale (plotted), the rest (logged at anchors anyway); system metrics' own steps are no anchors.
    for key in ("train_loss", "gns", "val_loss", "gns_marginal", "system/cpu_utilization_percentage"):
        assert thin[key] == histories[key]
    assert thin_histories(histories, max_rows=99) == histories  # negative control: no run long enough
    # Every per-step metric the trainer logs is either thinned or kept whole on purpose.
    from voxdiff.report.loading import KEPT_WHOLE
    assert set(THINNED) | set(KEPT_WHOLE) == set(METRIC_KEYS) - {"val_loss"}


def test_a_thinned_run_reads_the_same_as_the_full_one():
    """The figures compare reads from an archived run (RunData) are the same from the thinned record,
    on a run whose wall time grows irregularly, whose peak memory dips after a resume and whose probes
    sit between validations: interpolation at the validations and probes stays exact."""
    import numpy as np

    from voxdiff.report.loading import record_to_run, thin_histories

    rng = np.random.default_rng(0)
    steps = np.arange(1, 1001)
    wall = np.cumsum(rng.uniform(0.1, 2.0, len(steps)))
    rows = lambda values, at=steps: [[int(s), 2.0 * s, float(wall[s - 1]), float(v)] for s, v in zip(at, values)]  # noqa: E731
    memory = np.where(steps < 600, 900.0 + steps / 10, 800.0)  # a resume's process starts lower
    val_at, probe_at = steps[49::50], np.array([123, 456, 789])
    histories = {"samples_seen": rows(2.0 * steps), "wall_time": rows(wall), "lr": rows(np.full(1000, 1e-3)),
                 "peak_memory_mb": [[0, None, None, float(memory.max())]] + rows(memory),
                 "gns": rows(rng.uniform(1, 3, 1000)), "train_loss": rows(rng.uniform(0, 1, 1000)),
                 "val_loss": rows(np.exp(-val_at / 300), val_at),
                 **{k: rows(rng.uniform(0.1, 5, 3), probe_at) for k in ("gns_marginal", "gns_marginal_lo",
                                                                         "gns_marginal_hi", "gns_t0")}}
    record = {"run_id": "r", "params": {"effective_batch_size": "2"}, "tags": {}, "metrics": {},
              "histories": histories}
    thin = dict(record, histories=thin_histories(histories, max_rows=100))
    assert len(thin["histories"]["wall_time"]) == 1 + len(val_at) + len(probe_at) < 100  # the last step validated
    full, short = record_to_run(record), record_to_run(thin)
    for field in ("val_steps", "val_loss", "val_samples", "val_wall", "gns_samples", "gns", "peak_memory_mb"):
        assert np.array_equal(getattr(full, field), getattr(short, field)), field
    for a, b in zip(full.marginal_gns + full.bucket_gns["gns_t0"], short.marginal_gns + short.bucket_gns["gns_t0"]):
        assert np.array_equal(a, b, equal_nan=True)
    # Negative control: keeping the per-step metrics at every 100th step instead moves the wall time read
    # at the validations.
    coarse = {k: [r for r in v if r[0] % 100 == 0] if k in ("wall_time", "samples_seen") else v
              for k, v in histories.items()}
    assert not np.array_equal(record_to_run(dict(record, histories=coarse)).val_wall, full.val_wall)


def test_a_thinned_archive_rebuilds_the_same_report(store, tmp_path):
    """Export thins a long run's per-step metrics: the report from it is the report from the full export."""
    import json

    from voxdiff.report.loading import open_client, write_archive

    uri, _, _ = store
    full = write_archive(open_client(uri), "clear", None, uri, tmp_path / "full", max_rows=10_000)
    thin = write_archive(open_client(uri), "clear", None, uri, tmp_path / "thin", max_rows=64)
    rows = lambda paths, key: sum(len(json.loads(p.read_text())["histories"].get(key, [])) for p in paths)  # noqa: E731
    assert rows(thin, "wall_time") < 0.5 * rows(full, "wall_time")  # thinned to the validations
    assert rows(thin, "train_loss") == rows(full, "train_loss") and rows(thin, "val_loss") == rows(full, "val_loss")
    assert {json.loads(p.read_text())["thinned_above_rows"] for p in thin} == {64}
    reports = [compare_runs(None, None, tmp_path / name / "report.md", runs_dir=tmp_path / name,
                            root=tmp_path).report_path.read_text().replace(f"`{name}`", "`runs`")
               for name in ("full", "thin")]
    assert reports[0] == reports[1]


def test_committed_archive_fixture_rebuilds_its_report_byte_for_byte(tmp_path):
    """tests/fixtures/archive holds exported runs and the report made from them: the CLI, with no MLflow
    store anywhere, must rebuild it exactly (regenerate with tests/fixtures/make_archive.py)."""
    out = tmp_path / "report.md"
    result = CliRunner().invoke(compare_command, ["--runs", str(FIXTURE / "runs"), "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    expected = (FIXTURE / "report.md").read_text()
    rebuilt = out.read_text().replace(f"`{FIXTURE / 'runs'}`", "`tests/fixtures/archive/runs`")
    assert rebuilt == expected


def test_archive_filter_and_errors(tmp_path):
    from voxdiff.report.compare import parse_param_filter

    assert parse_param_filter("params.`train.lr_scaling` = 'none' and params.seed = '1'") == {
        "train.lr_scaling": "none", "seed": "1"}
    with pytest.raises(VoxdiffError, match="only params"):
        parse_param_filter("metrics.val_loss < 1")
    with pytest.raises(VoxdiffError, match="no archived runs"):
        compare_runs(None, None, tmp_path / "r.md", runs_dir=tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.json").write_text("{not json")
    with pytest.raises(VoxdiffError, match="x.json: not a readable run archive"):
        compare_runs(None, None, tmp_path / "r.md", runs_dir=tmp_path / "bad")


def test_post_hoc_ema_section_compares_settings_at_their_best_ema_length(tmp_path):
    """Runs that tracked post-hoc EMA profiles get a table of val loss per reconstructed length and a
    verdict at the best length; a run without profiles (older code) is left out of that table, and
    the phema params it lacks are not reported as a confounder (they do not change training)."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("phema", artifact_location=(tmp_path / "art").as_uri())
    best = {1: [0.090, 0.092], 4: [0.120, 0.121]}
    for k, per_seed in best.items():
        for seed, b in enumerate(per_seed):
            evals = {"phema_val_loss_sr050": b + 0.01, "phema_val_loss_sr100": b, "phema_best_val_loss": b,
                     "phema_best_sigma_rel": 0.10, "ema_sigma_rel": 0.06}
            rid = log_training_run(client, exp, k, seed, floor=0.1, evals=evals)
            client.log_param(rid, "train.phema_sigma_rels", "[0.05, 0.1]")
    log_training_run(client, exp, 1, 7, floor=0.1)  # an older run: no profiles, no phema params
    report = compare_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "phema", tmp_path / "r.md", log=False) \
        .report_path.read_text()
    assert "## Post-hoc EMA" in report
    row = next(line for line in report.splitlines() if line.startswith("| train.accumulate_every=1 | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    finals = [val_curve(1, 0.1)[-1][1]] * 2
    assert cells[2] == f"{statistics.mean(finals):.4g} ± 0"
    assert cells[3:] == ["0.060 ± 0.000", f"{statistics.mean(best[1]):.4g} ± {statistics.stdev(best[1]):.2g}",
                         "0.100 ± 0.000", f"{statistics.mean(best[1]) + 0.01:.4g} ± {statistics.stdev(best[1]):.2g}",
                         f"{statistics.mean(best[1]):.4g} ± {statistics.stdev(best[1]):.2g}"]
    assert "Lowest val loss at the best post-hoc EMA: **train.accumulate_every=1**" in report
    assert "best post-hoc val loss" in report and "clearly higher than train.accumulate_every=1" in report
    assert "train.phema_sigma_rels" not in report


# --- re-runs, the plateau verdict, the measured critical batch ---------------------------------------
def test_reruns_of_an_identical_configuration_are_not_seeds(tmp_path):
    """The same seed-0 configuration trained three times per side (DVC never restores `train` from its run
    cache, so a second sweep trains again): one run per side is kept, the newest, so nothing is "clearly
    different" (zero spread on both sides used to give p = 0); the report names the runs it left out, from
    the MLflow store and from an archive of it alike. Params that do not shape training (where the run is
    logged, what is evaluated, the device asked for, the checkpoint cadence) do not make a re-run a seed."""
    from voxdiff.report.loading import open_client, write_archive

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("reruns", artifact_location=(tmp_path / "art").as_uri())
    ignored = [{}, {"mlflow.experiment": "other", "evaluate.sampling_steps": 10},
               {"train.device": "cuda", "train.checkpoint_every": 7}]
    ids = {}
    for k, floor in ((1, 0.10), (2, 0.11)):
        for start, extra in zip((3_000, 1_000, 2_000), ignored):  # the first created is the newest
            ids[(k, start)] = log_training_run(client, exp, k, 0, floor, start_time=start + k, extra_params=extra)
    dropped = sorted(ids[(k, s)] for k in (1, 2) for s in (1_000, 2_000))
    for result in (compare_runs(uri, "reruns", tmp_path / "store.md", log=False),
                   compare_runs(None, None, tmp_path / "archive.md", log=False,
                                runs_dir=tmp_path / "runs" if write_archive(open_client(uri), "reruns", None, uri,
                                                                            tmp_path / "runs") else None)):
        assert [(g.key, g.run_ids) for g in result.groups] == [("1", [ids[(1, 3_000)]]), ("2", [ids[(2, 3_000)]])]
        report = result.report_path.read_text()
        assert "clearly" not in report.split("## Reading")[1].split("\"Clearly\" means")[0]
        line = next(l for l in report.splitlines() if l.startswith("- train.accumulate_every=2: final val loss"))
        assert "unreplicated" in line
        note = next(m for m in result.messages if "re-runs of an identical configuration" in m)
        assert note.startswith("left out 4 re-runs of an identical configuration: run ids ")
        assert sorted(i for i in ids.values() if i in note) == dropped and f"- {note}" in report
        assert not any(i in report.split("## Runs")[1] for i in dropped)


def test_a_different_seed_lr_or_data_is_not_a_rerun():
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.groups import drop_reruns, reruns_note

    def run(rid, start, params=None, tags=None):
        return RunData(rid, {"seed": "0", "train.lr": "0.001", "train.phema_sigma_rels": "[0.05]", **(params or {})},
                       tags or {}, {}, *(np.array([1.0]),) * 4, np.array([]), np.array([]), 0.0, start_time=start)

    runs = [run("a", 1), run("b", 2, {"seed": "1"}), run("c", 3, {"train.lr": "0.002"}),
            run("d", 4, tags={"voxdiff.data_fingerprint": "other"}), run("e", 5, {"train.phema_sigma_rels": "[0.1]"}),
            run("f", 6, {"precision_resolved": "bf16"})]
    kept, dropped = drop_reruns(runs)
    assert [r.run_id for r in kept] == ["b", "c", "d", "e", "f"] and [r.run_id for r in dropped] == ["a"]
    assert reruns_note(dropped).startswith("left out 1 re-run of an identical configuration: run ids a ")
    assert reruns_note([]) is None
    tie = [run("z", 1), run("y", 1)]  # equal start times: the larger run id stands, whatever the order
    assert [r.run_id for r in drop_reruns(tie)[0]] == [r.run_id for r in drop_reruns(tie[::-1])[0]] == ["z"]


def test_rerun_key_ignores_exactly_what_the_trainer_leaves_out_of_its_fingerprint():
    """The trainer's measurement-only and operational keys never touch a weight: a run that differs from
    another only there is a re-run. Every other train key (here the lr) makes another configuration."""
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.groups import training_configuration
    from voxdiff.training.trainer import MEASUREMENT_KEYS, OPERATIONAL_KEYS

    def config(params):
        return training_configuration(RunData("r", {"seed": "0", "train.lr": "0.001", **params}, {}, {},
                                              *(np.array([1.0]),) * 4, np.array([]), np.array([]), 0.0))

    base = config({})
    for key in (*MEASUREMENT_KEYS, *OPERATIONAL_KEYS):
        assert config({f"train.{key}": "changed"}) == base, key
    assert config({"precision_resolved": "bf16"}) != base and config({"train.lr": "0.002"}) != base


def test_plateau_verdict_per_run_and_per_setting(tmp_path):
    """Curves floor + 0.9 exp(-samples / (tau k)): with tau = 10 k = 1 has flattened over the last quarter
    of its 256 samples (its exponential term is below 1e-8), with tau = 40 k = 2 still falls ~23 %. Each
    run's change is a least-squares line through its validations in the last quarter of its steps
    (computed here with numpy, independently of voxdiff.analysis.convergence), its verdict "at plateau" above -2 %."""
    import numpy as np

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("plateau", artifact_location=(tmp_path / "art").as_uri())
    shape = {1: (10, [0.100, 0.101, 0.102]), 2: (40, [0.110, 0.112, 0.111])}
    ids = {(k, seed): log_training_run(client, exp, k, seed, f, tau=tau)
           for k, (tau, floors) in shape.items() for seed, f in enumerate(floors)}
    report = compare_runs(uri, "plateau", tmp_path / "report.md", log=False).report_path.read_text()
    head = next(l for l in report.splitlines() if l.startswith("| setting | micro-batch |"))
    assert head.rstrip(" |").endswith("| last-quarter change | at plateau")
    for k, (tau, floors) in shape.items():
        changes = []
        for f in floors:
            steps, losses = np.array(val_curve(k, f, tau), float).T
            window = steps >= 0.75 * steps[-1]
            slope, intercept = np.polyfit(steps[window], losses[window], 1)
            changes.append(slope * 0.25 * steps[-1] / (slope * 0.75 * steps[-1] + intercept))
        at = sum(c > -0.02 for c in changes)
        assert (at == 3) if k == 1 else (at == 0)
        row = table_row(report, str(k))
        pct = [100 * c for c in changes]
        assert row[-2:] == [f"{statistics.mean(pct):+.1f} ± {statistics.stdev(pct):.1f} %", f"{at}/3"]
        for seed, c in enumerate(changes):
            line = next(l for l in report.splitlines() if f"| {ids[(k, seed)]} |" in l)
            verdict = "yes" if c > -0.02 else "no: still falling"
            assert line.endswith(f"| {100 * c:+.1f} % | {verdict} |")
    assert "Still falling at the end of the budget" in report and "train.accumulate_every=2 (3/3 runs" in report
    assert "train.accumulate_every=1 (" not in report.split("Still falling")[1].split("\n")[0]
    assert "Past their best at the end" not in report and "no: past its best" not in report  # none rose


def critical_runs(stretch, seeds: list[float], batches=(1, 2, 4, 8)):
    """RunData whose val curve reaches loss L after exactly S = S_min(L) x stretch(B) x seed factor
    optimizer steps (validated every step): L(step) = f(step / (stretch(B) x factor)) for a decreasing f.
    stretch(B) = 1 + B_crit / B gives every target the known B_crit."""
    import numpy as np

    from voxdiff.report.loading import RunData

    f = lambda x: 0.02 + 0.5 * np.exp(-x / 30.0)  # noqa: E731  S_min(L) = -30 ln((L - 0.02) / 0.5)
    runs = []
    for b in batches:
        for i, factor in enumerate(seeds):
            steps = np.arange(1.0, 1 + 8 * 30 * stretch(b))
            losses = f(steps / (stretch(b) * factor))
            runs.append(RunData(f"b{b}-s{i}", {"effective_batch_size": str(b), "seed": str(i)}, {}, {},
                                steps, losses, steps * b, np.full(len(steps), np.nan), np.array([]), np.array([]),
                                0.0))
    return runs


def test_critical_batch_section_recovers_a_known_b_crit():
    from voxdiff.report.rendering import critical_batch_section

    lines = critical_batch_section(critical_runs(lambda b: 1 + 3.0 / b, [0.93, 1.0, 1.06]), b_noise=0.5)
    assert lines[0] == "## Critical batch (measured)"
    rows = [line.split(" | ") for line in lines if line.startswith("| 0.")]
    assert len(rows) == 3 and len({r[0] for r in rows}) == 3  # three distinct targets
    for row in rows:
        b_crit = float(row[5].strip("*").split()[0])
        lo, hi = (float(v) for v in row[6].split("–"))
        assert b_crit == pytest.approx(3.0, rel=0.10) and lo <= 3.0 <= hi
    assert "predicts B_crit ≈ 0.5" in "\n".join(lines)
    plateau_rows = [line for line in lines if line.startswith("| 1 | 3 |") or line.startswith("| 8 | 3 |")]
    assert len(plateau_rows) == 2
    # no B dependence of the samples (perfect scaling: steps fall as 1/B): it cannot resolve B_crit
    perfect = [line for line in critical_batch_section(critical_runs(lambda b: 8 / b, [0.93, 1.0, 1.06]))
               if line.startswith("| 0.")]
    assert len(perfect) == 3 and all("unresolved: ∞ (steps fall as 1/B)" in line for line in perfect)
    assert all(line.split(" | ")[6].endswith("–∞") for line in perfect)
    # two batch sizes (the cause arms' design): fitted exactly, said so, and still right on the law
    two = critical_batch_section(critical_runs(lambda b: 1 + 3.0 / b, [0.97, 1.0, 1.03], batches=(1, 4)))
    assert any("Two effective batches only" in line for line in two)
    rows = [line.split(" | ") for line in two if line.startswith("| 0.")]
    assert rows and all(float(r[3].strip("*").split()[0]) == pytest.approx(3.0, rel=0.1) for r in rows)
    # one seed at a batch size: the fit stands, but no interval is claimed (every resample is the run itself)
    single = critical_batch_section(critical_runs(lambda b: 1 + 3.0 / b, [1.0], batches=(1, 2)))
    rows = [line.split(" | ") for line in single if line.startswith("| 0.")]
    assert rows and all(r[4] == "none: one run at a B" for r in rows)
    assert all(float(r[3].split()[0].strip("*")) == pytest.approx(3.0, rel=0.1) for r in rows)
    one = critical_batch_section(critical_runs(lambda b: 1 + 3.0 / b, [1.0], batches=(4,)))
    assert any("needs 2 at least" in line for line in one)


def test_archive_filter_selects_a_design_by_run_id(tmp_path):
    """attributes.run_id IN (...) (MLflow's syntax) picks exactly the named runs of an archive, together
    with params terms; the report names the filter by its count of ids, not by 32-character ids."""
    import json
    import shutil

    from voxdiff.report.compare import parse_param_filter
    from voxdiff.report.loading import RUN_ID, read_archive

    files = sorted((FIXTURE / "runs").glob("*.json"))
    records = [json.loads(f.read_text()) for f in files]
    finished = [r for r in records if r["status"] == "FINISHED" and r["tags"].get("voxdiff.kind") == "train"]
    pick = [r["run_id"] for r in finished[:4]]
    term = "attributes.run_id IN (" + ", ".join(f"'{i}'" for i in pick) + ")"
    assert parse_param_filter(term) == {RUN_ID: frozenset(pick)}
    runs, _ = read_archive(FIXTURE / "runs", parse_param_filter(term))
    assert sorted(r.run_id for r in runs) == sorted(pick)
    seed = finished[0]["params"]["seed"]
    both = parse_param_filter(f"{term} and params.seed = '{seed}'")
    runs, _ = read_archive(FIXTURE / "runs", both)
    assert sorted(r.run_id for r in runs) == sorted(r["run_id"] for r in finished[:4] if r["params"]["seed"] == seed)
    with pytest.raises(VoxdiffError, match="names no run"):
        parse_param_filter("attributes.run_id IN ()")
    with pytest.raises(VoxdiffError, match="no finished training runs matching the filter"):
        read_archive(FIXTURE / "runs", parse_param_filter("attributes.run_id IN ('nope')"))
    out = tmp_path / "r.md"
    runs_dir = tmp_path / "runs"
    shutil.copytree(FIXTURE / "runs", runs_dir)
    compare_runs(None, None, out, filter_string=term, runs_dir=runs_dir)
    assert f"filter `attributes.run_id IN ({len(pick)} run ids)`" in out.read_text()


def test_confounders_are_training_differences_not_measurement_keys_added_later_or_an_equal_steps_budget():
    """A key added after a run was archived (train.lr_schedule) is at the behaviour that run had; a
    measurement-only key (train.gns_*) never shapes training; the budget keys differ by design when every
    run made the same number of optimizer steps, and are flagged when the steps differ. Negative control:
    a real training difference (train.grad_clip) is still reported."""
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.groups import confounders, training_configuration

    def run(k, steps, **params):
        base = {"seed": "0", "train.lr": "0.001", "train.accumulate_every": str(k)}
        return RunData(f"r{k}", {**base, **params}, {}, {"total_steps": steps},
                       *(np.array([1.0]),) * 4, np.array([]), np.array([]), 0.0)

    old = run(1, 1536, **{"train.max_samples": "1536", "train.max_steps": "0"})
    new = run(2, 1536, **{"train.max_samples": "0", "train.max_steps": "1536", "train.lr_schedule": "constant",
                          "train.lr_min": "0.0", "train.gns_probe_samples": "16"})
    assert confounders([old, new], "train.accumulate_every") == {}
    unequal = run(2, 768, **{"train.max_samples": "1536", "train.max_steps": "0"})
    old_steps = run(1, 1536, **{"train.max_samples": "1536", "train.max_steps": "0"})
    assert confounders([old_steps, dataclasses.replace(unequal, params={**unequal.params, "train.max_samples": "3072"})],
                       "train.accumulate_every") == {"train.max_samples": ["1536", "3072"]}
    cosine = run(2, 1536, **{"train.lr_schedule": "cosine"})
    assert confounders([old, cosine], "train.accumulate_every")["train.lr_schedule"] == ["constant", "cosine"]
    clipped = run(2, 1536, **{"train.max_samples": "1536", "train.max_steps": "0", "train.grad_clip": "0.0"})
    assert "train.grad_clip" in confounders([old, clipped], "train.accumulate_every")
    # the same configuration archived before and after a key was added is one configuration
    again = dataclasses.replace(old, params={**old.params, "train.lr_schedule": "constant", "train.lr_min": "0.0"})
    assert training_configuration(old) == training_configuration(again)


def _law_runs(b_crit: float, b_simple: float, batches=(1, 2, 4, 8), seeds=3, b_adam: float | None = None):
    """Runs whose val loss follows L = 0.02 + 0.1 exp(-s / 200) in s = steps / (1 + B_crit / B) (so the
    steps to any target are S_min (1 + B_crit / B) exactly, up to a per-seed jitter of a few %), each with
    precise-probe readings of `b_simple` (interval x0.75-x1.25) every 64 steps, and of `b_adam` in Adam's
    coordinates when given."""
    import numpy as np

    from voxdiff.report.loading import RunData

    rng = np.random.default_rng(0)
    runs = []
    for b in batches:
        for seed in range(seeds):
            stretch = (1 + b_crit / b) * (1 + 0.03 * rng.standard_normal())
            steps = np.arange(8, 1537, 8, dtype=float)
            loss = 0.02 + 0.1 * np.exp(-steps / stretch / 200)
            probe = np.arange(64, 1537, 64, dtype=float)
            value = np.full(len(probe), b_simple)
            adam = np.full(len(probe), b_adam) if b_adam is not None else None
            runs.append(RunData(f"b{b}s{seed}", {"seed": str(seed), "effective_batch_size": str(b)}, {}, {},
                                steps, loss, steps * b, np.full(len(steps), np.nan), np.array([]), np.array([]),
                                0.0, marginal_gns=(probe, value, 0.75 * value, 1.25 * value),
                                **({"marginal_adam": (probe, adam, 0.75 * adam, 1.25 * adam)} if adam is not None else {})))
    return runs


def test_measured_against_predicted_critical_batch_holds_only_when_the_noise_scale_matches():
    """Known truth: steps-to-target follow S_min (1 + 2/B). A probe that reads 2 gives ratios within 2x at
    every target ('yes'); one that reads 0.1 (the study's kind of miss) gives 'no (~20x)'. Without a probe
    near a target's loss the row says so instead of borrowing one from elsewhere in training."""
    from voxdiff.report.rendering import critical_batch_section

    def rows(lines):
        table = lines[lines.index("## Critical batch: measured against predicted"):]
        return [l for l in table if l.startswith("| 0.") or l.startswith("| plateau")]

    good = rows(critical_batch_section(_law_runs(2.0, 2.0)))
    assert len(good) == 4  # 3 targets and the plateau row
    for row in good[:3]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == "yes", row
        assert 0.8 < float(cells[-2]) < 1.25, row
    bad = rows(critical_batch_section(_law_runs(2.0, 0.1)))
    for row in bad[:3]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1].startswith("no (") and 16 < float(cells[-2]) < 25, row
    runs = _law_runs(2.0, 2.0)
    for r in runs:  # probes only late in training: none near the early targets
        steps, value, lo, hi = r.marginal_gns
        keep = steps > 1400
        r.marginal_gns = (steps[keep], value[keep], lo[keep], hi[keep])
    assert "no probe at this loss" in rows(critical_batch_section(runs))[0]


def test_the_noise_scale_in_adams_coordinates_gets_its_own_columns_and_verdict():
    """Runs that logged gns_marginal_adam: the table adds its probes, value, ratio and verdict beside the
    plain probe's, each judged on its own (here the plain one misses 20x and Adam's matches); runs without
    it keep the plain table."""
    from voxdiff.report.rendering import critical_batch_section

    lines = critical_batch_section(_law_runs(2.0, 0.1, b_adam=2.0))
    table = lines[lines.index("## Critical batch: measured against predicted"):]
    header = next(l for l in table if l.startswith("| target val loss"))
    assert "B_simple, Adam" in header
    rows = [l for l in table if l.startswith("| 0.")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 11, row
        assert cells[6].startswith("no (") and cells[10] == "yes", row
        assert 0.8 < float(cells[9]) < 1.25, row
    plain = critical_batch_section(_law_runs(2.0, 0.1))
    assert not any("Adam" in l for l in plain)


def test_each_setting_at_its_own_best_is_the_lowest_window_and_its_cost():
    """Each run's lowest val loss and the steps, samples and wall time where it lies, found here by a plain
    loop over the windows of 5 validations, independently of the report: k 1 over-fits after validation 30
    (lowest before the end 3/3; one run logged no wall time: 2/3 in that cell; a fourth run of 4 validations
    is left out: runs 3/4), k 4 lies 0.002 above it, also past its lowest (Welch: within seed noise), k 2
    still falls at its end (0/3): its level is only a bound, so it gets no verdict."""
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.rendering import best_table, mean_std
    from voxdiff.report.groups import summarize_group

    i = np.arange(48.0)
    u_shape = lambda f: f + 0.02 * ((i - 30) / 30.0) ** 2  # noqa: E731
    shapes = {1: u_shape, 4: lambda f: u_shape(f + 0.002), 2: lambda f: f + 0.1 * np.exp(-i / 20.0)}
    floors = {1: [0.030, 0.031, 0.029], 4: [0.030, 0.033, 0.029], 2: [0.050, 0.051, 0.052]}
    groups, expect = [], {}
    for k, shape in shapes.items():
        runs = []
        for seed, f in enumerate(floors[k]):
            steps = (i + 1) * 64 / k
            wall = np.full(len(i), np.nan) if (k, seed) == (1, 2) else steps * 0.5 * k
            runs.append(RunData(f"k{k}-s{seed}", {"effective_batch_size": str(k), "seed": str(seed)}, {}, {},
                                steps, shape(f), steps * k, wall, np.array([]), np.array([]), 0.0))
        if k == 1:  # too short for a window of 5
            runs.append(RunData("k1-short", {"effective_batch_size": "1", "seed": "3"}, {}, {}, i[:4] + 1,
                                u_shape(0.03)[:4], i[:4] + 1, i[:4], np.array([]), np.array([]), 0.0))
        groups.append(summarize_group(str(k), runs, None))
        found = []
        for r in runs[:3]:
            windows = [(sum(r.val_loss[j:j + 5]) / 5, j + 2) for j in range(len(r.val_loss) - 4)]
            level, at = min(windows)
            found.append((level, r.val_steps[at], r.val_samples[at], r.val_wall[at], at == len(r.val_loss) - 3))
        expect[k] = found
    lines = best_table(groups, "train.accumulate_every")
    for k, found in expect.items():
        row = next(l for l in lines if l.startswith(f"| train.accumulate_every={k} |"))
        walls = [w for *_, w, _ in found if not np.isnan(w)]
        wall_cell = mean_std(walls, ".0f") + ("" if len(walls) == 3 else f" ({len(walls)}/3)")
        before = sum(not end for *_, end in found)
        assert before == (0 if k == 2 else 3)
        assert row == (f"| train.accumulate_every={k} | {'3/4' if k == 1 else 3} | "
                       f"{mean_std([f[0] for f in found], '.4g', '.2g')} | {mean_std([f[1] for f in found], '.0f')} | "
                       f"{mean_std([f[2] for f in found], '.0f')} | {wall_cell} | {before}/3 |")
    assert "(2/3)" in next(l for l in lines if l.startswith("| train.accumulate_every=1 |"))
    assert any("Lowest val loss at its own best: **train.accumulate_every=1**" in l for l in lines)
    assert any(l.startswith("- train.accumulate_every=4: lowest val loss") and "within seed noise" in l for l in lines)
    bound = [l for l in lines if l.startswith("- train.accumulate_every=2:")]
    assert len(bound) == 1 and "3/3 of its runs were still at their lowest at the end" in bound[0]
    assert "clearly" not in bound[0] and "not compared" in bound[0]
    assert best_table([summarize_group("1", [], None)], "x") == []  # no validations: no table


def test_each_runs_plateau_is_worked_out_once(tmp_path, monkeypatch):
    """The runs table, the group summaries and the critical-batch section read one plateau change and one
    plateau level per run (RunData), not their own recomputations; the report stays byte for byte."""
    from voxdiff.analysis import convergence
    from voxdiff.report import groups, rendering

    calls = {"plateau_change": 0, "plateau_level": 0}
    for name in calls:
        real = getattr(convergence, name)
        counted = lambda *a, _real=real, _name=name, **k: (  # noqa: E731
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **k))[1]
        for module in (convergence, rendering, groups):  # wherever the name is imported
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted)
    out = tmp_path / "report.md"
    result = CliRunner().invoke(compare_command, ["--runs", str(FIXTURE / "runs"), "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runs = len(list((FIXTURE / "runs").glob("*.json")))
    assert calls == {"plateau_change": runs, "plateau_level": runs}
    rebuilt = out.read_text().replace(f"`{FIXTURE / 'runs'}`", "`tests/fixtures/archive/runs`")
    assert rebuilt == (FIXTURE / "report.md").read_text()


def test_every_measurement_family_key_is_in_the_one_list():
    """compare leaves train.gns_* and train.phema_* out by prefix (archived runs carry retired keys of both
    families), the trainer by MEASUREMENT_KEYS: every current key of both families must be in that list, or
    the two would disagree on what a re-run is (phema_snapshots and phema_sigma_rels forced a retrain while
    compare called them measurement-only). NOT_TRAINING_KEYS is that list, not a copy of it."""
    from voxdiff.params import MEASUREMENT_KEYS, OPERATIONAL_KEYS, SCHEMA
    from voxdiff.report.groups import NOT_TRAINING_KEYS

    family = {k for k in SCHEMA["train"] if k.startswith(("gns_", "phema_"))}
    assert family and family <= set(MEASUREMENT_KEYS), sorted(family - set(MEASUREMENT_KEYS))
    assert NOT_TRAINING_KEYS == {f"train.{k}" for k in MEASUREMENT_KEYS + OPERATIONAL_KEYS} | {"device_resolved"}


def test_smoothed_crossing_and_the_spread_across_methods():
    """The causal rolling mean a run had shown by each validation, the crossing read off it, and the report's
    second interval (B_crit over the raw validations and rolling means of 3 and 5) on a law with B_crit 3."""
    import numpy as np

    from voxdiff.report.loading import RunData
    from voxdiff.report.rendering import critical_batch_section

    r = RunData("r", {}, {}, {}, val_steps=np.array([1.0, 2.0, 3.0, 4.0]), val_loss=np.array([1.0, 0.6, 0.2, 0.4]),
                val_samples=np.array([1.0, 2.0, 3.0, 4.0]), val_wall=np.full(4, np.nan), gns_samples=np.array([]),
                gns=np.array([]), peak_memory_mb=0.0)
    assert list(r.smoothed(1)) == [1.0, 0.6, 0.2, 0.4]
    assert np.allclose(r.smoothed(3), [1.0, 0.8, 0.6, 0.4])  # the first ones over what there is: causal
    assert r.crossing(0.7, r.val_steps, 1) == pytest.approx(1.75) and r.crossing(0.7, r.val_steps, 3) == pytest.approx(2.5)
    assert r.crossing(0.3, r.val_steps, 3) is None  # the smoothed curve never gets there
    lines = critical_batch_section(critical_runs(lambda b: 1 + 3.0 / b, [0.93, 1.0, 1.06]), smooth=3)
    assert any("causal rolling mean of 3 validations" in line for line in lines)
    rows = [line.split(" | ") for line in lines if line.startswith("| 0.")]
    assert len(rows) == 3
    for row in rows:
        assert float(row[5].strip("*").split()[0]) == pytest.approx(3.0, rel=0.12)
        lo, hi = (float(v) for v in row[7].split("–"))  # every method on a smooth law: all near 3
        assert 2.5 < lo <= hi < 3.5
