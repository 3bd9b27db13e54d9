#!/usr/bin/env bash
# The study (make study): the grid of docs/study/grid.py on the built-in MNI152 data, one run at a time
# through the DVC experiment queue, each finished run exported to docs/study/runs/<run id>.json, then
# the reports rebuilt from that archive alone. Resumable: runs already archived are skipped, so the
# study accumulates across sessions (commit docs/study/runs after each). STUDY_MAX_RUNS=N queues at
# most N of the missing runs, STUDY_SKIP=N after passing over the first N (to run a pair's cheaper run first when
# the other would not finish within a session); STUDY_ARMS="precision eps-pilot" only those arms' (grid.py status
# names the arms). STUDY_CPUS=0 pins the queue's trainings to core 0 with one thread (so that other work on the
# other core leaves their wall time alone); STUDY_CPUS="0 1" starts one worker per group, each pinned to
# its own core with one thread: two runs side by side, about twice the throughput of one run on both
# cores (batch-1 runs at 32^3: 3.7-3.9 samples/s on one pinned core, 4.3 with two threads). About
# 5 minutes per equal-samples run on 2 CPU cores; the 1536-step runs take 1536 x k samples (k = 8:
# about 45-60 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
EXP=$(python -c "import sys; sys.path.insert(0, 'docs/study'); import grid; print(grid.EXPERIMENT)")
# shellcheck source=docs/study/queue_status.sh
source docs/study/queue_status.sh
export QUEUE_STATUS_RETRY_S=${QUEUE_STATUS_RETRY_S:-30}  # ten failing answers in a row, 5 minutes, end the wait
export_runs() {  # while waiting: a failed export is tried again at the next run's end and at the last one below
  voxdiff export --experiment "$EXP" --out docs/study/runs >/dev/null 2>&1 || true
}

git diff --quiet HEAD -- src stages dvc.yaml params.yaml || { echo "commit your changes first: queued runs use committed files" >&2; exit 1; }
dvc repro preprocess
# A queue that still has runs (an earlier `make study` stopped while its detached workers go on training) is waited
# for and exported, not queued again: the same settings queued twice would train twice, side by side.
status=$(queue_status)
if grep -qE 'Queued|Running' <<<"$status"; then
  echo "the DVC queue still has runs queued or training: waiting for them, queueing nothing new"
  names=$(awk '$NF == "Queued" || $NF == "Running" {print $1}' <<<"$status")
else
  # shellcheck disable=SC2086  # STUDY_ARMS holds several arm names
  python docs/study/grid.py missing ${STUDY_ARMS:-} > .study-queue.all
  awk -v skip="${STUDY_SKIP:-0}" -v max="${STUDY_MAX_RUNS:-1000}" 'NR > skip && NR <= skip + max' .study-queue.all \
    > .study-queue
  rm -f .study-queue.all
  echo "queueing $(wc -l < .study-queue) run(s); archived so far:"; python docs/study/grid.py status
  names=""
  while read -r overrides; do
    # shellcheck disable=SC2086  # the line holds several -S key=value words
    queued=$(dvc exp run --queue $overrides)
    names+=$(queued_names "$queued")$'\n'
  done < .study-queue
  rm -f .study-queue
fi
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
# Export each run as soon as it finishes (when the count of its finished runs goes up), so an interrupted study
# keeps every run that completed.
done_before=0
while sleep 30; do
  status=$(queue_status) || { export_runs; exit 1; }
  mine=$(tasks_of "$status" "$names")
  grep -qE 'Queued|Running' <<<"$mine" || break
  done_now=$(grep -cE 'Success|Failed' <<<"$mine" || true)
  if [ "$done_now" != "$done_before" ]; then export_runs; done_before=$done_now; fi
  if queue_stalled "$status"; then start_workers; fi
done
voxdiff export --experiment "$EXP" --out docs/study/runs >/dev/null
python docs/study/grid.py status
bash docs/study/report.sh
if grep -q Failed <<<"$mine"; then
  echo "runs failed (dvc queue logs <name>): $(awk '$NF == "Failed" {print $2}' <<<"$mine" | tr '\n' ' ')" >&2
  exit 1
fi
