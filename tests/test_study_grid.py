"""The study's grid (docs/study/grid.py): every run it would queue is a valid configuration, and the
designs that reports read select the right archived runs."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from voxdiff import params as params_mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grid():
    spec = importlib.util.spec_from_file_location("grid", ROOT / "docs" / "study" / "grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_overrides(raw: dict, overrides: dict) -> dict:
    out = copy.deepcopy(raw)
    for key, value in overrides.items():
        section, name = key.split(".", 1) if "." in key else (None, key)
        (out[section] if section else out)[name] = value
    return out


def test_every_queued_run_is_a_valid_configuration(grid):
    """A typo in an arm's key or value would only show when the queue reaches it, hours later: the schema
    checks each run's params (params.yaml + COMMON + its overrides) up front, as `dvc exp run -S` would."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    arms = grid.arms()
    assert len({json.dumps(o, sort_keys=True) for _, o in arms}) == len(arms), "a run is listed twice"
    for arm, overrides in arms:
        p = params_mod.validate(with_overrides(raw, {**grid.COMMON, **overrides}))
        if overrides.get("train.max_steps"):
            assert p.train.max_samples == 0, arm


def test_every_queued_run_survives_the_yaml_that_dvc_writes(grid):
    """`dvc exp run -S train.lr_min=1e-05` writes `lr_min: 1e-05` into params.yaml (YAML 1.2), which
    YAML 1.1 reads as a string: every override, written as the grid prints it, must load as the value the
    grid means (params.load_yaml), or the run fails hours later in the queue."""
    for arm, overrides in grid.arms():
        for key, value in overrides.items():
            loaded = params_mod.load_yaml(f"v: {value}")["v"]
            assert loaded == value and type(loaded) is type(value), (arm, key, value, loaded)
    assert yaml.safe_load("v: 1e-05")["v"] == "1e-05"  # negative control: what plain PyYAML does


def test_a_run_of_one_arm_never_counts_for_another(grid):
    """is_archived compares every key any arm sets, at params.yaml's value where an arm leaves it: the
    no-clip k 4 run is not the steps arm's k 4, and a run archived before a key existed is at its default."""
    steps_k4 = next(o for a, o in grid.arms() if a == "steps" and o["train.accumulate_every"] == 4 and o["seed"] == 0)
    noclip_k4 = next(o for a, o in grid.arms() if a == "steps-noclip" and o["train.accumulate_every"] == 4
                     and o["seed"] == 0)
    logged = {k: str(v) for k, v in {**grid.COMMON, **noclip_k4}.items() if not k.startswith("mlflow.")}
    assert grid.is_archived(noclip_k4, [logged]) and not grid.is_archived(steps_k4, [logged])
    clipped = {**logged, "train.grad_clip": "1.0"}
    assert grid.is_archived(steps_k4, [clipped])
    older = {k: v for k, v in clipped.items() if k != "train.lr_schedule"}  # archived before lr_schedule existed
    assert grid.is_archived(steps_k4, [older])


def test_designs_select_their_archived_runs(grid):
    """`grid.py ids steps` is the equal-steps design: its own runs and the 1536-sample micro-batch 1 x k 1
    runs (1536 steps too), never a k > 1 equal-samples run. The 36 equal-samples runs are all archived."""
    done = grid.archived()
    steps_ids = set(grid.archived_ids(grid.design("steps")))
    records = [json.loads(p.read_text()) for p in sorted(grid.RUNS.glob("*.json"))]
    by_id = {r["run_id"]: r["params"] for r in records}
    assert steps_ids
    for rid in steps_ids:
        p = by_id[rid]
        assert p["train.batch_size"] == "1" and p["train.lr_scaling"] == "none"
        # never a run of an arm that changes another key (the no-clip arm's k 4 has k 4 and 1536 steps too)
        assert p.get("train.grad_clip", "1.0") == "1.0" and p.get("diffusion.loss", "l1") == "l1", rid
        assert p.get("train.lr_schedule", "constant") == "constant" and p.get("train.lr", "0.001") == "0.001", rid
        assert int(p["train.max_steps"]) == 1536 or (p["train.accumulate_every"] == "1"
                                                      and p["train.max_samples"] == "1536")
    k1 = [i for i, p in by_id.items() if p["train.batch_size"] == "1" and p["train.accumulate_every"] == "1"
          and p["train.max_samples"] == "1536" and p["train.lr_scaling"] == "none"
          and p.get("train.precision", "auto") == "auto"]  # the precision arm's fp32 run is not one of them
    assert set(k1) <= steps_ids
    assert not any(grid.is_archived(o, done) is False for a, o in grid.arms() if a == "main")
    assert all(a != "main" for a, _ in grid.missing())


