#!/usr/bin/env bash
# make sweep: queue a grid (the arguments are `dvc exp run --queue`'s: -S 'seed=0,1,2' ...), start the queue with
# JOBS workers and wait until every experiment of this grid has ended; exit 1 if any of them failed. Other tasks the
# queue lists (finished ones, which DVC lists until `dvc queue remove`, or another grid's) are neither waited for nor
# counted. (Statuses are read into variables: `dvc queue status | grep -q` under pipefail fails on SIGPIPE.)
set -euo pipefail
# shellcheck source=docs/study/queue_status.sh
source "$(dirname "$0")/queue_status.sh"
queued=$(dvc exp run --queue "$@")
echo "$queued"
# "Queued experiment 'NAME' for future execution.": NAME is the task's name, or its id when it has none.
names=$(sed -nE "s/^Queued experiment '(.+)' for future execution\.$/\1/p" <<<"$queued")
[ -n "$names" ] || { echo "wait_queue.sh: dvc exp run --queue queued nothing" >&2; exit 1; }
ours() {  # the lines of a status ($1) that are this grid's tasks (column 1 the id, 2 the name)
  awk -v names="$names" 'BEGIN {n = split(names, a, "\n"); for (i = 1; i <= n; i++) want[a[i]] = 1}
                         ($1 in want) || ($2 in want)' <<<"$1"
}
dvc queue start -j "${JOBS:-1}"
while :; do
  status=$(queue_status) || exit 1
  mine=$(ours "$status")
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
