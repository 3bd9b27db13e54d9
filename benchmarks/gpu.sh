#!/usr/bin/env bash
# voxdiff at med-ddpm's size (params-gpu.yaml: 128^3, 41 M weights, micro-batch 1 x accumulate 2, bf16) on one
# GPU, in one command that ends within 8 minutes: step time eager and under torch.compile (the compile apart),
# peak memory at micro-batch 1 and 2, accumulation exactness on CUDA (2 x 1 against 1 x 2 in fp32 and bf16,
# with a control), the noise-scale probes' and post-hoc EMA's overheads, a 200-step loss curve.
# Writes benchmarks/results-gpu.json (what ran where: `machine`, `measurement`) and prints a table (also in
# benchmarks/RESULTS-gpu.md). benchmarks/gpu_bench.py documents each phase.
#
#   benchmarks/gpu.sh                                  # on the GPU machine, from anywhere
#   benchmarks/gpu.sh --set train.precision=fp16       # any params-gpu.yaml key
#   GPU_SMOKE=1 taskset -c 1 benchmarks/gpu.sh         # CPU smoke of the plumbing: 32^3, narrow channels, a few
#                                                      #   steps, < 2 min -> benchmarks/.scratch/results-gpu-smoke.json
#
# Time limits (seconds): the first process runs every phase but the compile within MAIN_LIMIT (270; the loss
# curve shortens itself to end in time), the second the compile within COMPILE_LIMIT (180): 7.5 min in all,
# plus the table. What finished is kept when a limit cuts a phase. Written without a GPU at hand: the limits
# are estimates, and the smoke run checks the plumbing only.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
if [[ "${GPU_SMOKE:-0}" == 1 ]]; then
  OUT=${OUT:-benchmarks/.scratch/results-gpu-smoke.json}
  # fp32: on the reference CPU oneDNN's bf16 kernels gave NaN gradients for the 5-level network at 32^3
  ARGS=(--smoke --device "${DEVICE:-cpu}" --precision "${PRECISION:-fp32}" --compile-backend "${COMPILE_BACKEND:-eager}")
  MAIN_LIMIT=${MAIN_LIMIT:-90} COMPILE_LIMIT=${COMPILE_LIMIT:-25}
else
  OUT=${OUT:-benchmarks/results-gpu.json}
  ARGS=(--device "${DEVICE:-cuda}" --precision "${PRECISION:-bf16}" --compile-backend "${COMPILE_BACKEND:-inductor}")
  MAIN_LIMIT=${MAIN_LIMIT:-270} COMPILE_LIMIT=${COMPILE_LIMIT:-180}
fi
mkdir -p "$(dirname "$OUT")"
# The phases write into a fresh file beside $OUT, which replaces it only once a phase has written there: a run that
# measures nothing (no CUDA on this machine) leaves the last results in place.
NEW="$OUT.partial"
rm -f "$NEW"
start=$(date +%s)
timeout "$MAIN_LIMIT" "$PY" benchmarks/gpu_bench.py "${ARGS[@]}" --out "$NEW" --budget-s $(( MAIN_LIMIT - 10 )) \
  --phases eager,memory,exactness,probe,phema,curve "$@" \
  || echo "gpu.sh: the main run stopped (exit $?): the table shows what finished" >&2
timeout "$COMPILE_LIMIT" "$PY" benchmarks/gpu_bench.py "${ARGS[@]}" --out "$NEW" --phases compiled "$@" \
  || echo "gpu.sh: the compiled run stopped (exit $?; a compile longer than COMPILE_LIMIT=$COMPILE_LIMIT s?)" >&2
echo
[ -s "$NEW" ] || { echo "gpu.sh: nothing measured; $OUT left as it was" >&2; exit 1; }
mv "$NEW" "$OUT"
"$PY" benchmarks/gpu_bench.py --table --out "$OUT" || exit 1
echo "(gpu.sh: $(( $(date +%s) - start )) s; results: $OUT)"
