"""voxdiff compare: how does one param (default train.accumulate_every) change convergence?

Reads the training runs that the trainer logged to MLflow, groups them by the param, and writes a
Markdown report with figures: validation loss against optimizer steps, samples seen and wall time;
a table per setting (with each run's last-quarter change and plateau verdict, voxdiff.analysis.convergence); the
measured gradient noise scale and the accumulate_every it implies; the critical batch measured from
steps-to-target; and a plain-language reading that only calls a difference real when the seeds' spread
supports it. Re-runs of an identical configuration (the same seed trained again) are left out, by name.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click

from voxdiff.runtime.errors import VoxdiffError
from voxdiff.tracking.runs import end_with_batch
from voxdiff.runtime.fsutil import project_relative, project_root, write_text
from voxdiff.report.loading import (RUN_ID, THIN_ABOVE_ROWS, find_training_runs, load_run, open_client,
                                    read_archive, write_archive)
from voxdiff.tracking.uri import display_uri
from voxdiff.report.rendering import (bucket_section, critical_batch_section, phase_section, make_figures, mean_std,
                                      messages_for, noise_scale_section, reached_cell, reading_section, render_report)
from voxdiff.report.groups import (GroupSummary, default_target, drop_reruns, group_runs, reruns_note,
                                   summarize_group)

MAX_TAG_CHARS = 8000  # MLflow's limit on a tag value


@dataclasses.dataclass
class CompareResult:
    report_path: Path
    figure_paths: list[Path]
    group_by: str
    groups: list[GroupSummary]
    target_val_loss: float | None
    b_noise: float | None
    balanced_accumulate_every: int | None
    messages: list[str]
    compare_run_id: str | None
    view_url: str | None = None  # the same runs and groups in the MLflow UI (tracking/views.py)
    view_server: str | None = None  # the command that serves it, for a store that is not a server

    def terminal_table(self) -> str:
        head = ["setting", "seeds", "final val loss", "steps→target", "samples→target", "time→target s",
                "B_noise"]
        rows = [[g.key, str(g.n), mean_std(g.final_val, ".4g", ".2g") if g.n else "no val_loss",
                 reached_cell(g.steps_to_target, g, ".0f"), reached_cell(g.samples_to_target, g, ".0f"),
                 reached_cell(g.time_to_target, g, ".1f"), mean_std(g.gns, ".3g")] for g in self.groups]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        target = "—" if self.target_val_loss is None else f"{self.target_val_loss:.4g}"
        return "\n".join([f"{self.group_by}   (target val loss {target})", line(head),
                          *(line(r) for r in rows)])


def log_report(client, experiment_id: str, group_by: str, filter_string: str | None, target: float | None,
               run_ids: list[str], files: list[Path]) -> str:
    """Log the report and figures as their own MLflow run; return its id."""
    from mlflow.entities import Param

    ids = ",".join(run_ids)
    if len(ids) > MAX_TAG_CHARS:  # the report itself lists every run
        ids = ids[:MAX_TAG_CHARS - 20].rsplit(",", 1)[0] + ",...(see report)"
    run = client.create_run(experiment_id, run_name=f"compare {group_by}",
                            tags={"voxdiff.kind": "compare", "voxdiff.compared_runs": ids})
    rid = run.info.run_id
    return end_with_batch(client, rid, files,
                          params=[Param("group_by", group_by), Param("filter", filter_string or ""),
                                  Param("target_val_loss", "" if target is None else f"{target:.6g}")])


def compare_runs(tracking_uri: str | None, experiment: str | None, out_path: str | os.PathLike,
                 group_by: str = "train.accumulate_every", filter_string: str | None = None,
                 target_val_loss: float | None = None, log: bool = True,
                 runs_dir: str | os.PathLike | None = None, root: Path | None = None, smooth: int = 1,
                 dvc_exps: tuple[str, ...] = ()) -> CompareResult:
    """Write the comparison report (Markdown + PNGs next to it) from an MLflow store, or from an archive
    folder of exported runs (runs_dir: no store needed, nothing logged); log it to MLflow unless log=False.
    dvc_exps: only the runs DVC trained as these experiments (make sweep's grid), when given."""
    out_path = Path(out_path)
    if runs_dir is not None:
        runs, experiment = read_archive(Path(runs_dir), parse_param_filter(filter_string))
        runs = only_dvc_experiments(runs, dvc_exps, lambda r: r.tags)
        unfinished_note, client, exp = None, None, None
        source = f"the run archive `{project_relative(runs_dir, root) or Path(runs_dir).name}` (`voxdiff export`)"
    else:
        client = open_client(tracking_uri)
        exp, found, unfinished_note = find_training_runs(client, experiment, filter_string, tracking_uri)
        found = only_dvc_experiments(found, dvc_exps, lambda r: r.data.tags)
        runs = sorted((load_run(client, r) for r in found), key=lambda r: (r.start_time, r.run_id))
        source = f"MLflow store `{display_uri(tracking_uri, root)}`"
    if dvc_exps:
        source += f", DVC experiments {', '.join(sorted(set(dvc_exps)))}"
    runs, reruns = drop_reruns(runs)  # the same configuration trained again is not another seed
    by_key = group_runs(runs, group_by)
    target = target_val_loss if target_val_loss is not None else default_target(runs)
    groups = [summarize_group(k, rs, target) for k, rs in by_key.items()]
    messages = messages_for(groups, runs, group_by, unfinished_note, reruns_note(reruns))
    noise_lines, b_noise, k_star = noise_scale_section(groups, runs, group_by)
    buckets = bucket_section(by_key, group_by)
    if buckets:
        noise_lines += ["", *buckets, *phase_section(by_key, group_by)]
    figures = make_figures(by_key, group_by, out_path)
    text = render_report(experiment=experiment, source=source, group_by=group_by,
                         filter_string=filter_string, groups=groups, by_key=by_key, runs=runs, target=target,
                         target_given=target_val_loss is not None, figures=figures, messages=messages,
                         noise_lines=noise_lines, reading_lines=reading_section(groups, runs, group_by, target),
                         critical_lines=critical_batch_section(runs, b_noise, smooth))
    write_text(out_path, text)
    run_id = (log_report(client, exp.experiment_id, group_by, filter_string, target,
                         [r.run_id for r in runs], [out_path, *figures]) if log and client is not None else None)
    url = save_compare_view(client, exp.experiment_id, tracking_uri, group_by, filter_string,
                            [r.run_id for r in runs]) if run_id else None
    served = url is not None and not tracking_uri.startswith(("http://", "https://"))
    return CompareResult(out_path, figures, group_by, groups, target, b_noise, k_star, messages, run_id, url,
                         f"{mlflow_command()} ui --backend-store-uri {tracking_uri}" if served else None)


def only_dvc_experiments(runs: list, names: tuple[str, ...], tags_of) -> list:
    """The runs whose DVC experiment (tag voxdiff.dvc_exp_name, set by training from DVC_EXP_NAME) is one of
    `names`; all of them when no name is given. MLflow's filter has no IN for tags, hence the filter here.
    A name no finished run carries is an error: the report would silently lack that experiment."""
    if not names:
        return runs
    kept = [r for r in runs if tags_of(r).get("voxdiff.dvc_exp_name") in names]
    missing = sorted(set(names) - {tags_of(r).get("voxdiff.dvc_exp_name") for r in kept})
    if missing:
        raise VoxdiffError(f"--dvc-exp: no finished training run of DVC experiment(s) {', '.join(missing)}")
    return kept


def mlflow_command() -> str:
    """`mlflow` when the one on PATH is ours, else the full path of the one next to this Python (a
    `.venv/bin/voxdiff compare` run without the venv activated): the hint must run as printed."""
    import shutil
    import sys

    ours = Path(sys.executable).parent / "mlflow"
    on_path = shutil.which("mlflow")
    if not ours.exists() or (on_path and Path(on_path).resolve() == ours.resolve()):
        return "mlflow"
    return str(ours)


def save_compare_view(client, experiment_id: str, tracking_uri: str, group_by: str, filter_string: str | None,
                      run_ids: list[str]) -> str:
    """The MLflow UI view of exactly these runs grouped by `group_by`, against samples seen and training
    time (tracking/views.py); its address under the store's server, or under `mlflow ui`'s default."""
    from voxdiff.tracking import views

    key = views.save_view(client, experiment_id, views.compare_key(group_by), f"voxdiff compare: {group_by}",
                          views.view_state(group_by, run_ids, filter_string))
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return base + views.view_path(experiment_id, key)


def parse_param_filter(filter_string: str | None) -> dict[str, str | frozenset]:
    """The subset of MLflow's filter syntax an archive understands, terms joined by 'and':
    params.`key` = 'value', and attributes.run_id IN ('id', ...) (a study's design that spans several
    configurations, e.g. docs/study/grid.py ids steps). The run id term is kept under the key RUN_ID."""
    import re

    if not filter_string:
        return {}
    wanted: dict[str, str | frozenset] = {}
    for part in re.split(r"\s+and\s+", filter_string.strip(), flags=re.I):
        part = part.strip()
        if m := re.fullmatch(r"params\.(?:`([^`]+)`|([\w.]+))\s*=\s*'([^']*)'", part):
            wanted[m.group(1) or m.group(2)] = m.group(3)
        elif m := re.fullmatch(r"attributes\.run_id\s+in\s*\(([^)]*)\)", part, flags=re.I):
            ids = re.findall(r"'([^']*)'", m.group(1))
            if not ids:
                raise VoxdiffError(f"--filter {filter_string!r}: attributes.run_id IN () names no run")
            wanted[RUN_ID] = frozenset(ids)
        else:
            raise VoxdiffError(f"--filter {filter_string!r}: with --runs only params.`key` = 'value' and "
                               "attributes.run_id IN ('id', ...) terms joined by 'and' are understood")
    return wanted


@click.command("compare")
@click.option("--experiment", default=None, help="MLflow experiment [default: params.yaml mlflow.experiment].")
@click.option("--tracking-uri", default=None,
              help="MLflow tracking URI [default: MLFLOW_TRACKING_URI, else params.yaml, else <repo>/mlflow.db].")
@click.option("--group-by", default="train.accumulate_every", show_default=True, help="Param to group runs by.")
@click.option("--filter", "filter_string", default=None,
              help="Extra MLflow filter, e.g. \"params.`train.lr_scaling` = 'none'\".")
@click.option("--target-val-loss", type=float, default=None,
              help="Val loss level for steps/samples-to-target [default: the highest best val loss over runs].")
@click.option("--out", "out_path", default="reports/compare.md", show_default=True,
              type=click.Path(dir_okay=False),
              help="Markdown report; figures are written next to it.")
@click.option("--no-log", is_flag=True, help="Do not log the report to MLflow.")
@click.option("--smoothing", type=click.IntRange(1, 25), default=1, show_default=True,
              help="B_crit's steps-to-target read on each run's causal rolling mean of this many validations "
                   "(1 = the validations; the data-size arm registered 3). The report also gives the range over "
                   "1, 3 and 5.")
@click.option("--runs", "runs_dir", default=None, type=click.Path(file_okay=False),
              help="Read the runs from an archive folder written by `voxdiff export` instead of MLflow "
                   "(no store needed; nothing is logged).")
@click.option("--dvc-exp", "dvc_exps", multiple=True, metavar="NAME",
              help="Only the runs of this DVC experiment (repeatable; `dvc exp show` names them). "
                   "make sweep passes its grid's, so other runs of the experiment stay out.")
def compare_command(experiment, tracking_uri, group_by, filter_string, target_val_loss, out_path, no_log, smoothing,
                    runs_dir, dvc_exps):
    """Compare training runs grouped by a param: convergence curves, noise scale, a reading."""
    if runs_dir is not None:
        result = compare_runs(None, None, out_path, group_by, filter_string, target_val_loss, log=False,
                              runs_dir=runs_dir, smooth=smoothing, dvc_exps=dvc_exps)
        _echo_result(result)
        return
    experiment, tracking_uri = _store_defaults(experiment, tracking_uri)
    result = compare_runs(tracking_uri, experiment, out_path, group_by, filter_string, target_val_loss,
                          log=not no_log, smooth=smoothing, dvc_exps=dvc_exps)
    _echo_result(result)


def _echo_result(result: CompareResult) -> None:
    click.echo(result.terminal_table())
    for m in result.messages:
        click.echo(f"warning: {m}", err=True)
    if result.balanced_accumulate_every is not None:
        click.echo(f"noise scale B_noise ≈ {result.b_noise:.3g} → balanced accumulate_every ≈ "
                   f"{result.balanced_accumulate_every}")
    click.echo(f"report: {result.report_path}" + (f" (MLflow run {result.compare_run_id})"
                                                   if result.compare_run_id else ""))
    if result.view_url:
        click.echo(f"MLflow view of the same runs and groups against samples seen: {result.view_url}"
                   + (f"   (served by `{result.view_server}`)" if result.view_server else ""))


@click.command("export")
@click.option("--experiment", default=None, help="MLflow experiment [default: params.yaml mlflow.experiment].")
@click.option("--tracking-uri", default=None,
              help="MLflow tracking URI [default: MLFLOW_TRACKING_URI, else params.yaml, else <repo>/mlflow.db].")
@click.option("--filter", "filter_string", default=None, help="Extra MLflow filter on the runs to export.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Archive folder: one <run id>.json per finished training run (small text, for git).")
@click.option("--full-histories", is_flag=True,
              help=f"Keep every row of the per-step metrics. By default, in a run of more than {THIN_ABOVE_ROWS} "
                   "steps, lr, wall time, samples seen, grad norm and the like are kept at the validation "
                   "and probe steps and their first and last row (the train loss, val loss and noise scale whole): the "
                   "reports need no more, and a 16,384-step run's file takes 2 MB instead of 6-9.")
def export_command(experiment, tracking_uri, filter_string, out_dir, full_histories):
    """Export finished training runs (params, tags, metric histories) to an archive folder that
    `voxdiff compare --runs FOLDER` reads without MLflow: publish and share a study as text."""
    experiment, tracking_uri = _store_defaults(experiment, tracking_uri)
    written = write_archive(open_client(tracking_uri), experiment, filter_string, tracking_uri, Path(out_dir),
                            max_rows=None if full_histories else THIN_ABOVE_ROWS)
    click.echo(f"exported {len(written)} run(s) of experiment {experiment!r} to {out_dir}")


def _store_defaults(experiment, tracking_uri):
    from voxdiff.tracking.uri import resolve_tracking_uri

    params = _load_params_if_present()
    if experiment is None:
        if params is None:
            raise VoxdiffError("no --experiment given and no params.yaml found to read mlflow.experiment from")
        experiment = params.mlflow.experiment
    return experiment, tracking_uri or resolve_tracking_uri(params, project_root())


def _load_params_if_present():
    from voxdiff import params

    path = project_root() / "params.yaml"
    return params.load(path) if path.is_file() else None
