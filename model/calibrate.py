"""Score calibration: each item's fragments are scaled so that its S_kl against a fixed reference set has
unit spread.

S_kl is positively homogeneous in either side's fragments (max(0, c v.s) = c max(0, v.s) for c > 0), so
dividing image k's fragments by sigma_k and sentence l's by tau_l gives S_kl / (sigma_k tau_l): still the
one S_kl (model.score.skl), of the calibrated fragments. sigma_k is the standard deviation of image k's
S_kl against R reference training sentences, tau_l that of sentence l against R reference training images.

Why: without it a few images score high against almost every sentence (hubs) and crowd the top of
image search. For a fixed image, sigma_k does not change how its sentences rank, and for a fixed
sentence tau_l does not change how its images rank: the image scale acts on search only, the
sentence scale on annotation only, and neither changes which region a triplet aligns to. The
reference sets are drawn from the training split and stored, embedded, in the checkpoint; the scale
of a new image or sentence is computed from its own fragments when it is embedded. (In the
retrieval literature: querybank normalisation, a remedy for hubness.)

    python -m model.calibrate --model artifacts/models/full/model.pt --refs 1000
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model.score import skl

if TYPE_CHECKING:
    from model.bundle import Bundle
    from model.dataset import SplitData

logger = logging.getLogger(__name__)

BLOCK = 200  # items of the other side scored per step (bounds memory: BLOCK * F x R * T products)
FLOOR = 0.01  # smallest scale, as a share of the reference items' median scale (an all-zero item)


@dataclass
class Calibration:
    """Reference fragments, embedded by the uncalibrated model.

    ref_images: (R_i, F, h); ref_sentences: (R_s, T, h) with ref_sentence_mask (R_s, T);
    floor_image / floor_sentence: the smallest scale each side's items get.
    """

    ref_images: torch.Tensor
    ref_sentences: torch.Tensor
    ref_sentence_mask: torch.Tensor
    floor_image: float = 0.0
    floor_sentence: float = 0.0

    def image_scales(self, img: torch.Tensor) -> torch.Tensor:
        """img: (K, F, h) uncalibrated image fragments -> (K,) sigma_k."""
        with torch.no_grad():
            out = [skl(img[k : k + BLOCK], torch.ones(img[k : k + BLOCK].shape[:2], device=img.device),
                       self.ref_sentences,
                       self.ref_sentence_mask, chunk=BLOCK).std(dim=1, unbiased=False)
                   for k in range(0, img.shape[0], BLOCK)]
        return (torch.cat(out) if out else img.new_zeros(0)).clamp_min(self.floor_image)

    def sentence_scales(self, sent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """sent: (L, T, h) uncalibrated sentence fragments, mask (L, T) -> (L,) tau_l."""
        ones = torch.ones(self.ref_images.shape[:2], device=self.ref_images.device)
        with torch.no_grad():
            out = [skl(self.ref_images, ones, sent[s : s + BLOCK], mask[s : s + BLOCK]).std(dim=0, unbiased=False)
                   for s in range(0, sent.shape[0], BLOCK)]
        return (torch.cat(out) if out else sent.new_zeros(0)).clamp_min(self.floor_sentence)

    def to(self, device: torch.device | str) -> Calibration:
        """The same references on `device` (self when they are there already)."""
        dev = torch.device(device)
        if self.ref_images.device == dev:
            return self
        return Calibration(self.ref_images.to(dev), self.ref_sentences.to(dev), self.ref_sentence_mask.to(dev),
                           self.floor_image, self.floor_sentence)

    def to_state(self) -> dict[str, Any]:
        """Stored at half precision on the CPU (the scales are spreads: 3 significant digits are plenty)."""
        return {"ref_images": self.ref_images.half().cpu(), "ref_sentences": self.ref_sentences.half().cpu(),
                "ref_sentence_mask": self.ref_sentence_mask.bool().cpu(), "floor_image": self.floor_image,
                "floor_sentence": self.floor_sentence}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Calibration:
        return cls(state["ref_images"].float(), state["ref_sentences"].float(),
                   state["ref_sentence_mask"].float(), float(state["floor_image"]), float(state["floor_sentence"]))


def fit_calibration(bundle: Bundle, data: SplitData, refs: int, seed: int = 0) -> Calibration:
    """Reference sets of `refs` images and `refs` sentences drawn from `data` (the training split),
    embedded by the bundle's model without calibration; floors from the references' own scales."""
    rng = np.random.default_rng(seed)
    img_idx = np.sort(rng.choice(len(data.names), min(refs, len(data.names)), replace=False))
    sent_idx = np.sort(rng.choice(len(data.sentences), min(refs, len(data.sentences)), replace=False))
    enc = bundle.text.encode_parsed([data.parsed[i] for i in sent_idx], [data.sentences[i] for i in sent_idx])
    was_training = bundle.model.training
    bundle.model.eval()
    with torch.no_grad():
        img = bundle.embed_images(data.feats[img_idx], calibrated=False)
        sent, mask = bundle.embed_sentences(enc, calibrated=False)
    bundle.model.train(was_training)
    cal = Calibration(img, sent, mask).to(bundle.device)
    cal.floor_image = FLOOR * float(cal.image_scales(cal.ref_images).median())
    cal.floor_sentence = FLOOR * float(cal.sentence_scales(cal.ref_sentences, cal.ref_sentence_mask).median())
    return cal


def per_item_ms(bundle: Bundle, data: SplitData, n: int = 50) -> dict[str, float]:
    """Milliseconds to embed one image / one sentence at a time (as a query is), with and without
    the calibration scale, measured interleaved on the first `n` items of `data`."""
    enc = bundle.text.encode_parsed(data.parsed[:n], data.sentences[:n])
    times: dict[str, list[float]] = {k: [] for k in ("image", "image_calibrated", "sentence", "sentence_calibrated")}
    bundle.model.eval()
    with torch.no_grad():
        for i in range(min(n, len(data.names), len(enc.rel))):
            for cal in (False, True):
                t = time.perf_counter()
                bundle.embed_images(data.feats[i : i + 1], calibrated=cal)
                times["image_calibrated" if cal else "image"].append(time.perf_counter() - t)
                t = time.perf_counter()
                bundle.embed_sentences(enc, [i], calibrated=cal)
                times["sentence_calibrated" if cal else "sentence"].append(time.perf_counter() - t)
    return {k: round(1000 * float(np.median(v)), 2) for k, v in times.items() if v}


def main(argv: list[str] | None = None) -> None:
    from model.bundle import Bundle
    from model.config import default_artifacts_dir, default_data_dir
    from model.dataset import load_split_data
    from model.evaluate import evaluate
    from model.text import make_parser

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint to calibrate (rewritten in place)")
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--split", default="train", help="where the reference items are drawn from")
    ap.add_argument("--dev-split", default="dev", help="evaluated before and after ('' to skip)")
    ap.add_argument("--cache", type=Path, default=default_artifacts_dir() / "cache")
    ap.add_argument("--refs", type=int, default=1000, help="reference images and sentences (0 removes calibration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1, help="feature extraction processes")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bundle = Bundle.load(args.model, device=args.device)
    device = str(bundle.device)
    if bundle.cfg.kind != "fragment":
        raise SystemExit(f"{args.model}: only fragment models are calibrated (this one is {bundle.cfg.kind!r})")
    parser = make_parser(bundle.text.cfg.parser)
    dev = (load_split_data(args.data, args.dev_split, bundle.image_cfg, args.cache, parser, args.workers,
                           device=device) if args.dev_split else None)
    if dev is not None:
        bundle.text.warm(dev.parsed, dev.sentences, args.cache / "vectors")
    bundle.calibration = None
    before = evaluate(bundle, dev) if dev is not None else None
    if args.refs > 0:
        train = load_split_data(args.data, args.split, bundle.image_cfg, args.cache, parser, args.workers,
                                device=device)
        bundle.calibration = fit_calibration(bundle, train, args.refs, args.seed)
        bundle.meta["calibration"] = {"refs": args.refs, "split": args.split, "seed": args.seed}
    else:
        bundle.meta.pop("calibration", None)
    bundle.meta.pop("dev", None)  # measured with the previous scales
    if dev is not None:
        after = evaluate(bundle, dev)
        bundle.meta["dev"] = after
        keys = ("rsum", "annot_r1", "annot_r5", "annot_r10", "search_r1", "search_r5", "search_r10")
        logger.info("dev without calibration: %s", json.dumps({k: round(before[k], 1) for k in keys} if before else {}))
        logger.info("dev with calibration:    %s", json.dumps({k: round(after[k], 1) for k in keys}))
        if bundle.calibration is not None:
            cost = per_item_ms(bundle, dev)
            bundle.meta["calibration"]["ms_per_item"] = cost
            logger.info("median ms to embed one item (dev, torch threads: %d): %s", torch.get_num_threads(),
                        json.dumps(cost))
    bundle.save(args.model)
    logger.info("wrote %s", args.model)


if __name__ == "__main__":
    main()