def test_the_precision_arm_stays_out_of_the_other_designs(grid):
    """The fp32 run of the precision arm has every key of the main arm's micro-batch 1 x k 1 seed 0 run but
    train.precision: it must not count as that run (nor as a k = 1 seed of the equal-steps design), and the
    precision design must read it together with the bf16 runs of its setting."""
    (fp32,) = [o for a, o in grid.arms() if a == "precision"]
    record = {k: str(v) for k, v in {**grid.COMMON, **fp32}.items() if not k.startswith("mlflow.")}
    main_k1 = [o for a, o in grid.arms() if a == "main" and o["train.batch_size"] == 1
               and o["train.accumulate_every"] == 1 and o["seed"] == 0]
    assert main_k1 and not grid.is_archived(main_k1[0], [record])
    assert grid.is_archived(fp32, [record])
    # Control: the same record at precision auto is that main run.
    assert grid.is_archived(main_k1[0], [{**record, "train.precision": "auto"}])
    assert fp32 in grid.design("precision") and main_k1[0] in grid.design("precision")
    assert fp32 not in grid.design("steps")


def test_missing_keeps_only_the_arms_asked_for(grid):
    arms = {a for a, _ in grid.missing(["precision", "eps-pilot"])}
    assert arms <= {"precision", "eps-pilot"}


def test_the_epsilon_design_is_its_own_runs(grid):
    """The eps arm: epsilon-prediction without clipping, k 1 and 2 at equal steps, 2 seeds; the fp32 pilot
    (another length, another precision) is not one of its runs."""
    eps = [o for a, o in grid.arms() if a == "eps"]
    assert all(o["diffusion.prediction"] == "epsilon" and o["train.grad_clip"] == 0.0
               and o["train.max_steps"] == grid.EPS_STEPS for o in eps)
    assert {(o["seed"], o["train.accumulate_every"]) for o in eps} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    pilot = [o for a, o in grid.arms() if a == "eps-pilot"]
    assert len(pilot) == 1 and pilot[0] not in grid.design("eps")
    assert not any(o in grid.design("eps") for a, o in grid.arms() if a == "steps")


def test_the_lr_grid_design_holds_its_x1_point(grid):
    """The LR grid (x0.5, x2 of 1e-3 at k 1 and 8) reads its x1 point from the runs that already have it:
    the 1536-sample k = 1 runs and the equal-steps arm's k = 8; no other batch, no other arm's key."""
    design = grid.design("steps-lr")
    lrs = {(o["train.accumulate_every"], o.get("train.lr")) for o in design}
    assert lrs == {(1, None), (8, None), (1, 5e-4), (1, 2e-3), (8, 5e-4), (8, 2e-3)}
    steps_k8 = [o for a, o in grid.arms() if a == "steps" and o["train.accumulate_every"] == 8]
    assert steps_k8 and all(o in design for o in steps_k8)
    assert not any(o.get("train.grad_clip") == 0.0 or o.get("diffusion.loss") == "l2" for o in design)


