#!/usr/bin/env bash
# Rebuild the study's reports from the archive alone (no MLflow store needed): docs/study/runs -> *.md
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
R=docs/study/runs
# The equal-samples design (the first 36 runs): every run trained 1536 samples, at precision auto.
SAMPLES="params.\`train.max_samples\` = '1536' and params.\`train.lr_scaling\` = 'none' and params.\`train.precision\` = 'auto'"
voxdiff compare --runs $R --filter "$SAMPLES and params.\`train.batch_size\` = '2'" --out docs/study/report.md
voxdiff compare --runs $R --filter "$SAMPLES and params.\`train.batch_size\` = '1'" \
  --out docs/study/report_micro1.md || echo "(no micro-batch 1 runs archived yet)"
# The equal-steps design: micro-batch 1 x k for 1536 optimizer steps each (its k = 1 arm: the 1536-sample
# k = 1 runs above); grid.py names its runs.
voxdiff compare --runs $R --filter "$(python docs/study/grid.py ids steps)" --out docs/study/report_steps.md \
  || echo "(no equal-steps runs archived yet)"
# Effective batch 1 and 4 at twice the steps (3072): does each reach its plateau, and at the same level?
voxdiff compare --runs $R --filter "$(python docs/study/grid.py ids steps-long)" --out docs/study/report_steps_long.md \
  || echo "(no steps-long runs archived yet)"
# The precision arm: micro-batch 1 x k 1 in fp32 against the same setting's bf16 runs.
voxdiff compare --runs $R --group-by precision_resolved --filter "$(python docs/study/grid.py ids precision)" \
  --out docs/study/report_precision.md || echo "(no precision run archived yet)"
# med-ddpm's regime (epsilon-prediction, L1, no clipping): micro-batch 1 x k 1 and 2 at equal steps, the
# 6144-step pilot as the k = 1 seed 0 run.
voxdiff compare --runs $R --filter "$(python docs/study/grid.py ids eps)" --out docs/study/report_eps.md \
  || echo "(no epsilon runs archived yet)"
# med-ddpm's regime to its plateau: k 1 and 2 at 16,384 steps.
voxdiff compare --runs $R --filter "$(python docs/study/grid.py ids eps-long)" --out docs/study/report_eps_long.md \
  || echo "(no eps-long runs archived yet)"
# The arms that test why the noise scale misses: the equal-steps design with clipping off, with the L2 loss,
# with a cosine LR decay (effective batch 1 and 4 each).
for arm in noclip l2 cosine; do
  ids=$(python docs/study/grid.py ids "steps-$arm") && \
    voxdiff compare --runs $R --filter "$ids" --out "docs/study/report_steps_$arm.md" \
    || echo "(no steps-$arm runs archived yet)"
done
# LR per batch (x0.5, x1, x2 of 1e-3 at effective batch 1 and 8, equal steps): one report per effective
# batch, grouped by train.lr: which LR is best at each batch, and does the ranking of the batches survive?
lr_ids=$(python docs/study/grid.py ids steps-lr) || lr_ids=""
for k in 1 8; do
  [ -n "$lr_ids" ] && voxdiff compare --runs $R --group-by train.lr \
    --filter "$lr_ids and params.\`train.accumulate_every\` = '$k'" --out "docs/study/report_steps_lr_k$k.md" \
    || echo "(no steps-lr runs at k $k archived yet)"
done
# One report per LR rule (micro-batch 2, accumulate_every 1 and 8): does the gap between them shrink?
for rule in sqrt linear sde; do
  voxdiff compare --runs $R --filter "params.\`train.max_samples\` = '1536' and params.\`train.lr_scaling\` = '$rule' and params.\`train.batch_size\` = '2'" \
    --out "docs/study/report_lr_$rule.md" || echo "(no lr_scaling=$rule runs archived yet)"
done
# Data size (docs/study/data-size-protocol.md): the LR pilot at N 160 grouped by lr, then one report per N
# (k 1/2, and 4 at N 160), paired by seed in the own-best table.
ids=$(python docs/study/grid.py ids ds-lr) && \
  voxdiff compare --runs $R --group-by train.lr --filter "$ids" --out docs/study/report_ds_lr.md \
  || echo "(no ds-lr runs archived yet)"
for n in 160 40 10; do
  ids=$(python docs/study/grid.py ids "data-size-$n") && \
    voxdiff compare --runs $R --filter "$ids" --smoothing 3 --out "docs/study/report_data_size_$n.md" \
    || echo "(no data-size-$n runs archived yet)"
done
# The data-size answer: k against 1 paired by seed per N, and B_crit against N (registered method).
python -m voxdiff.report.data_size $R docs/study/report_data_size.md
python -c "import sys, torch, monai, mlflow, dvc; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, monai {monai.__version__}, mlflow {mlflow.__version__}, dvc {dvc.__version__}')" > docs/study/versions.txt
