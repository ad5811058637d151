#!/usr/bin/env bash
# The overload and soak runs of docs/results/service-overload*.csv and soak*.{json,csv}:
# a server on 127.0.0.1 (niced), then 1 / 8 / 32 clients for 60 s per scenario, then, on a fresh
# server, 10 minutes of mixed traffic with adds and deletes. Both sides run under nice -n 19.
#
#   bench/overload_soak.sh <model.pt> <image index> <sentence index> [port]
#
# The indexes are copied first (the soak adds and deletes images): the originals stay untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 images=$2 sentences=$3 port=${4:-8014}
work=artifacts/overload-soak
rm -rf "$work" && mkdir -p "$work"
cp -r "$images" "$work/images" && cp -r "$sentences" "$work/sentences"
export FRAGSEARCH_MODEL_PATH=$model FRAGSEARCH_IMAGE_INDEX=$work/images FRAGSEARCH_SENTENCE_INDEX=$work/sentences
export FRAGSEARCH_UPLOADS=$work/uploads FRAGSEARCH_PREPARE=false FRAGSEARCH_LOG_LEVEL=warning
export FRAGSEARCH_API_KEY=${FRAGSEARCH_API_KEY:-bench-$RANDOM$RANDOM}
data=${FRAGSEARCH_DATA:-../shared/data/flickr8k}
url=http://127.0.0.1:$port

serve() {  # start a server, wait until /readyz answers 200 (at most 10 min)
  nice -n 19 ./run python -m fragsearch.service --port "$port" > "$work/server-$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "$url/readyz" > /dev/null && return 0
    sleep 1
  done
  echo "server did not get ready" >&2; kill "$pid"; exit 1
}

serve overload
nice -n 19 ./run python -m bench.load_bench --url "$url" --pid "$pid" --clients 1 8 32 --duration 60 --warmup 5 \
  --scenarios search annotate mixed --data "$data" --rss-every 5 --allow-refusals \
  --out docs/results/service-overload.csv --samples-out docs/results/service-overload-rss.csv || status=$?
kill "$pid"; wait "$pid" || true

serve soak
nice -n 19 ./run python -m bench.soak_bench --url "$url" --pid "$pid" --duration 600 --clients 4 --data "$data" \
  --note "${NOTE:-}" --out docs/results/soak.json --samples-out docs/results/soak-rss.csv
kill "$pid"; wait "$pid" || true
exit "${status:-0}"
