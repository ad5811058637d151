#!/usr/bin/env bash
# /healthz under search load with and without the heap freeze (FRAGSEARCH_FREEZE_HEAP), side by side:
# one server per setting on 127.0.0.1, each given search with 1 / 8 / 32 clients
# for 60 s each, /healthz probed every 0.1 s. Writes
# docs/results/service-overload-heap-{unfrozen,frozen}.csv (+ -rss.csv samples).
#
#   bench/heap_freeze_ab.sh <model.pt> <image index> <sentence index> [port]
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 images=$2 sentences=$3 port=${4:-8015}
work=artifacts/heap-freeze
rm -rf "$work" && mkdir -p "$work"
export FRAGSEARCH_MODEL_PATH=$model FRAGSEARCH_IMAGE_INDEX=$images FRAGSEARCH_SENTENCE_INDEX=$sentences
export FRAGSEARCH_UPLOADS=$work/uploads FRAGSEARCH_PREPARE=false FRAGSEARCH_LOG_LEVEL=warning
export FRAGSEARCH_API_KEY=${FRAGSEARCH_API_KEY:-bench-$RANDOM$RANDOM}
data=${FRAGSEARCH_DATA:-../shared/data/flickr8k}
url=http://127.0.0.1:$port

for setting in false true; do
  name=$([ "$setting" = true ] && echo frozen || echo unfrozen)
  FRAGSEARCH_FREEZE_HEAP=$setting ./run python -m fragsearch.service --port "$port" > "$work/server-$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf "$url/readyz" > /dev/null && break; sleep 1; done
  curl -sf "$url/readyz" > /dev/null || { echo "server did not get ready" >&2; kill "$pid"; exit 1; }
  ./run python -m bench.load_bench --url "$url" --pid "$pid" --clients 1 8 32 --duration 60 --warmup 5 \
    --scenarios search --data "$data" --rss-every 5 --probe-every 0.1 --allow-refusals \
    --out "docs/results/service-overload-heap-$name.csv" \
    --samples-out "docs/results/service-overload-heap-$name-rss.csv" || status=$?
  kill "$pid"; wait "$pid" || true
done
exit "${status:-0}"
