"""Ensembles of trained fragment models: the image–sentence score is the sum of the members' scores.

    python -m bench.ensemble --members artifacts/models/full-val artifacts/models/full-maxviol

Each member scores every image against every sentence with its own `Bundle.scores` (the one S_kl,
calibrated where the checkpoint holds a calibration) on its own image features (members trained on
other regions or another backbone each read theirs from the feature cache); an ensemble of the first
n members (n = 2 .. all, in the order given) ranks by the sum of their scores. Evaluated on
the validation part of the training data (``--val-images`` images held out with ``--val-seed``,
the same draw `--selection val` training holds out, so the members never trained on them) and on
the reported split (dev), with every member alone beside it. Model choices are made on the
validation rows only; dev is reported. Rows go to docs/results/ensemble-dev.csv, with the cost of
the ensemble against one member (embedding dimensions per fragment, members' scoring time).
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from bench import SplitDataByConfig, machine
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData, hold_out
from fragsearch.settings import default_cache_dir, default_data_dir
from fragsearch.training.evaluate import metrics_from_scores, score_split

logger = logging.getLogger("bench.ensemble")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "ensemble-dev.csv"
FIELDS = ("members", "part", "images", "rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5",
          "search_r10", "h_total", "score_seconds", "machine", "command")


def member_scores(bundle: Bundle, data: SplitData) -> tuple[np.ndarray, float]:
    """(N_images, L) scores of one member on `data`, and the seconds they took."""
    start = time.perf_counter()
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    return score_split(bundle, data.feats, enc), time.perf_counter() - start


def rows_for(part: str, data: SplitData | Mapping[str, SplitData], bundles: dict[str, Bundle], command: str,
             alone: Sequence[str] = ()) -> list[dict[str, object]]:
    """One row per member alone and one for the sum of the first n members, n = 2 .. all, on one part of the
    data (the bundles named in `alone` only alone): `data` shared by every member, or each member's own (the
    same images and sentences, read with its image settings)."""
    own = dict(data) if isinstance(data, Mapping) else {name: data for name in bundles}
    first = own[next(iter(bundles))]  # the images and sentences every member scores
    for name in bundles:
        if own[name].names != first.names or own[name].sentences != first.sentences:
            raise ValueError(f"member {name} was given other images or sentences than the first member")
    scored = {name: member_scores(b, own[name]) for name, b in bundles.items()}
    members = [name for name in bundles if name not in alone]
    combos = [[name] for name in bundles] + [members[:n] for n in range(2, len(members) + 1)]
    rows: list[dict[str, object]] = []
    for combo in combos:
        total = np.sum([scored[n][0] for n in combo], axis=0)
        m = metrics_from_scores(total, first.pair_image)
        rows.append({"members": "+".join(combo), "part": part, "images": len(first.names), "rsum": round(m["rsum"], 1),
                     **{k: round(m[k], 1) for k in FIELDS[4:10]},
                     "h_total": sum(int(bundles[n].cfg.h) for n in combo),
                     "score_seconds": round(sum(scored[n][1] for n in combo), 1), "machine": machine(),
                     "command": command})
        logger.info("%s on %s: R-sum %.1f", rows[-1]["members"], part, m["rsum"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=Path, nargs="+", required=True, help="model folders (each with model.pt)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature cache")
    ap.add_argument("--train-split", default="train", help="the split the validation part is drawn from")
    ap.add_argument("--split", default="dev", help="the split reported (never used to choose)")
    ap.add_argument("--val-images", type=int, default=500, help="validation part: images held out of training")
    ap.add_argument("--val-seed", type=int, default=0, help="validation part: the draw's seed")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    ap.add_argument("--alone", type=Path, nargs="*", default=[],
                    help="more model folders evaluated alone beside the members (e.g. a merge: training/merge.py)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args.members) < 2:
        ap.error("an ensemble needs at least two --members")
    bundles = {folder.name: Bundle.load(folder / "model.pt") for folder in [*args.members, *args.alone]}
    command = "python -m bench.ensemble " + shlex.join(sys.argv[1:] if argv is None else [str(a) for a in argv])
    rows: list[dict[str, object]] = []
    for part, split in (("val", args.train_split), (args.split, args.split)):
        loaded = SplitDataByConfig(args.data, split, args.cache)
        data = {name: loaded.get(b) for name, b in bundles.items()}
        if part == "val":
            data = {name: hold_out(d, args.val_images, args.val_seed)[1] for name, d in data.items()}
        rows += rows_for(part, data, bundles, command, [folder.name for folder in args.alone])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
