#!/usr/bin/env bash
# Start the DVC experiment queue with one worker and wait until every queued experiment has ended.
set -euo pipefail
dvc queue start -j "${JOBS:-1}"
while dvc queue status | grep -qE 'Queued|Running'; do sleep 10; done
dvc queue status
if dvc queue status | grep -q Failed; then echo "some experiments failed: dvc queue logs <name>" >&2; exit 1; fi
