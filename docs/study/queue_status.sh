# Sourced by wait_queue.sh (make sweep) and run.sh (make study): `dvc queue status` that survives one bad answer.
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
