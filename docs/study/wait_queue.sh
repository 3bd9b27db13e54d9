#!/usr/bin/env bash
# Start the DVC experiment queue and wait until every queued experiment has ended (make sweep).
# (Read the status into a variable: `dvc queue status | grep -q` under pipefail fails on SIGPIPE.)
set -euo pipefail
# shellcheck source=docs/study/queue_status.sh
source "$(dirname "$0")/queue_status.sh"
dvc queue start -j "${JOBS:-1}"
while :; do
  status=$(queue_status) || exit 1
  grep -qE 'Queued|Running' <<<"$status" || break
  sleep "${QUEUE_POLL_S:-10}"
done
echo "$status"
if grep -q Failed <<<"$status"; then echo "some experiments failed: dvc queue logs <name>" >&2; exit 1; fi
