"""voxdiff compare on MLflow runs made by real (tiny) trainings, not synthetic curves."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from conftest import make_params
from voxdiff.report.compare import compare_runs
from voxdiff.pipeline.train import run_training


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Six real trainings on the tiny cache: accumulate_every 1 and 2, seeds 0-2, same sample budget."""
    import os

    from conftest import write_tiny_cache

    root = tmp_path_factory.mktemp("real")
    write_tiny_cache(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        for k in (1, 2):
            for seed in (0, 1, 2):
                p = make_params({"train.batch_size": 1, "train.accumulate_every": k, "train.max_samples": 8,
                                 "seed": seed})
                run_training(p, root, progress=False)
                (root / "models" / "checkpoint.pt").unlink()  # each run trains from scratch
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return root, uri


def test_groups_seeds_and_curves_of_real_runs(trained, tmp_path):
    root, uri = trained
    result = compare_runs(uri, "voxdiff", tmp_path / "report.md", log=False)
    groups = {g.key: g for g in result.groups}
    assert sorted(groups) == ["1", "2"]
    client = MlflowClient(uri)
    for g in groups.values():
        assert g.n == 3 and sorted(g.seeds) == ["0", "1", "2"]  # the seed-spread case
        for run_id, final in zip(g.run_ids, g.final_val):
            history = client.get_metric_history(run_id, "val_loss")
            assert final == pytest.approx(max(history, key=lambda m: m.step).value)
    assert result.b_noise is not None  # k=2 runs measured the gradient noise scale
    report = result.report_path.read_text()
    assert "± " in report and "gradient noise scale not measurable" in report


def test_group_missing_val_loss_is_a_message_not_a_crash(trained, tmp_path):
    """A group whose runs never logged val_loss (here: a run stopped before its first validation)."""
    root, uri = trained
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("voxdiff")
    run = client.create_run(exp.experiment_id, tags={"voxdiff.kind": "train"})
    client.log_param(run.info.run_id, "train.accumulate_every", "4")
    client.log_param(run.info.run_id, "seed", "0")
    client.log_metric(run.info.run_id, "train_loss", 0.8, step=1)
    client.set_terminated(run.info.run_id)
    result = compare_runs(uri, "voxdiff", tmp_path / "report.md", log=False)
    assert any("train.accumulate_every=4" in m and "val_loss" in m for m in result.messages)
    assert {g.key for g in result.groups} >= {"1", "2"}
