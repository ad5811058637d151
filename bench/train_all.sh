#!/usr/bin/env bash
# Train every row of docs/results/flickr8k-dev.csv on the 6,000 training images for the variant's fixed
# epoch count (--selection last: no split chooses the epoch; dev is evaluated only by bench.report),
# then write the table and plots. Two runs at a time, one thread each (a 2-core machine).
#   ./run python -m fragsearch.training.extract --splits dev train --workers 2   # first: the feature caches
#   ./run python -m fragsearch.training.extract --splits dev train --workers 2 --min-box-frac 0.15
#   ./run python -m fragsearch.training.extract --splits dev train --workers 2 --min-box-frac 0.25
#   ./run python -m fragsearch.training.extract --splits dev train --workers 2 --min-box-frac 0.25 --region-features crop
#   ./run python -m fragsearch.training.extract --splits dev train --workers 2 --min-box-frac 0.25 --region-features crop \
#       --backbone-precision int8 --proposal-resize 112 --backbone-size 224
#   bash bench/train_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p artifacts/logs
lane() {
  for v in "$@"; do
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TQDM_DISABLE=1 "$PY" -m fragsearch.training.train --variant "$v" --selection last --workers 1 \
      > "artifacts/logs/train-$v.log" 2>&1 || echo "training $v failed: see artifacts/logs/train-$v.log" >&2
  done
}
lane full paper fragment fullframe bigram sentence contextual-r25 wide full-crop sdt-rnn dt-rnn devise devise-bidirectional &
lane two-branch fragment+global global bow large-regions contextual dropout full-roi sdt-rnn-contextual \
  devise-contextual dt-rnn-contextual &
wait
"$PY" -m bench.report --only full full-crop full-roi paper fragment+global fragment global fullframe bow bigram sentence \
  large-regions contextual contextual-r25 wide dropout two-branch dt-rnn sdt-rnn dt-rnn-contextual sdt-rnn-contextual \
  devise devise-bidirectional devise-contextual
"$PY" -m bench.channels --only full full-crop full-roi dropout wide contextual-r25 contextual large-regions sentence paper
