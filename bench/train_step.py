"""Training speed of the fragment objective: seconds per epoch with the optimizer's fused step and
the host-drawn dropout masks (the default, `fragsearch.model.device.fused_optimizer` / `host_masks`) against
torch's per-tensor step and its own masks, in turns in one process on the same data.

    python -m bench.train_step --images 2000 --pairs 3 --threads 2

Each turn trains one epoch of `--variant` (default: `full`) from the same seed on the first
`--images` training images (`fragsearch.training.train.train`, selection "last", no calibration) and records the
epoch's seconds; the turns alternate (before, after, before, after, ...) so the machine's drift falls
on both arms. Writes docs/results/train-step.csv (one row per turn) and logs the median ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from bench import machine, parse_run, write_rows
from fragsearch.model.dataset import load_split_data
from fragsearch.model.parsers import make_parser
from fragsearch.settings import default_cache_dir, default_data_dir
from fragsearch.training.train import make_run, train

logger = logging.getLogger("bench.train_step")

ARMS = ("per-tensor step, torch masks", "fused step, host masks")


@contextmanager
def arm(name: str) -> Iterator[None]:
    """The settings of one arm: the default policy, or both device-policy choices turned off."""
    if name == ARMS[1]:
        yield
        return
    with mock.patch("fragsearch.training.epochs.fused_optimizer", lambda params: False), \
            mock.patch("fragsearch.training.nets.encoders.host_masks", lambda device: False):
        yield


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="full", help="the training variant timed")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--images", type=int, default=2000, help="the first N training images")
    ap.add_argument("--pairs", type=int, default=3, help="turns of each arm")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("docs/results/train-step.csv"), help="the results CSV")
    args, command = parse_run(ap, argv, "bench.train_step")
    torch.set_num_threads(args.threads)
    run = make_run(args.variant, {"selection": "last", "epochs": 1, "calibrate": 0, "device": "cpu"})
    data = load_split_data(args.data, "train", run.image, args.cache, make_parser(run.text.parser), 1,
                           args.images, "cpu")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(2 * args.pairs):
            name = ARMS[turn % 2]
            with arm(name):
                summary = train(dataclasses.replace(run), data, None, Path(tmp) / str(turn), args.cache)
            seconds = float(summary["history"][0]["seconds"])
            loss = float(summary["history"][0]["loss"])
            logger.info("turn %d (%s): %.1f s, loss %.4f", turn, name, seconds, loss)
            rows.append({"turn": turn, "arm": name, "epoch_seconds": round(seconds, 2), "loss": round(loss, 4),
                         "images": len(data.names), "sentences": len(data.sentences), "threads": args.threads,
                         "machine": machine(),
                         "command": command})
    before = np.array([r["epoch_seconds"] for r in rows if r["arm"] == ARMS[0]], dtype=float)
    after = np.array([r["epoch_seconds"] for r in rows if r["arm"] == ARMS[1]], dtype=float)
    ratio = before / after
    logger.info("epoch seconds, median: %.1f (%s) vs %.1f (%s); before / after per pair: %s (median %.2f)",
                float(np.median(before)), ARMS[0], float(np.median(after)), ARMS[1],
                ", ".join(f"{r:.2f}" for r in ratio), float(np.median(ratio)))
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
