#!/usr/bin/env bash
# The shipped CPU study (make study): accumulate_every 1/2/4/8 x seeds 0/1/2 at a fixed sample budget,
# plus square-root LR scaling at accumulate_every 8 (seeds 0/1), on the built-in MNI152 data; then the reports.
# About 30 minutes on 2 CPU cores (micro-batch 2: on CPU, batch-1 3D convolutions take a slow path). Rerun it from a clean checkout to reproduce docs/study/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
EXP=voxdiff-study
COMMON=(-S train.max_samples=384 -S train.batch_size=2 -S train.val_every_samples=16 -S train.checkpoint_every=32
        -S evaluate.subjects=1 -S evaluate.samples_per_condition=2 -S "mlflow.experiment=$EXP")

git diff --quiet HEAD -- src stages dvc.yaml params.yaml || { echo "commit your changes first: queued runs use committed files" >&2; exit 1; }
dvc repro preprocess
dvc exp run --queue "${COMMON[@]}" -S train.lr_scaling=none -S 'train.accumulate_every=1,2,4,8' -S 'seed=0,1,2'
dvc exp run --queue "${COMMON[@]}" -S train.lr_scaling=sqrt -S train.accumulate_every=8 -S 'seed=0,1'
bash docs/study/wait_queue.sh

voxdiff compare --experiment "$EXP" --filter "params.\`train.lr_scaling\` = 'none'" \
  --out docs/study/report.md
voxdiff compare --experiment "$EXP" --filter "params.\`train.accumulate_every\` = '8'" \
  --group-by train.lr_scaling --out docs/study/lr_scaling.md --no-log
python -c "import sys, torch, monai, mlflow, dvc; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, monai {monai.__version__}, mlflow {mlflow.__version__}, dvc {dvc.__version__}')" > docs/study/versions.txt
