#!/usr/bin/env bash
# Search and annotate over HTTP with the server's numeric threads (NumPy's BLAS, FAISS's OpenMP) at their
# default, each running request's share of the CPUs (model/onnx.py request_threads), against every CPU for
# every request (FRAGSEARCH_NUMERIC_THREADS=<CPUs>), side by side: both servers up on 127.0.0.1 at once, idle
# but for the one under load, given the same runs in turn (search, then annotate; 1 and 8 clients, 12 s
# each; `rounds` rounds). Writes docs/results/service-load-threads.csv (the load bench's columns, with
# `config` and `round` first).
#
#   bench/threads_ab.sh <image index> <sentence index> [rounds] [port]
set -euo pipefail
cd "$(dirname "$0")/.."
images=$1 sentences=$2 rounds=${3:-2} port=${4:-8811}
work=artifacts/threads-ab
rm -rf "$work" && mkdir -p "$work"
export FRAGSEARCH_IMAGE_INDEX=$images FRAGSEARCH_SENTENCE_INDEX=$sentences
export FRAGSEARCH_UPLOADS=$work/uploads FRAGSEARCH_PREPARE=false FRAGSEARCH_LOG_LEVEL=warning
data=${FRAGSEARCH_DATA:-../shared/data/flickr8k}
cpus=$(nproc)
declare -A ports=([share]=$port [all]=$((port + 1)))
pids=()
trap 'kill "${pids[@]}" 2> /dev/null || true' EXIT
FRAGSEARCH_PORT=${ports[share]} ./run python -m fragsearch.service > "$work/server-share.log" 2>&1 & pids+=($!)
FRAGSEARCH_NUMERIC_THREADS=$cpus FRAGSEARCH_PORT=${ports[all]} ./run python -m fragsearch.service > "$work/server-all.log" 2>&1 &
pids+=($!)
for config in share all; do
  url=http://127.0.0.1:${ports[$config]}
  for _ in $(seq 600); do curl -sf "$url/readyz" > /dev/null && break; sleep 1; done
  curl -sf "$url/readyz" > /dev/null || { echo "the $config server did not get ready" >&2; exit 1; }
done
out=docs/results/service-load-threads.csv
rm -f "$out"
for round in $(seq "$rounds"); do
  for scenario in search annotate; do
    for config in share all; do
      part=$work/$config-$round-$scenario.csv
      ./run python -m bench.load_bench --url "http://127.0.0.1:${ports[$config]}" --clients 1 8 --duration 12 \
        --warmup 2 --scenarios "$scenario" --data "$data" --allow-refusals --out "$part" > "$work/load.log" 2>&1
      if [ ! -f "$out" ]; then echo "config,round,$(head -1 "$part")" > "$out"; fi
      tail -n +2 "$part" | sed "s|^|$config,$round,|" >> "$out"
    done
  done
done
echo "wrote $out"
