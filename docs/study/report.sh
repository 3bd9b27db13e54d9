#!/usr/bin/env bash
# Rebuild the study's reports from the archive alone (no MLflow store needed): docs/study/runs -> *.md
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
R=docs/study/runs

# report ARM OUT [--and FILTER] [compare options]: the report of one design of docs/study/grid.py from its archived
# runs (grid.py ids; FILTER narrows them), or one line when none is archived yet. Anything else that fails (a crash,
# a bad filter, an unknown arm) stops the rebuild with its exit code, so no stale report passes for a new one.
report() {
  local arm=$1 out=$2 ids rc=0 extra=""
  shift 2
  if [ "${1:-}" = --and ]; then extra=" and $2"; shift 2; fi
  ids=$(python docs/study/grid.py ids "$arm") || rc=$?
  if [ "$rc" -eq 3 ]; then echo "(no $arm runs archived yet: $out not rebuilt)"; return 0; fi
  [ "$rc" -eq 0 ] || exit "$rc"
  voxdiff compare --runs "$R" --filter "$ids$extra" --out "$out" "$@"
}

# The equal-samples design (the first 36 runs, 1536 samples each): micro-batch 2, then med-ddpm's micro-batch 1.
report main docs/study/report.md --and "params.\`train.batch_size\` = '2'"
report main docs/study/report_micro1.md --and "params.\`train.batch_size\` = '1'"
# The equal-steps design: micro-batch 1 x k for 1536 optimizer steps each (its k = 1 arm: the 1536-sample
# k = 1 runs above; grid.py's design names them).
report steps docs/study/report_steps.md
# Effective batch 1 and 4 at twice the steps (3072): does each reach its plateau, and at the same level?
report steps-long docs/study/report_steps_long.md
# The precision arm: micro-batch 1 x k 1 in fp32 against the same setting's bf16 runs.
report precision docs/study/report_precision.md --group-by precision_resolved
# med-ddpm's regime (epsilon-prediction, L1, no clipping): micro-batch 1 x k 1 and 2 at equal steps, the
# 6144-step pilot as the k = 1 seed 0 run; then the same to its plateau, k 1 and 2 at 16,384 steps.
report eps docs/study/report_eps.md
report eps-long docs/study/report_eps_long.md
# The arms that test why the noise scale misses: the equal-steps design with clipping off, with the L2 loss,
# with a cosine LR decay (effective batch 1 and 4 each).
for arm in noclip l2 cosine; do
  report "steps-$arm" "docs/study/report_steps_$arm.md"
done
# LR per batch (x0.5, x1, x2 of 1e-3 at effective batch 1 and 8, equal steps): one report per effective
# batch, grouped by train.lr: which LR is best at each batch, and does the ranking of the batches survive?
for k in 1 8; do
  report steps-lr "docs/study/report_steps_lr_k$k.md" --and "params.\`train.accumulate_every\` = '$k'" --group-by train.lr
done
# One report per LR rule (micro-batch 2, accumulate_every 1 and 8): does the gap between them shrink?
for rule in sqrt linear sde; do
  report "lr-$rule" "docs/study/report_lr_$rule.md"
done
# Data size (docs/study/data-size-protocol.md): the LR pilot at N 160 grouped by lr, then one report per N
# (k 1/2, and 4 at N 160), paired by seed in the own-best table.
report ds-lr docs/study/report_ds_lr.md --group-by train.lr
for n in 160 40 10; do
  report "data-size-$n" "docs/study/report_data_size_$n.md" --smoothing 3
done
# The data-size answer: k against 1 paired by seed per N, and B_crit against N (registered method).
python -m voxdiff.report.data_size $R docs/study/report_data_size.md
python -c "import sys, torch, monai, mlflow, dvc; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, monai {monai.__version__}, mlflow {mlflow.__version__}, dvc {dvc.__version__}')" > docs/study/versions.txt
