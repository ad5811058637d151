"""Which fragments carry a model's dev recall: S_kl restricted to subsets of its fragments.

    python -m bench.channels --only full contextual large-regions sentence

For each fragment model, the dev R-sum (R@1+R@5+R@10, both directions) of the same S_kl
(model.score.skl) computed over:

- `all`: every fragment (the model's real score);
- `whole-image`: the whole-image fragment only, against every sentence fragment;
- `regions`: the 19 regions only;
- `triplets`: the dependency triplets only (the whole-sentence fragment masked out; a sentence
  left with no triplet scores 0);
- `whole-pair`: the whole-image fragment against the whole-sentence fragment only.

Writes docs/results/score-channels-dev.csv.
"""

from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path
from typing import Any

import numpy as np

from bench import SplitDataByConfig, add_model_args, kept_rows
from fragsearch.model.bundle import Bundle
from fragsearch.model.fragments import SENTENCE_REL
from fragsearch.model.score import skl
from fragsearch.training.evaluate import metrics_from_scores

logger = logging.getLogger(__name__)

CHANNELS = ("all", "whole-image", "regions", "triplets", "whole-pair")


def channel_rsums(bundle: Bundle, feats: np.ndarray, rels: list[list[str]], sent: np.ndarray,
                  sent_mask: np.ndarray, pair_image: np.ndarray) -> dict[str, float]:
    """Dev R-sum of S_kl over each channel's fragments (rels: each sentence's fragment relations;
    sent: (L, T, h), sent_mask: (L, T))."""
    img = bundle.embed_images(feats)
    img_mask = np.ones(img.shape[:2], np.float32)
    is_sentence = np.zeros(sent_mask.shape, dtype=bool)
    for li, sentence_rels in enumerate(rels):
        for j, r in enumerate(sentence_rels):
            is_sentence[li, j] = r == SENTENCE_REL
    only_triplets = sent_mask * ~is_sentence
    only_sentence = sent_mask * is_sentence
    whole, regions = img_mask.copy(), img_mask.copy()
    whole[:, 1:] = 0
    regions[:, 0] = 0
    masks = {"all": (img_mask, sent_mask), "whole-image": (whole, sent_mask), "regions": (regions, sent_mask),
             "triplets": (img_mask, only_triplets), "whole-pair": (whole, only_sentence)}
    out: dict[str, float] = {}
    for name, (im, sm) in masks.items():
        if im.sum() == 0 or sm.sum() == 0:  # e.g. no whole-sentence fragment in this model
            continue
        s = skl(img, im, sent, sm, chunk=250)
        out[name] = round(metrics_from_scores(np.asarray(s), pair_image)["rsum"], 1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, Path("docs/results/score-channels-dev.csv"))
    ap.add_argument("--only", nargs="*", required=True, help="fragment model names under --models")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows: list[dict[str, Any]] = list(kept_rows(args.out, args.merge, args.only))
    split_data = SplitDataByConfig(args.data, args.split, args.cache)
    for name in args.only:
        bundle = Bundle.load(args.models / name / "model.pt")
        if bundle.cfg.kind != "fragment" or bundle.image_cfg.full_frame_only or bundle.pool is not None:
            logger.info("%s: not a fragment model with regions and the mean's S_kl, skipped", name)
            continue
        data = split_data.get(bundle)
        enc = bundle.text.encode_parsed(data.parsed, data.sentences)
        sent, sent_mask = bundle.embed_sentences(enc)
        rels = [[t.rel for t in trip] for trip in enc.triplets]
        r = channel_rsums(bundle, data.feats, rels, sent, sent_mask, data.pair_image)
        logger.info("%s: %s", name, r)
        rows.append({"model": name, **{c: r.get(c, "") for c in CHANNELS},
                     "command": "python -m bench.channels --only " + " ".join(args.only)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["model", *CHANNELS, "command"])
        w.writeheader()
        w.writerows(rows)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
