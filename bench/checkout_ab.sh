#!/usr/bin/env bash
# Two checkouts' services over HTTP side by side: this checkout and another (a worktree of an earlier commit:
# `git worktree add /tmp/before <commit>`), both serving the same indexes on 127.0.0.1, up at once and idle
# but for the one under load, given the same runs in turn (`scenarios`, 1 and 8 clients, 15 s each after 3 s
# of warm-up; `rounds` rounds). Writes the load bench's columns with `checkout` (its commit) and `round` first.
#
#   bench/checkout_ab.sh <before checkout> <image index> <sentence index> [rounds] [out] [scenarios] [port]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(cd "$1" && pwd) images=$(realpath "$2") sentences=$(realpath "$3") rounds=${4:-2}
out=${5:-docs/results/service-load-ab.csv} scenarios=${6:-search} port=${7:-8831}
work=artifacts/checkout-ab
rm -rf "$work" && mkdir -p "$work"
export FRAGSEARCH_IMAGE_INDEX=$images FRAGSEARCH_SENTENCE_INDEX=$sentences
export FRAGSEARCH_PREPARE=false FRAGSEARCH_LOG_LEVEL=warning
data=$(realpath "${FRAGSEARCH_DATA:-../shared/data/flickr8k}")
export FRAGSEARCH_DATA=$data
here=$(pwd)
declare -A dirs=([before]=$before [after]=$here) ports=([before]=$port [after]=$((port + 1))) commits=()
pids=()
trap 'kill "${pids[@]}" 2> /dev/null || true' EXIT
for side in before after; do
  commits[$side]=$(git -C "${dirs[$side]}" rev-parse --short HEAD)$(git -C "${dirs[$side]}" diff --quiet HEAD || echo +)
  (cd "${dirs[$side]}" && FRAGSEARCH_UPLOADS=$here/$work/uploads-$side FRAGSEARCH_PORT=${ports[$side]} \
    exec ./run python -m fragsearch.service) > "$work/server-$side.log" 2>&1 &
  pids+=($!)
done
for side in before after; do
  url=http://127.0.0.1:${ports[$side]}
  for _ in $(seq 600); do curl -sf "$url/readyz" > /dev/null && break; sleep 1; done
  curl -sf "$url/readyz" > /dev/null || { echo "the $side server did not get ready: $work/server-$side.log" >&2; exit 1; }
done
rm -f "$out"
for round in $(seq "$rounds"); do
  for scenario in $scenarios; do
    for side in before after; do
      part=$work/$side-$round-$scenario.csv
      ./run python -m bench.load_bench --url "http://127.0.0.1:${ports[$side]}" --clients 1 8 --duration 15 \
        --warmup 3 --scenarios "$scenario" --data "$data" --allow-refusals --out "$part" > "$work/load.log" 2>&1
      if [ ! -f "$out" ]; then echo "checkout,round,$(head -1 "$part")" > "$out"; fi
      tail -n +2 "$part" | sed "s|^|${commits[$side]},$round,|" >> "$out"
    done
  done
done
echo "wrote $out"
