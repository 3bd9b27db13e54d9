#!/usr/bin/env bash
# Rebuild the study's reports from the archive alone (no MLflow store needed): docs/study/runs -> *.md
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
R=docs/study/runs
voxdiff compare --runs $R --filter "params.\`train.lr_scaling\` = 'none' and params.\`train.batch_size\` = '2'" \
  --out docs/study/report.md
voxdiff compare --runs $R --filter "params.\`train.lr_scaling\` = 'none' and params.\`train.batch_size\` = '1'" \
  --out docs/study/report_micro1.md || echo "(no micro-batch 1 runs archived yet)"
voxdiff compare --runs $R --filter "params.\`train.accumulate_every\` = '8' and params.\`train.batch_size\` = '2'" \
  --group-by train.lr_scaling --out docs/study/lr_scaling.md || echo "(no LR-rule runs archived yet)"
python -c "import sys, torch, monai, mlflow, dvc; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, monai {monai.__version__}, mlflow {mlflow.__version__}, dvc {dvc.__version__}')" > docs/study/versions.txt