def test_the_data_size_arms_share_validation_and_pair_by_seed(grid, monkeypatch):
    """Every data-size run validates on the same subjects, draws and grid in samples whatever its N and k, and
    every k > 1 run has a k 1 partner of the same seed and N (the paired analysis reads pairs). Until the LR
    pilot has chosen the lr, only the pilot is in the grid."""
    assert grid.DS_LR in grid.DS_LR_GRID  # chosen by the pilot
    assert [o["train.lr"] for a, o in grid.arms() if a == "ds-lr"] == list(grid.DS_LR_GRID)
    monkeypatch.setattr(grid, "DS_LR", None)
    assert not [a for a, _ in grid.arms() if a.startswith("data-size")]  # no arm before the pilot has chosen
    monkeypatch.setattr(grid, "DS_LR", 5.0e-4)
    runs = [o for a, o in grid.arms() if a.startswith("data-size")]
    assert len(runs) == sum(len(ks) * len(seeds) for _, ks, seeds in grid.DS_DESIGN) == 25
    shared = ("data.subjects", "data.val_subjects", "train.val_every_samples", "train.val_draws", "train.val_seed")
    assert len({tuple(o.get(k, grid.COMMON.get(k)) for k in shared) for o in runs}) == 1
    pairs = {(o["data.train_subjects"], o["seed"]) for o in runs if o["train.accumulate_every"] == 1}
    assert all((o["data.train_subjects"], o["seed"]) in pairs for o in runs if o["train.accumulate_every"] > 1)
    assert {o["diffusion.prediction"] for o in runs} == {"epsilon"} and {o["train.grad_clip"] for o in runs} == {0.0}
    assert {o["train.max_samples"] for o in runs} == {grid.DS_CAP}  # one cap, in samples, for every k


def test_the_largest_ns_pairs_grow_as_the_sample_size_rule_asks(grid, monkeypatch):
    """With five N = 160 pairs whose sd(r) leaves the MDE above 5 %, the grid lists seed 5's k 1 and k 2 (and only
    those: k 4 and the other N keep their seeds); with a tight spread it stays at five."""
    def design_with(ratios):
        levels = ({s: 0.05 * r for s, r in enumerate(ratios)}, {s: 0.05 for s in range(len(ratios))})
        monkeypatch.setattr(grid, "ds_archived_levels", lambda: levels)
        return [(o["data.train_subjects"], o["train.accumulate_every"], o["seed"])
                for a, o in grid.arms() if a.startswith("data-size")]

    wide = design_with([1.0, 1.04, 0.96, 1.05, 0.95])
    assert (160, 1, 5) in wide and (160, 2, 5) in wide and len(wide) == 27
    assert (160, 4, 5) not in wide and (40, 1, 5) not in wide
    assert len(design_with([1.0, 1.015, 0.985, 1.0, 1.02])) == 25
    assert len(design_with([])) == 25  # nothing archived: the design as registered


def test_the_sample_size_rule_reads_the_archived_pairs_levels(grid, monkeypatch, tmp_path):
    """ds_archived_levels on a real archive: the N = 40 pairs, relabelled N = 160, give each run's own-best level
    (the data-size report's run_best) by seed and k; other runs stay out."""
    from voxdiff.report.groups import run_best
    from voxdiff.report.loading import record_to_run

    n40 = [p for p in sorted(grid.RUNS.glob("*.json"))
           if json.loads(p.read_text())["params"].get("data.train_subjects") == "40"]
    assert len(n40) == 6
    expected = {}
    for p in n40:
        record = json.loads(p.read_text())
        record["params"]["data.train_subjects"] = "160"
        (tmp_path / p.name).write_text(json.dumps(record))
        k, seed = int(record["params"]["train.accumulate_every"]), int(record["params"]["seed"])
        expected.setdefault(k, {})[seed] = run_best(record_to_run(record)).level
    other = next(p for p in sorted(grid.RUNS.glob("*.json")) if p not in n40)
    (tmp_path / other.name).write_text(other.read_text())
    monkeypatch.setattr(grid, "RUNS", tmp_path)
    grid.records.cache_clear(), grid.ds_archived_levels.cache_clear()
    try:
        assert grid.ds_archived_levels() == (expected[2], expected[1])
        assert len(expected[1]) == len(expected[2]) == 3
    finally:
        monkeypatch.undo()
        grid.records.cache_clear(), grid.ds_archived_levels.cache_clear()
