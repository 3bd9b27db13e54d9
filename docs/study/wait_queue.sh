#!/usr/bin/env bash
# Start the DVC experiment queue and wait until every queued experiment has ended.
# (Read the status into a variable: `dvc queue status | grep -q` under pipefail fails on SIGPIPE.)
set -euo pipefail
dvc queue start -j "${JOBS:-1}"
while status=$(dvc queue status) && grep -qE 'Queued|Running' <<<"$status"; do sleep 10; done
echo "$status"
if grep -q Failed <<<"$status"; then echo "some experiments failed: dvc queue logs <name>" >&2; exit 1; fi
