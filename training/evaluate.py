"""Retrieval evaluation: R@1/5/10, median and mean rank, both directions, per SPEC.md.

Image annotation (image -> sentences): rank of the best-ranked of the image's sentences.
Image search (sentence -> images): rank of its one image. Ties count against the query
(an item scoring equal to the correct one is ranked before it).
Also the Hodosh (*) variant: only the first sentence of each image.

    python -m fragsearch.training.evaluate --data DIR --split DIR/dev.txt --model artifacts/models/full/model.pt

Its command line: fragsearch/commands/evaluate.py (`python -m fragsearch.training.evaluate` calls it).
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from fragsearch.model.dataset import SplitData
from fragsearch.model.fragments import EncodedSentences, TextPipeline

logger = logging.getLogger(__name__)

KS = (1, 5, 10)


class Scorer(Protocol):
    """What evaluation reads of a model: the runtime's Bundle, or a Checkpoint in training (which embeds
    through the same runtime)."""

    @property
    def text(self) -> TextPipeline: ...
    def embed_images(self, feats: np.ndarray, calibrated: bool = True) -> np.ndarray: ...
    def embed_sentences(self, enc: EncodedSentences, idx: list[int] | None = None, calibrated: bool = True
                        ) -> tuple[np.ndarray, np.ndarray]: ...
    def scores(self, img: np.ndarray, img_mask: np.ndarray, sent: np.ndarray, sent_mask: np.ndarray,
               chunk: int | None = None, blocks: int | None = None) -> np.ndarray: ...


def annotation_ranks(scores: np.ndarray, pair_image: np.ndarray) -> np.ndarray:
    """scores: (N, L) image x sentence; pair_image: (L,). Rank (1-based) of each image's best sentence."""
    n = scores.shape[0]
    own = pair_image[None, :] == np.arange(n)[:, None]  # (N, L)
    best = np.where(own, scores, -np.inf).max(axis=1)  # (N,)
    wrong = ~own
    ahead = ((scores > best[:, None]) & wrong).sum(1) + ((scores == best[:, None]) & wrong).sum(1)
    return np.asarray(ahead + 1)


def search_ranks(scores: np.ndarray, pair_image: np.ndarray) -> np.ndarray:
    """Rank (1-based) of each sentence's image among all images."""
    n_sent = scores.shape[1]
    true = scores[pair_image, np.arange(n_sent)]  # (L,)
    ahead = (scores >= true[None, :]).sum(0) - 1
    return np.asarray(ahead + 1)


def recall_table(ranks: np.ndarray, prefix: str) -> dict[str, float]:
    out = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks <= k)) for k in KS}
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)))
    out[f"{prefix}_meanr"] = float(np.mean(ranks))
    return out


def hub_occurrence(scores: np.ndarray, top: int = 10) -> int:
    """Hubness of search: the most sentences whose top `top` images all hold one same image.

    scores: (N, L). Spread evenly, each image would be in the top of about L * top / N sentences.
    """
    n = scores.shape[0]
    if n == 0 or scores.shape[1] == 0:
        return 0
    k = min(top, n)
    best = np.argpartition(-scores, k - 1, axis=0)[:k]  # (k, L)
    return int(np.bincount(best.ravel(), minlength=n).max())


def metrics_from_scores(scores: np.ndarray, pair_image: np.ndarray) -> dict[str, float]:
    m = recall_table(annotation_ranks(scores, pair_image), "annot")
    m.update(recall_table(search_ranks(scores, pair_image), "search"))
    m["rsum"] = sum(m[f"{d}_r{k}"] for d in ("annot", "search") for k in KS)
    m["search_hub_top10"] = float(hub_occurrence(scores))
    return m


def score_split(bundle: Scorer, feats: np.ndarray, enc: EncodedSentences, chunk: int = 250) -> np.ndarray:
    """(N_images, L) scores of every image against every sentence with the bundle's score."""
    img = bundle.embed_images(feats)
    img_mask = np.ones(img.shape[:2], np.float32)
    sent, sent_mask = bundle.embed_sentences(enc)
    return bundle.scores(img, img_mask, sent, sent_mask, chunk=chunk)


def split_metrics(scores: np.ndarray, pair_image: np.ndarray) -> dict[str, float]:
    """Metrics over every sentence, plus hodosh_<metric>: the same over each image's first sentence only.

    scores: (N, L) image x sentence; pair_image: (L,), every image with at least one sentence."""
    metrics = metrics_from_scores(scores, pair_image)
    first = np.array([int(np.flatnonzero(pair_image == k)[0]) for k in range(scores.shape[0])])
    hodosh = metrics_from_scores(scores[:, first], pair_image[first])
    metrics.update({f"hodosh_{k}": v for k, v in hodosh.items()})
    return metrics


def evaluate(bundle: Scorer, data: SplitData) -> dict[str, float]:
    """Metrics on a split (all 5 sentences per image) plus the Hodosh (*) first-sentence variant."""
    return evaluate_scores(bundle, data)[0]


def evaluate_scores(bundle: Scorer, data: SplitData) -> tuple[dict[str, float], np.ndarray]:
    """`evaluate`'s metrics and the (N_images, L) score matrix they were computed from."""
    enc = bundle.text.encode_parsed(data.parsed, data.sentences)
    scores = score_split(bundle, data.feats, enc)
    metrics = split_metrics(scores, data.pair_image)
    metrics["images"] = float(len(data.names))
    metrics["sentences"] = float(len(data.sentences))
    return metrics, scores


if __name__ == "__main__":  # `python -m fragsearch.training.evaluate`, as the docs write it: the command's alias
    from fragsearch.commands.evaluate import main

    main()
