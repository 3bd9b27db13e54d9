#!/usr/bin/env bash
# make ui-shot: the MLflow UI's comparison of runs at equal samples (val loss against samples seen and
# against training time, runs grouped by train.accumulate_every) as a user sees it: a real `mlflow server`,
# headless Chromium (Debian's package, installed if missing), a PNG. The work is in docs/ui_shot.py.
#   make ui-shot                                   # the study's micro-batch 1 x k 1/2/4/8 runs -> docs/mlflow-compare.png
#   UI_DB=mlflow.db UI_EXPERIMENT=voxdiff UI_FILTER= UI_OUT=/tmp/mine.png make ui-shot   # your own store
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
args=(--out "${UI_OUT:-docs/mlflow-compare.png}" --experiment "${UI_EXPERIMENT:-voxdiff-study}")
[ -n "${UI_DB:-}" ] && args+=(--db "$UI_DB")
[ -n "${UI_RUNS:-}" ] && args+=(--runs "$UI_RUNS")
[ -n "${UI_FILTER+set}" ] && args+=(--filter "$UI_FILTER")
exec timeout 600 python docs/ui_shot.py "${args[@]}"
