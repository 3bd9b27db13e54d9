#!/usr/bin/env bash
# The study (make study): the grid of docs/study/grid.py on the built-in MNI152 data, one run at a time
# through the DVC experiment queue, each finished run exported to docs/study/runs/<run id>.json, then
# the reports rebuilt from that archive alone. Resumable: runs already archived are skipped, so the
# study accumulates across sessions (commit docs/study/runs after each). STUDY_MAX_RUNS=N queues at
# most N of the missing runs; STUDY_ARMS="precision eps-pilot" only those arms' (grid.py status names the
# arms). STUDY_CPUS=0 pins the queue's trainings to core 0 with one thread (so that other work on the
# other core leaves their wall time alone); STUDY_CPUS="0 1" starts one worker per group, each pinned to
# its own core with one thread: two runs side by side, about twice the throughput of one run on both
# cores (batch-1 runs at 32^3: 3.7-3.9 samples/s on one pinned core, 4.3 with two threads). About
# 5 minutes per equal-samples run on 2 CPU cores; the 1536-step runs take 1536 x k samples (k = 8:
# about 45-60 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
EXP=$(python -c "import sys; sys.path.insert(0, 'docs/study'); import grid; print(grid.EXPERIMENT)")
export_runs() {
  voxdiff export --experiment "$EXP" --out docs/study/runs >/dev/null 2>&1 || true
}

git diff --quiet HEAD -- src stages dvc.yaml params.yaml || { echo "commit your changes first: queued runs use committed files" >&2; exit 1; }
dvc repro preprocess
# shellcheck disable=SC2086  # STUDY_ARMS holds several arm names
python docs/study/grid.py missing ${STUDY_ARMS:-} > .study-queue.all
head -n "${STUDY_MAX_RUNS:-1000}" .study-queue.all > .study-queue; rm -f .study-queue.all
echo "queueing $(wc -l < .study-queue) run(s); archived so far:"; python docs/study/grid.py status
while read -r overrides; do
  # shellcheck disable=SC2086  # the line holds several -S key=value words
  dvc exp run --queue $overrides >/dev/null
done < .study-queue
rm -f .study-queue
workers_in() {  # how many workers, active or idle, a `dvc queue status` text ($1) shows
  sed -nE 's/^Worker status: ([0-9]+) active, ([0-9]+) idle.*/\1 \2/p' <<<"$1" | awk '{n = $1 + $2} END {print n + 0}'
}
start_workers() {
  if [ -z "${STUDY_CPUS:-}" ]; then
    dvc queue start -j 1
    return
  fi
  local cpus n=0 tries
  # One worker per space-separated group ("0 1": two, one core each), each with its own number: `dvc queue start
  # -j n` starts those of workers 1..n that do not answer, so worker n - 1 must answer before worker n starts
  # (two workers of one number share a pid file and each other's shutdown messages).
  # shellcheck disable=SC2086  # STUDY_CPUS holds several groups
  for cpus in $STUDY_CPUS; do
    for ((tries = 0; n > 0 && tries < 24; tries++)); do
      [ "$(workers_in "$(dvc queue status)")" -ge "$n" ] && break
      sleep 5
    done
    n=$((n + 1))
    # The queue's worker and the trainings it starts inherit the affinity and the thread count.
    OMP_NUM_THREADS=$(tr ',' '\n' <<<"$cpus" | wc -l) taskset -c "$cpus" dvc queue start -j "$n"
  done
}
start_workers
# Export each run as soon as it finishes (when the queue's count of finished runs goes up), so an
# interrupted study keeps every run that completed.
done_before=0
idle_polls=0
status_failures=0
while sleep 30; do
  # `dvc queue status` can fail once and answer the next time ("unexpected error - Expecting value": a JSON read
  # inside DVC, most likely of a task's info file while it is written; treeverse/dvc#8014 shows the same kind). That
  # must not end the wait: it once ended it during a run's evaluation, so the run went unexported and the reports
  # were rebuilt without it. Ten failures in a row do.
  if ! status=$(dvc queue status 2>/dev/null); then
    status_failures=$((status_failures + 1))
    if [ "$status_failures" -ge 10 ]; then echo "dvc queue status failed 10 times in a row: not waiting for the queue" >&2; break; fi
    continue
  fi
  status_failures=0
  grep -qE 'Queued|Running' <<<"$status" || break
  done_now=$(grep -cE 'Success|Failed' <<<"$status" || true)
  if [ "$done_now" != "$done_before" ]; then export_runs; done_before=$done_now; fi
  # A worker can stop after one task (a stale shutdown message in the queue's broker): start the workers again,
  # but only once no worker has shown for two polls in a row (a worker just started may not show yet: restarting
  # then would put a second worker, and its training, on the first one's core).
  if ! grep -q Running <<<"$status" && [ "$(workers_in "$status")" -eq 0 ]; then
    idle_polls=$((idle_polls + 1))
  else
    idle_polls=0
  fi
  if [ "$idle_polls" -ge 2 ]; then start_workers; idle_polls=0; fi
done
export_runs
python docs/study/grid.py status
bash docs/study/report.sh
