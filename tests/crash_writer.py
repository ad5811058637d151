"""A writer process for the crash tests: random adds, removes, saves and candidate-index builds on
an image index, until it is killed (or has done `--ops` operations).

    python -m tests.crash_writer --index DIR --model model.pt --journal J --seed 3 [--ops N] [--die-after-commit]

Before every save it appends the state that save is about to commit to the journal (one JSON line
{"gen": g, "items": {id: name}}, flushed and fsynced), so that after a SIGKILL the test knows the
state of every commit that may have happened. It prints "ready" once the index is loaded.
Exit status 3: another writer saved the index first (the error is printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

import numpy as np

from fragsearch.index import ImageIndex, saving
from fragsearch.index.images import embedded_images
from fragsearch.model.bundle import Bundle

REBUILD_EVERY = 7  # operations between two builds of the candidate index
SIDE = 224


def journal_state(journal: Path, gen: int, items: dict[int, str]) -> None:
    with open(journal, "a") as f:
        f.write(json.dumps({"gen": gen, "items": {str(i): n for i, n in items.items()}}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def live_items(index: ImageIndex) -> dict[int, str]:
    out: dict[int, str] = {}
    for i in index.ids().tolist():
        rec = index.get(int(i))
        assert rec is not None
        out[int(i)] = rec.name
    return out


def random_images(rng: np.random.Generator, dim: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """count images of 20 unit fragments: vectors (K, 20, dim), boxes (K, 20, 4), sizes (K, 2)."""
    vecs = rng.standard_normal((count, 20, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=-1, keepdims=True)
    lo = rng.uniform(0, SIDE / 2, (count, 20, 2))
    boxes = np.concatenate([lo, lo + rng.uniform(8, SIDE / 2, (count, 20, 2))], axis=-1).astype(np.float32)
    return vecs, boxes, np.full((count, 2), SIDE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--journal", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--wait", action="store_true", help="after 'ready', wait for a line on stdin before writing")
    ap.add_argument("--die-after-commit", action="store_true",
                    help="SIGKILL itself after the first commit, before the clean-up of unreferenced files")
    args = ap.parse_args(argv)
    bundle = Bundle.load(args.model)
    index = ImageIndex.load(args.index, bundle)
    if args.die_after_commit:
        saving.remove_unreferenced = lambda index, keep: os.kill(os.getpid(), signal.SIGKILL)
    rng = np.random.default_rng(args.seed)
    sys.stdout.write("ready\n")  # the protocol line the test waits for
    sys.stdout.flush()
    if args.wait:
        sys.stdin.readline()  # both writers hold the loaded index before either writes
    for op in range(args.ops):
        live = index.ids()
        if len(live) > 4 and rng.random() < 0.4:
            index.remove(int(rng.choice(live)))
        else:
            n = int(rng.integers(1, 4))
            vecs, boxes, sizes = random_images(rng, bundle.dim, n)
            names = [f"s{args.seed}-op{op}-{j}.jpg" for j in range(n)]
            index.add(embedded_images(vecs, boxes, sizes), names, [f"/nonexistent/{name}" for name in names],
                      read_places=False)
        if op % REBUILD_EVERY == REBUILD_EVERY - 1:
            index.rebuild()
        journal_state(args.journal, index.generation + 1, live_items(index))
        try:
            index.save()
        except RuntimeError as e:
            logging.error("refused: %s", e)
            return 3
    index.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
