#!/usr/bin/env bash
# The benchmark suite on CUDA at med-ddpm's size (params-gpu.yaml: 128^3, 64 base channels, batch 1,
# bf16 autocast), eager and with torch.compile, in under 5 minutes; prints one table.
#
#   benchmarks/gpu.sh                      # from the repository root or anywhere
#   benchmarks/gpu.sh --set train.precision=fp16
#
# The eager run is the whole suite (run.py's "gpu" profile); the compiled run repeats the in-process
# training-step benchmarks (compiling once per fresh worker process would eat the time budget).
# Each run has a time limit (EAGER_LIMIT=190, COMPILE_LIMIT=100 seconds; raise them on a slower GPU);
# what finished is kept (results are written after every benchmark).
# Written without a GPU at hand: the plumbing was smoke-tested with `DEVICE=cpu benchmarks/gpu.sh
# --params params.yaml ...` (not a measurement); the CUDA timings and limits are estimates.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/.scratch
mkdir -p "$OUT"
# 6 built-in subjects are enough for timing (params-gpu.yaml synthesises 64).
COMMON=(--gpu --device "${DEVICE:-cuda}" --set data.subjects=6 --set data.val_subjects=2 "$@")
rm -f "$OUT/results-gpu-eager.json" "$OUT/results-gpu-compiled.json"

timeout "${EAGER_LIMIT:-190}" "$PY" benchmarks/run.py "${COMMON[@]}" --out "$OUT/results-gpu-eager.json" \
  || echo "gpu.sh: eager run stopped (exit $?): the table shows what finished" >&2
timeout "${COMPILE_LIMIT:-100}" "$PY" benchmarks/run.py "${COMMON[@]}" --compile --only medddpm,gns \
  --out "$OUT/results-gpu-compiled.json" \
  || echo "gpu.sh: compiled run stopped (exit $?): the table shows what finished" >&2

echo
echo "== voxdiff on CUDA, params-gpu.yaml (128^3, 64 base channels, batch 1, bf16): eager vs torch.compile =="
files=() labels=()
for kind in eager compiled; do
  if [[ -f "$OUT/results-gpu-$kind.json" ]]; then files+=("$OUT/results-gpu-$kind.json"); labels+=("$kind"); fi
done
if (( ${#files[@]} == 0 )); then echo "no results"; exit 1; fi
"$PY" benchmarks/report.py --compare "${files[@]}" --labels "${labels[@]}"
echo "(details: $OUT/RESULTS-gpu-eager.md, $OUT/RESULTS-gpu-compiled.md)"
