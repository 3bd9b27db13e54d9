#!/usr/bin/env bash
# make sweep: queue a grid (the arguments are `dvc exp run --queue`'s: -S 'seed=0,1,2' ...), start the queue with
# JOBS workers and wait until every experiment of this grid has ended; exit 1 if any of them failed. Other tasks the
# queue lists (finished ones, which DVC lists until `dvc queue remove`, or another grid's) are neither waited for nor
# counted. EXPS_FILE=path: the grid's experiment names are written there, one a line, as soon as they are queued
# (make sweep hands them to `voxdiff compare --dvc-exp`, so other runs of the MLflow experiment stay out of its
# report). (Statuses are read into variables: `dvc queue status | grep -q` under pipefail fails on SIGPIPE.)
set -euo pipefail
# shellcheck source=docs/study/queue_status.sh
source "$(dirname "$0")/queue_status.sh"
queued=$(dvc exp run --queue "$@")
echo "$queued"
names=$(queued_names "$queued")
[ -n "$names" ] || { echo "wait_queue.sh: dvc exp run --queue queued nothing" >&2; exit 1; }
if [ -n "${EXPS_FILE:-}" ]; then printf '%s\n' "$names" > "$EXPS_FILE"; fi
dvc queue start -j "${JOBS:-1}"
while :; do
  status=$(queue_status) || exit 1
  mine=$(tasks_of "$status" "$names")
  if [ "$(grep -c . <<<"$mine")" -lt "$(grep -c . <<<"$names")" ]; then
    echo "wait_queue.sh: dvc queue status does not list every task just queued (${names//$'\n'/ })" >&2
    exit 1
  fi
  grep -qE 'Queued|Running' <<<"$mine" || break
  if queue_stalled "$status"; then dvc queue start -j "${JOBS:-1}"; fi
  sleep "${QUEUE_POLL_S:-10}"
done
echo "$mine"
if grep -q Failed <<<"$mine"; then echo "some experiments failed: dvc queue logs <name>" >&2; exit 1; fi
