# Sourced by wait_queue.sh (make sweep) and run.sh (make study): waiting on the DVC experiment queue.
#
# `dvc queue status` that survives one bad answer.
# It can fail once and answer the next time ("unexpected error - Expecting value": a JSON read inside DVC, most
# likely of a task's info file while it is written; treeverse/dvc#8014 shows the same kind). A wait loop that took
# that failure for "nothing queued" once ended during a run's evaluation, so the run went unexported.

# queue_status: print `dvc queue status`, asking again (QUEUE_STATUS_RETRY_S seconds apart) while it fails; return 1
# after QUEUE_STATUS_TRIES failures in a row, with one line that says so. DVC's own message goes to stderr each time.
queue_status() {
  local tries out
  for ((tries = 1; ; tries++)); do
    if out=$(dvc queue status); then
      printf '%s\n' "$out"
      return 0
    fi
    if [ "$tries" -ge "${QUEUE_STATUS_TRIES:-10}" ]; then
      echo "dvc queue status failed $tries times in a row: not waiting for the queue" >&2
      return 1
    fi
    sleep "${QUEUE_STATUS_RETRY_S:-3}"
  done
}

# workers_in STATUS: how many workers, active or idle, a `dvc queue status` text shows.
workers_in() {
  sed -nE 's/^Worker status: ([0-9]+) active, ([0-9]+) idle.*/\1 \2/p' <<<"$1" | awk '{n = $1 + $2} END {print n + 0}'
}

# queue_stalled STATUS: true on the second poll in a row (counted in queue_idle_polls) that shows no worker and nothing
# running while tasks wait. A worker can stop after one task (a stale shutdown message in the queue's broker), which
# leaves the rest queued for ever; one just started may not show yet, so one such poll is not enough (starting
# another then would run two trainings at once).
queue_idle_polls=0
queue_stalled() {
  if grep -q Queued <<<"$1" && ! grep -q Running <<<"$1" && [ "$(workers_in "$1")" -eq 0 ]; then
    queue_idle_polls=$((queue_idle_polls + 1))
  else
    queue_idle_polls=0
  fi
  [ "$queue_idle_polls" -ge 2 ] || return 1
  queue_idle_polls=0
}

# queued_names OUTPUT: the tasks a `dvc exp run --queue` output names, one a line ("Queued experiment 'NAME' for
# future execution.": NAME is the task's name, or its id when it has none).
queued_names() {
  sed -nE "s/^Queued experiment '(.+)' for future execution\.$/\1/p" <<<"$1"
}

# tasks_of STATUS NAMES: the lines of a `dvc queue status` text that are these tasks (column 1 the id, 2 the name).
tasks_of() {
  awk -v names="$2" 'BEGIN {n = split(names, a, "\n"); for (i = 1; i <= n; i++) want[a[i]] = 1}
                     ($1 in want) || ($2 in want)' <<<"$1"
}
