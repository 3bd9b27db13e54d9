#!/usr/bin/env bash
# make ui-shot: the MLflow UI's run comparison as a user sees it, rendered by headless Chromium (Debian's
# package) into a PNG. Starts `mlflow server` on a free loopback port for the store, takes the picture,
# stops the server; bounded in time (server start 60 s, page 120 s).
#   UI_DB=mlflow.db UI_EXPERIMENT=voxdiff-study UI_OUT=docs/mlflow-compare.png bash docs/ui-shot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
DB=${UI_DB:-mlflow.db}
EXP=${UI_EXPERIMENT:-voxdiff}
OUT=${UI_OUT:-docs/mlflow-compare.png}
MAX_RUNS=${UI_MAX_RUNS:-8}
FILTER=${UI_FILTER:-}   # extra MLflow filter, e.g. "params.\`train.batch_size\` = '2'"
[ -f "$DB" ] || { echo "no MLflow store at $DB: train first (make demo, make study)" >&2; exit 1; }
command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
mlflow server --backend-store-uri "sqlite:///$PWD/$DB" --host 127.0.0.1 --port "$PORT" --workers 1 \
  >/tmp/voxdiff-ui-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
URL=$(python - "$PORT" "$EXP" "$MAX_RUNS" "$FILTER" <<'PY'
import json, sys, urllib.parse
from mlflow import MlflowClient
port, name, n, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = MlflowClient(f"http://127.0.0.1:{port}")
exp = client.get_experiment_by_name(name)
if exp is None:
    sys.exit(f"no experiment {name!r} in the store")
query = "tags.`voxdiff.kind` = 'train' and attributes.status = 'FINISHED'" + (f" and {extra}" if extra else "")
runs = client.search_runs([exp.experiment_id], query,
                          order_by=["params.`train.accumulate_every` ASC", "attributes.start_time ASC"], max_results=n)
ids = [r.info.run_id for r in runs]
q = lambda v: urllib.parse.quote(json.dumps(v))
print(f"http://127.0.0.1:{port}/#/compare-runs?runs={q(ids)}&experiments={q([exp.experiment_id])}")
PY
)
PROFILE=$(mktemp -d)
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --user-data-dir="$PROFILE" \
  --hide-scrollbars --window-size=1600,1300 --virtual-time-budget=30000 --screenshot="$OUT" "$URL" 2>/dev/null
rm -rf "$PROFILE"
echo "wrote $OUT ($URL)"
