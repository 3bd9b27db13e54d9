"""Every run judged at its best: the EMA weights at the lowest 5-validation mean are kept in the checkpoint,
evaluate reads them by default (the final weights beside them), and early stopping ends a run past its best.

The run here is made to rise after its best: Adam at lr 0.05 without clipping, warmed up over 32 samples, on
the tiny cache: the val loss dips in the first validations and then settles ~4 % higher (checked below, so
the test fails loudly if the run stops rising rather than passing for nothing).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from conftest import TINY, make_params, raw_params

RISING = {"train.max_samples": 128, "train.batch_size": 2, "train.accumulate_every": 1, "train.lr": 0.05,
          "train.warmup_samples": 32, "train.grad_clip": 0.0, "train.val_every_samples": 4,
          "train.checkpoint_every": 1000, "train.gns_buckets_every_samples": 0, "train.gns_probe_samples": 0,
          "train.phema_sigma_rels": [], "mlflow.system_metrics": False, "evaluate.subjects": 1,
          "evaluate.samples_per_condition": 1, "evaluate.sampling_steps": 4}


def _train(root, **extra):
    from voxdiff.pipeline.train import run_training

    overrides = {**RISING, **extra}
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**TINY, **overrides}), sort_keys=False))
    params = make_params(overrides)
    return params, run_training(params, root, progress=False)


def _val_history(root) -> list[dict]:
    from voxdiff.training import checkpoint

    state = checkpoint.load(root / "models" / "checkpoint.pt")
    return [h for h in state["history"] if h["val_loss"] is not None], state


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    from conftest import write_tiny_cache

    root = tmp_path_factory.mktemp("rising")
    write_tiny_cache(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for var in ("DVC_EXP_NAME", "DVC_ROOT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            mp.delenv(var, raising=False)
        params, summary = _train(root)
    return root, params, summary


def test_the_best_ema_is_kept_exactly_where_the_lowest_window_ends(rising):
    root, _, summary = rising
    val, state = _val_history(root)
    losses = [h["val_loss"] for h in val]
    means = [sum(losses[i:i + 5]) / 5 for i in range(len(losses) - 4)]
    lowest = min(range(len(means)), key=means.__getitem__)
    # the precondition: this run rises after its best (else the test would prove nothing)
    assert summary["final_val_loss"] > 1.02 * min(means) and lowest < len(means) - 3
    assert summary["best_checkpoint_step"] == val[lowest + 2]["step"] == summary["own_best_step"]
    assert summary["best_checkpoint_val_loss"] == pytest.approx(means[lowest], rel=1e-12)
    assert summary["best_checkpoint_val_loss"] == pytest.approx(summary["own_best_val_loss"], rel=1e-12)
    assert summary["stopped_early"] == 0 and summary["total_samples"] == RISING["train.max_samples"]
    # one EMA copy, the network's own state: same keys and shapes, and not the final weights
    best = state["best"]["ema"]
    assert best.keys() == state["ema"].keys()
    assert any(not torch.equal(best[k], state["ema"][k]) for k in best if best[k].is_floating_point())


def test_evaluate_reads_the_best_weights_and_reports_the_final_beside_them(rising, monkeypatch):
    from voxdiff.pipeline.evaluate import run_evaluate

    root, params, summary = rising
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    val, _ = _val_history(root)
    at_best = next(h for h in val if h["step"] == summary["best_checkpoint_step"])
    m = run_evaluate(params, root, progress=False)
    assert m["eval_checkpoint"] == "best" and m["eval_checkpoint_step"] == summary["best_checkpoint_step"]
    # the copy is the EMA as it was at that validation: its val loss (same draws) is the one logged then
    assert m["eval_val_loss"] == pytest.approx(at_best["val_loss"], rel=1e-5)
    assert m["eval_final_val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    assert m["eval_final_checkpoint_step"] == summary["total_steps"]
    assert m["eval_val_loss"] < m["eval_final_val_loss"]
    assert {"eval_final_ssim", "eval_final_psnr", "eval_final_mae"} <= m.keys()
    assert json.loads((root / "metrics" / "eval_detail.json").read_text())["eval_checkpoint"] == "best"

    # negative control: evaluate.checkpoint final reads the final weights, and reports nothing beside them
    final_params = make_params({**RISING, "evaluate.checkpoint": "final"})
    f = run_evaluate(final_params, root, progress=False)
    assert f["eval_checkpoint"] == "final" and f["eval_checkpoint_step"] == summary["total_steps"]
    assert f["eval_val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    assert not [k for k in f if k.startswith("eval_final_")]


def test_early_stopping_ends_the_run_past_its_best_and_stands_as_finished(tiny_root, capfd):
    patience = 24
    _, summary = _train(tiny_root, **{"train.early_stop_patience_samples": patience})
    assert summary["stopped_early"] == 1
    assert summary["total_samples"] < RISING["train.max_samples"]
    # it stops at the first validation at least `patience` samples past the best point
    assert patience <= summary["total_samples"] - summary["best_checkpoint_samples"] < patience + RISING["train.val_every_samples"]
    assert "early stop at step" in capfd.readouterr().err
    # the stopped run is finished: a rerun trains nothing and keeps its figures
    _, again = _train(tiny_root, **{"train.early_stop_patience_samples": patience})
    assert "nothing to train" in capfd.readouterr().err
    assert again["total_steps"] == summary["total_steps"] and again["stopped_early"] == 1


def test_best_weights_take_a_copy_only_on_a_new_lowest_window():
    from voxdiff.training.best import BestWeights

    net = torch.nn.Linear(2, 1)
    best = BestWeights(net, patience_samples=10, window=3)
    history = []

    def validate(step, loss):
        with torch.no_grad():
            net.weight.fill_(step)
        history.append({"step": step, "samples_seen": 2 * step, "val_loss": loss})
        return best.observe(history)

    assert not validate(1, 1.0) and not validate(2, 0.9)  # fewer than 3 validations: no window yet
    assert validate(3, 0.8) and best.mark.step == 2 and best.state["weight"][0, 0].item() == 2  # the window's centre
    assert validate(4, 0.5) and best.mark.window_mean == pytest.approx((0.9 + 0.8 + 0.5) / 3) and best.mark.step == 3
    assert not validate(5, 2.0) and not validate(6, math.nan)  # a higher window, a NaN window: the copy stays
    assert best.state["weight"][0, 0].item() == 3 and best.mark.samples_seen == 6
    assert len(best.pending) == 1  # window // 2 possible centres wait beside the kept copy, never more
    assert not best.should_stop(15) and best.should_stop(16)  # 10 samples past the best point
    restored = BestWeights(net, patience_samples=10, window=3)
    restored.load_state_dict(best.state_dict())
    assert restored.mark == best.mark and torch.equal(restored.state["weight"], best.state["weight"])
    assert not BestWeights(net, patience_samples=0).should_stop(10 ** 9)  # 0 = off


def test_a_run_still_at_its_lowest_at_its_end_is_evaluated_at_its_end():
    """A falling run's best window is its last: the kept copy lies two validations before the end, and the
    final weights, at least as good, are read as its best."""
    from voxdiff.pipeline.evaluate import evaluated_weights, still_at_best

    history = [{"step": s, "val_loss": 1.0 / s} for s in range(1, 11)]
    state = {"step": 10, "samples_seen": 20, "ema": "final", "history": history,
             "best": {"ema": "kept", "mark": {"step": 8, "samples_seen": 16}}}
    assert still_at_best(state) and evaluated_weights(state, "best") == ("best", state)
    rose = [{"step": s, "val_loss": abs(s - 5) + 1.0} for s in range(1, 11)]  # lowest at step 5, then rising
    passed = {**state, "history": rose, "best": {"ema": "kept", "mark": {"step": 5, "samples_seen": 10}}}
    assert not still_at_best(passed)
    which, weights = evaluated_weights(passed, "best")
    assert which == "best" and weights["ema"] == "kept" and weights["step"] == 5
