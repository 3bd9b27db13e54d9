"""params.yaml: load, validate every key up front, expose typed sections.

The schema below is the only place that knows the keys. There are no defaults here: a key missing
from params.yaml is an error, so the file stays the single source of truth.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from voxdiff.runtime.errors import ParamsError

# --- checks -------------------------------------------------------------------------------------
Check = Callable[[str, Any], Any]


def _fail(key: str, want: str, got: Any) -> ParamsError:
    return ParamsError(f"params.yaml: {key} must be {want}, got {got!r}")


def integer(lo: int | None = None) -> Check:
    def check(key, v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            raise _fail(key, f"an integer >= {lo}" if lo is not None else "an integer", v)
        return v

    return check


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Check:
    def check(key, v):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
        if not ok:
            bounds = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
            bounds += (" and " if bounds and hi is not None else "") + (f"<= {hi}" if hi is not None else "")
            raise _fail(key, f"a finite number {bounds}".strip(), v)
        return float(v)

    return check


def choice(*options: str) -> Check:
    def check(key, v):
        if v not in options:
            raise _fail(key, "one of " + ", ".join(options), v)
        return v

    return check


def text(allow_empty: bool = True) -> Check:
    def check(key, v):
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            raise _fail(key, "a string" if allow_empty else "a non-empty string", v)
        return v

    return check


def boolean(key, v):
    if not isinstance(v, bool):
        raise _fail(key, "true or false", v)
    return v


def int_list(length: int | None = None, lo: int = 0, unique_sorted: bool = False, allow_empty: bool = False) -> Check:
    def check(key, v):
        want = ("[] or " if allow_empty else "") + f"a list of {length or ''} integers >= {lo}".replace("  ", " ")
        if not isinstance(v, list) or (not v and not allow_empty) or (length and len(v) != length):
            raise _fail(key, want, v)
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int) or x < lo:
                raise _fail(key, want, v)
        if unique_sorted and (len(set(v)) != len(v)):
            raise _fail(key, "a list of distinct integers", v)
        return tuple(v)

    return check


def number_list(length: int, lo: float, hi: float | None = None, lo_open: bool = True) -> Check:
    one = number(lo, hi, lo_open)

    def check(key, v):
        if not isinstance(v, list) or len(v) != length:
            raise _fail(key, f"a list of {length} numbers", v)
        return tuple(one(key, x) for x in v)

    return check


def sigma_rels(lo_len: int) -> Check:
    """Distinct post-hoc EMA lengths in (0, MAX_SIGMA_REL); an empty list (off) or at least lo_len."""
    hi = 0.28  # voxdiff.training.posthoc_ema.MAX_SIGMA_REL (not imported: params loads without torch)

    def check(key, v):
        want = f"[] or a list of at least {lo_len} distinct numbers in (0, {hi})"
        if not isinstance(v, list) or (v and len(v) < lo_len) or len(set(map(str, v))) != len(v):
            raise _fail(key, want, v)
        for x in v:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < hi:
                raise _fail(key, want, v)
        return tuple(float(x) for x in v)

    return check


def bool_list(key, v):
    if not isinstance(v, list) or not v or not all(isinstance(x, bool) for x in v):
        raise _fail(key, "a list of true/false", v)
    return tuple(v)


# --- schema: section -> key -> check --------------------------------------------------------------
SCHEMA: dict[str, dict[str, Check] | Check] = {
    "seed": integer(0),
    "data": {
        "seed": integer(0),
        "source": text(allow_empty=False),
        "subjects": integer(2),
        "synth_spacing": number(0.5, 8.0),
        "image_glob": text(allow_empty=False),
        "label_glob": text(allow_empty=False),
        "manifest": text(),
        "label_values": int_list(lo=0, unique_sorted=True),
        "val_subjects": integer(1),
        "train_subjects": integer(0),
    },
    "preprocess": {
        "spacing": number_list(3, 0.0),
        "shape": int_list(3, lo=8),
        "clip_percentiles": number_list(2, 0.0, 100.0, lo_open=False),
    },
    "model": {
        "channels": int_list(lo=1),
        "attention_levels": bool_list,
        "num_res_blocks": integer(1),
        "norm_num_groups": integer(1),
        "num_head_channels": integer(1),
        "activation_checkpointing": boolean,
    },
    "diffusion": {
        "timesteps": integer(2),
        "schedule": choice("linear_beta", "scaled_linear_beta", "sigmoid_beta", "cosine"),
        "prediction": choice("epsilon", "sample", "v_prediction"),
        "loss": choice("l1", "l2"),
        "min_snr_gamma": number(0.0),
    },
    "train": {
        "batch_size": integer(1),
        "accumulate_every": integer(1),
        "max_steps": integer(0),
        "max_samples": integer(0),
        "lr": number(0.0, lo_open=True),
        "lr_scaling": choice("none", "linear", "sqrt", "sde"),
        "adam_betas": number_list(2, 0.0, 1.0, lo_open=False),
        "adam_eps": number(0.0, lo_open=True),
        "reference_batch": integer(1),
        "warmup_samples": integer(0),
        "lr_schedule": choice("constant", "cosine", "linear"),
        "lr_min": number(0.0),
        "grad_clip": number(0.0),
        "ema_halflife_samples": number(0.0, lo_open=True),
        "ema_rampup_ratio": number(0.0),
        "precision": choice("auto", "fp32", "bf16", "fp16"),
        "fp16_max_skipped_steps": integer(1),
        "device": text(allow_empty=False),
        "tf32": boolean,
        "compile": boolean,
        "deterministic": boolean,
        "val_every_samples": integer(1),
        "val_draws": integer(1),
        "val_seed": integer(0),
        "checkpoint_every": integer(1),
        "gns_smoothing": number(0.0, 0.999),
        "gns_buckets": integer(1),
        "gns_bucket_samples": integer(3),
        "gns_buckets_every_samples": integer(0),
        "gns_probe_samples": integer(0),
        "gns_ci_level": number(0.0, 0.999, lo_open=True),
        "phema_sigma_rels": sigma_rels(2),
        "phema_snapshots": integer(1),
        "phema_eval_sigma_rels": sigma_rels(1),
        "early_stop_patience_samples": integer(0),
        "keep_checkpoints_at_samples": int_list(lo=1, unique_sorted=True, allow_empty=True),
    },
    "evaluate": {
        "subjects": integer(0),
        "samples_per_condition": integer(1),
        "sampling_steps": integer(1),
        "sampler": choice("ddim", "ancestral"),
        "ddim_eta": number(0.0, 1.0),
        "ancestral": boolean,
        "checkpoint": choice("best", "final"),
        "segmenter_steps": integer(0),
        "segmenter_channels": int_list(lo=1),
        "segmenter_seeds": integer(1),
        "tstr_samples_per_map": integer(0),
        "tstr_sampling_steps": integer(0),
    },
    "mlflow": {
        "experiment": text(allow_empty=False),
        "tracking_uri": text(),
        "system_metrics": boolean,
        "system_metrics_interval_s": number(1.0),
    },
}


# --- typed sections -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Data:
    seed: int
    source: str
    subjects: int
    synth_spacing: float
    image_glob: str
    label_glob: str
    manifest: str
    label_values: tuple[int, ...]
    val_subjects: int
    train_subjects: int

    @property
    def builtin(self) -> bool:
        return self.source == "mni152"

    @property
    def num_classes(self) -> int:
        return len(self.label_values)


@dataclasses.dataclass(frozen=True)
class Preprocess:
    spacing: tuple[float, float, float]
    shape: tuple[int, int, int]
    clip_percentiles: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Model:
    channels: tuple[int, ...]
    attention_levels: tuple[bool, ...]
    num_res_blocks: int
    norm_num_groups: int
    num_head_channels: int
    activation_checkpointing: bool


@dataclasses.dataclass(frozen=True)
class Diffusion:
    timesteps: int
    schedule: str
    prediction: str
    loss: str
    min_snr_gamma: float


@dataclasses.dataclass(frozen=True)
class Train:
    batch_size: int
    accumulate_every: int
    max_steps: int
    max_samples: int
    lr: float
    lr_scaling: str
    adam_betas: tuple[float, float]
    adam_eps: float
    reference_batch: int
    warmup_samples: int
    lr_schedule: str
    lr_min: float
    grad_clip: float
    ema_halflife_samples: float
    ema_rampup_ratio: float
    precision: str
    fp16_max_skipped_steps: int
    device: str
    tf32: bool            # CUDA: TF32 for fp32 matmuls/convolutions (runtime/distributed.py: configure_backends)
    compile: bool         # torch.compile the network being trained
    deterministic: bool   # CUDA: deterministic kernels (configure_backends)
    val_every_samples: int
    val_draws: int
    val_seed: int
    checkpoint_every: int
    gns_smoothing: float
    gns_buckets: int
    gns_bucket_samples: int
    gns_buckets_every_samples: int
    gns_probe_samples: int
    gns_ci_level: float
    phema_sigma_rels: tuple[float, ...]
    phema_snapshots: int
    phema_eval_sigma_rels: tuple[float, ...]
    early_stop_patience_samples: int
    keep_checkpoints_at_samples: tuple[int, ...]


# What a change to each train.* key invalidates (docs/exactness.md, "What a change invalidates"). One list, read
# by the trainer's fingerprint (training/trainer.py) and by compare's "same configuration" (report/groups.py).
# Measurement-only: what is measured during training, never a weight (validation and the probes touch neither
# .grad, the optimizer nor any RNG: tests/test_training_controls.py; the post-hoc EMA profiles are averaged
# beside the model, never fed back into it): a change keeps the run and is recorded. phema_sigma_rels: a resumed
# run keeps the profiles it started with (EDM2's reconstruction needs each to span the run from its first step).
MEASUREMENT_KEYS = ("val_every_samples", "val_draws", "val_seed", "gns_smoothing", "gns_buckets",
                    "gns_bucket_samples", "gns_buckets_every_samples", "gns_probe_samples", "gns_ci_level",
                    "phema_sigma_rels", "phema_snapshots", "phema_eval_sigma_rels")
# Where and how often the run is written and run (keep_checkpoints_at_samples: extra copies of the checkpoint): no
# effect on the trajectory. precision is not here
# because its *resolved* value is part of the fingerprint (auto resolves per machine). compile is: it runs
# the same maths through other kernels (rounding differs at the last bits, as between two GPUs, and the
# device is operational too), so a run may be resumed with or without it. tf32 and deterministic are NOT
# here, so they stay in the fingerprint: tf32 changes the number format of every fp32 matmul and
# convolution on CUDA (a 10-bit mantissa), like the precision, and a user turns it off to check exactness,
# which a run made with it on must not stand for; deterministic is what a run-to-run equality claim rests
# on, which a run resumed without it would break. On the CPU both are no-ops, so toggling them there
# retrains for nothing; DVC reruns the stage for any train.* change anyway.
OPERATIONAL_KEYS = ("checkpoint_every", "device", "precision", "fp16_max_skipped_steps", "compile",
                    "keep_checkpoints_at_samples")


@dataclasses.dataclass(frozen=True)
class Evaluate:
    subjects: int
    samples_per_condition: int
    sampling_steps: int
    sampler: str                  # ddim | ancestral: the sampler of the samples_per_condition volumes
    ddim_eta: float               # DDIM's eta (0 = deterministic given the starting noise)
    ancestral: bool
    checkpoint: str
    segmenter_steps: int          # Segmentation Dice (evaluation/segmenter.py); 0 = off
    segmenter_channels: tuple[int, ...]
    segmenter_seeds: int
    tstr_samples_per_map: int     # train on synthetic, test on real; 0 = off
    tstr_sampling_steps: int      # DDIM steps of its volumes; 0 = sampling_steps


@dataclasses.dataclass(frozen=True)
class Mlflow:
    experiment: str
    tracking_uri: str
    system_metrics: bool
    system_metrics_interval_s: float


@dataclasses.dataclass(frozen=True)
class Params:
    seed: int
    data: Data
    preprocess: Preprocess
    model: Model
    diffusion: Diffusion
    train: Train
    evaluate: Evaluate
    mlflow: Mlflow
    raw: dict = dataclasses.field(compare=False, repr=False)

    def flat(self) -> dict[str, Any]:
        """Every key with a dotted name (`train.accumulate_every`), as MLflow params."""
        return flatten(self.raw)


_SECTIONS = {"data": Data, "preprocess": Preprocess, "model": Model, "diffusion": Diffusion,
             "train": Train, "evaluate": Evaluate, "mlflow": Mlflow}


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def validate(raw: Any) -> Params:
    """Check every key of a parsed params.yaml and return typed params (or raise ParamsError)."""
    if not isinstance(raw, dict):
        raise ParamsError("params.yaml: expected a mapping of sections at the top level")
    unknown = sorted(set(raw) - set(SCHEMA))
    if unknown:
        raise ParamsError(f"params.yaml: unknown key {unknown[0]!r} (known: {', '.join(SCHEMA)})")
    values: dict[str, Any] = {}
    for section, spec in SCHEMA.items():
        if section not in raw:
            raise ParamsError(f"params.yaml: missing key {section!r}")
        if callable(spec):
            values[section] = spec(section, raw[section])
            continue
        given = raw[section]
        if not isinstance(given, dict):
            raise ParamsError(f"params.yaml: {section} must be a mapping of keys")
        extra = sorted(set(given) - set(spec))
        if extra:
            raise ParamsError(f"params.yaml: unknown key {section}.{extra[0]} (known: {', '.join(spec)})")
        checked = {}
        for key, check in spec.items():
            if key not in given:
                raise ParamsError(f"params.yaml: missing key {section}.{key}")
            checked[key] = check(f"{section}.{key}", given[key])
        values[section] = _SECTIONS[section](**checked)
    p = Params(**values, raw=raw)
    _cross_checks(p)
    return p


def _cross_checks(p: Params) -> None:
    t, m, d = p.train, p.model, p.data
    if (t.max_steps > 0) == (t.max_samples > 0):
        raise ParamsError("params.yaml: set exactly one of train.max_steps and train.max_samples "
                          f"(the other 0), got max_steps={t.max_steps}, max_samples={t.max_samples}")
    if len(m.attention_levels) != len(m.channels):
        raise ParamsError(f"params.yaml: model.attention_levels must have {len(m.channels)} entries "
                          f"(one per model.channels level), got {len(m.attention_levels)}")
    bad = [c for c in m.channels if c % m.norm_num_groups]
    if bad:
        raise ParamsError(f"params.yaml: model.norm_num_groups={m.norm_num_groups} must divide every "
                          f"model.channels entry, not {bad[0]}")
    attn = [c for c, a in zip(m.channels, m.attention_levels) if a and c % m.num_head_channels]
    if attn:
        raise ParamsError(f"params.yaml: model.num_head_channels={m.num_head_channels} must divide the channels of "
                          f"every attention level, not {attn[0]}")
    if t.phema_sigma_rels and not t.phema_eval_sigma_rels:
        raise _fail("train.phema_eval_sigma_rels", "at least one EMA length to reconstruct when "
                    "train.phema_sigma_rels is set", [])
    if p.diffusion.min_snr_gamma > 0 and p.diffusion.loss == "l1":
        # min(SNR, gamma) makes the three prediction targets equivalent for the squared error only:
        # with L1 the same x0 error weighs 0.187 / 0.0054 / 0.0054 (sample / epsilon / v) at t = 2.
        raise ParamsError("params.yaml: diffusion.min_snr_gamma > 0 needs diffusion.loss: l2 (min-SNR weighting "
                          f"is derived for the squared error; with l1 it weighs the targets differently), got "
                          f"min_snr_gamma={p.diffusion.min_snr_gamma:g} with loss l1")
    if t.lr_schedule != "constant" and t.lr_min > t.lr:
        raise ParamsError(f"params.yaml: train.lr_min ({t.lr_min:g}) must not exceed train.lr ({t.lr:g}) "
                          f"for lr_schedule {t.lr_schedule}")
    past = [n for n in t.keep_checkpoints_at_samples if t.max_samples and n > t.max_samples]
    if past:
        raise ParamsError(f"params.yaml: train.keep_checkpoints_at_samples holds {past[0]}, past the run's end "
                          f"(train.max_samples {t.max_samples}): no copy would be kept there")
    if any(not 0 <= b < 1 for b in t.adam_betas):
        raise _fail("train.adam_betas", "two numbers in [0, 1)", list(t.adam_betas))
    down = 2 ** (len(m.channels) - 1)
    if any(s % down for s in p.preprocess.shape):
        raise ParamsError(f"params.yaml: preprocess.shape {list(p.preprocess.shape)} must be divisible by "
                          f"{down} (2^(levels-1) for {len(m.channels)} model.channels levels)")
    if len(d.label_values) < 2:
        raise ParamsError("params.yaml: data.label_values needs at least 2 values (background and one class)")
    lo, hi = p.preprocess.clip_percentiles
    if lo >= hi:
        raise ParamsError(f"params.yaml: preprocess.clip_percentiles must be increasing, got {[lo, hi]}")
    if not (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:")):
        raise _fail("train.device", "auto, cpu, cuda or cuda:N", t.device)
    ev = p.evaluate
    if len(ev.segmenter_channels) < 2:
        raise _fail("evaluate.segmenter_channels", "a list of at least 2 channel counts (UNet levels)",
                    list(ev.segmenter_channels))
    seg_down = 2 ** (len(ev.segmenter_channels) - 1)
    if ev.segmenter_steps and any(s % seg_down for s in p.preprocess.shape):
        raise ParamsError(f"params.yaml: preprocess.shape {list(p.preprocess.shape)} must be divisible by {seg_down} "
                          f"(2^(levels-1) for {len(ev.segmenter_channels)} evaluate.segmenter_channels levels)")
    if d.builtin and d.val_subjects >= d.subjects:
        raise ParamsError(f"params.yaml: data.val_subjects ({d.val_subjects}) must be smaller than "
                          f"data.subjects ({d.subjects}) so that some subjects are left to train on")
    if d.builtin and d.train_subjects > d.subjects - d.val_subjects:
        raise ParamsError(f"params.yaml: data.train_subjects ({d.train_subjects}) exceeds the "
                          f"{d.subjects - d.val_subjects} training subjects (data.subjects {d.subjects} less "
                          f"data.val_subjects {d.val_subjects})")


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where a float needs a dot: `lr_min: 1e-05`, which is what `dvc exp run -S
    train.lr_min=1e-5` writes (DVC's ruamel speaks YAML 1.2), would load as the string '1e-05'. This
    loader reads YAML 1.2's floats too (PyYAML has no 1.2 mode; ruamel would be a second YAML library)."""


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def load_yaml(text: str):
    """params.yaml's text as Python values, with YAML 1.2 floats (`_Yaml12Floats`)."""
    return yaml.load(text, Loader=_Yaml12Floats)  # noqa: S506 - a SafeLoader subclass


def load(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return validate(raw)
