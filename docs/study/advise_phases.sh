#!/usr/bin/env bash
# voxdiff advise against the study, where B_crit is measurable (issue 34, section 6; what is compared and how is
# registered in data-size-protocol.md, "voxdiff advise against the study"). Trains the data-size arm's first
# missing N 160 k 1 run (docs/study/grid.py) in a scratch clone, pinned to core 0 with one thread and logged to
# the study's store (mlflow.db, experiment voxdiff-study), so it is archived like a queued run if it ends; with
# train.keep_checkpoints_at_samples at the registered phases (ADVISE_PHASES overrides them). On core 1, as each
# copy appears, `voxdiff advise` on it: docs/study/advise/n160-seed<seed>-at-<phase>.{md,json,png}.
#
# Cost: ~5 min of data preparation, then the advice at the last phase lands ~65 min into the training (3.4
# samples/s on one pinned core). The run itself takes ~2.6 h to its cap plus ~10 min of evaluation: in a 3-hour
# session it lands only if it stops early; stopped, the advice stays. Needs both cores and nothing else heavy:
#   nohup bash docs/study/advise_phases.sh > advise_phases.log 2>&1 &
# A stop (Ctrl-C, SIGTERM) asks the training to stop at its next window boundary (it saves its checkpoint and
# ends its MLflow run KILLED) and keeps the clone, whose path it prints.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
export PATH="$REPO/.venv/bin:$PATH"
read -r -a PHASES <<<"${ADVISE_PHASES:-2048 6144 12288}"
OUT=$REPO/docs/study/advise

git diff --quiet HEAD -- src stages dvc.yaml params.yaml || { echo "commit your changes first: the run uses committed files" >&2; exit 1; }
run=$(python docs/study/grid.py missing data-size-160 | grep -m1 -e '-S train.accumulate_every=1 ') || {
  echo "every data-size-160 k 1 run is archived: nothing to train here" >&2; exit 1; }
seed=$(sed -nE 's/.*-S seed=([0-9]+)( |$).*/\1/p' <<<"$run")
keep="[$(IFS=,; echo "${PHASES[*]}")]"

work=$(mktemp -d "${TMPDIR:-/tmp}/voxdiff-advise.XXXXXX")
git clone -q --shared . "$work/repo"
echo "N 160, k 1, seed $seed in $work/repo (log: $work/train.log); advice at ${PHASES[*]} samples -> docs/study/advise/"
# The study's store: the run is archived from it like a queued one (a queued run's temp copy logs there too).
export MLFLOW_TRACKING_URI="sqlite:///$REPO/mlflow.db"
# Its own process group (setsid): a stop reaches `voxdiff train` itself, not only dvc, which does not pass SIGTERM on.
# shellcheck disable=SC2086  # $run holds several -S key=value words
(cd "$work/repo" && OMP_NUM_THREADS=1 exec setsid taskset -c 0 dvc exp run $run -S "train.keep_checkpoints_at_samples=$keep") \
  > "$work/train.log" 2>&1 &
train=$!
advice=""
stop() {
  kill -TERM -- "-$train" 2>/dev/null || true
  [ -n "$advice" ] && kill -TERM "$advice" 2>/dev/null
  while kill -0 -- "-$train" 2>/dev/null; do sleep 2; done  # until the training has saved and exited
  echo "stopped: the run is kept in $work/repo" >&2
  exit 130
}
trap stop INT TERM

kept_copy() {  # the first whole copy at or past $1 samples (named after the samples seen at the step that crossed it)
  find "$work/repo/models/kept" -maxdepth 1 -type f -name 'samples-*.pt' 2>/dev/null | sort |
    awk -v n="$1" '{s = $0; sub(/.*\/samples-/, "", s); sub(/\.pt$/, "", s)} s + 0 >= n + 0 {print; exit}' || true
}

mkdir -p "$OUT"
for phase in "${PHASES[@]}"; do
  copy=$(kept_copy "$phase")
  while [ -z "$copy" ]; do
    if ! kill -0 "$train" 2>/dev/null; then
      copy=$(kept_copy "$phase")  # written just before the training ended?
      [ -n "$copy" ] || { echo "the run ended before $phase samples (an early stop?): no advice there" >&2; break 2; }
      break
    fi
    sleep 30
    copy=$(kept_copy "$phase")
  done
  echo "advising on $(basename "$copy") ($(date -u +%H:%M) UTC)"
  # In the background and waited for, so that a stop is handled at once, not after the advice.
  OMP_NUM_THREADS=1 taskset -c 1 voxdiff advise --root "$work/repo" --checkpoint "$copy" --val-draws 1 --no-log \
    --no-progress --out "$OUT/n160-seed$seed-at-$phase.md" > "$work/advise-$phase.log" 2>&1 &
  advice=$!
  wait "$advice" || echo "advice at $phase failed: $work/advise-$phase.log" >&2
  advice=""
done
wait "$train" || { echo "the training failed: $work/train.log" >&2; exit 1; }
trap - INT TERM
voxdiff export --experiment voxdiff-study --out docs/study/runs > /dev/null
python docs/study/grid.py status
bash docs/study/report.sh
rm -rf "$work"
echo "done: commit docs/study/runs, docs/study/advise and the reports"
