"""The image–sentence score S_kl and fragment alignments: the one implementation.

Training, evaluation, the index's re-rank and the service all call these functions.

    S_kl = 1 / (|g_k| (|g_l| + n)) * sum_{i in g_k} sum_{j in g_l} max(0, v_i . s_j)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMOOTHING = 5.0  # the paper's n


def fragment_scores(img_frags: torch.Tensor, sent_frags: torch.Tensor) -> torch.Tensor:
    """Inner products v_i . s_j.

    img_frags: (K, F, h), sent_frags: (L, T, h) -> (K, F, L, T).
    """
    k, f, h = img_frags.shape
    n_sent, t, _ = sent_frags.shape
    flat = img_frags.reshape(k * f, h) @ sent_frags.reshape(n_sent * t, h).T
    return flat.reshape(k, f, n_sent, t)


@dataclass(frozen=True)
class FlatFragments:
    """Real fragments of a batch, flattened: pairwise scores (I, J) and which item each row/column is of.

    img_of: (I,) image index of each image fragment; sent_of: (J,) sentence index of each sentence
    fragment; n_images / n_sentences: how many items the batch has.
    """

    scores: torch.Tensor
    img_of: torch.Tensor
    sent_of: torch.Tensor
    n_images: int
    n_sentences: int


def flatten(img_frags: torch.Tensor, img_mask: torch.Tensor, sent_frags: torch.Tensor,
            sent_mask: torch.Tensor) -> FlatFragments:
    """Pairwise scores v_i . s_j of the real fragments only (padding never enters a product)."""
    k, f, h = img_frags.shape
    n_sent, t, _ = sent_frags.shape
    img_real = img_mask.reshape(-1).bool()
    sent_real = sent_mask.reshape(-1).bool()
    v = img_frags.reshape(k * f, h)
    s = sent_frags.reshape(n_sent * t, h)
    img_of = torch.arange(k, device=img_frags.device).repeat_interleave(f)
    sent_of = torch.arange(n_sent, device=img_frags.device).repeat_interleave(t)
    if not bool(img_real.all()):  # selecting copies the fragments: skipped when none is padding
        v, img_of = v[img_real], img_of[img_real]
    if not bool(sent_real.all()):
        s, sent_of = s[sent_real], sent_of[sent_real]
    return FlatFragments(v @ s.T, img_of, sent_of, k, n_sent)


def skl_from_flat(flat: FlatFragments, smoothing: float = SMOOTHING) -> torch.Tensor:
    """S_kl (K, L) from the pairwise scores of real fragments: the thresholded sum, normalised."""
    pos = flat.scores.clamp_min(0)  # (I, J)
    per_image = pos.new_zeros(flat.n_images, pos.shape[1]).index_add(0, flat.img_of, pos)  # (K, J)
    total = pos.new_zeros(flat.n_images, flat.n_sentences).index_add(1, flat.sent_of, per_image)  # (K, L)
    n_img = torch.bincount(flat.img_of, minlength=flat.n_images).to(pos.dtype).clamp_min(1)
    n_sent = torch.bincount(flat.sent_of, minlength=flat.n_sentences).to(pos.dtype)
    return total / (n_img[:, None] * (n_sent[None, :] + smoothing))


def skl(
    img_frags: torch.Tensor,
    img_mask: torch.Tensor,
    sent_frags: torch.Tensor,
    sent_mask: torch.Tensor,
    smoothing: float = SMOOTHING,
    chunk: int | None = None,
) -> torch.Tensor:
    """Image–sentence scores S_kl for every image k and sentence l.

    img_frags: (K, F, h) with img_mask: (K, F) (1 = real fragment, 0 = padding);
    sent_frags: (L, T, h) with sent_mask: (L, T). Returns (K, L). Differentiable.
    `chunk` bounds memory by scoring at most that many sentences at a time.
    """
    if chunk is not None and sent_frags.shape[0] > chunk:
        parts = [
            skl(img_frags, img_mask, sent_frags[s : s + chunk], sent_mask[s : s + chunk], smoothing)
            for s in range(0, sent_frags.shape[0], chunk)
        ]
        return torch.cat(parts, dim=1)
    return skl_from_flat(flatten(img_frags, img_mask, sent_frags, sent_mask), smoothing)


def pair_contributions(img_frags: torch.Tensor, sent_frags: torch.Tensor,
                       smoothing: float = SMOOTHING) -> tuple[torch.Tensor, torch.Tensor]:
    """Each fragment pair's share of one pair's S_kl: (v_i . s_j (F, T), max(0, v_i . s_j) / (F (T + n))).

    img_frags: (F, h), sent_frags: (T, h), real fragments only; the shares sum to `skl` of the pair.
    """
    flat = flatten(img_frags[None], img_frags.new_ones(1, len(img_frags)), sent_frags[None],
                   sent_frags.new_ones(1, len(sent_frags)))
    norm = len(img_frags) * (len(sent_frags) + smoothing)
    return flat.scores, flat.scores.clamp_min(0) / norm


@dataclass(frozen=True)
class Alignment:
    """For each sentence fragment j: its best image fragment and their score v_i . s_j.

    `matched[j]` is False where no image fragment scores above zero (the fragment then
    contributes nothing to S_kl).
    """

    image_fragment: list[int]
    score: list[float]
    matched: list[bool]


def align(img_frags: torch.Tensor, sent_frags: torch.Tensor) -> Alignment:
    """Alignment of one pair. img_frags: (F, h), sent_frags: (T, h) (real fragments only)."""
    scores = fragment_scores(img_frags[None], sent_frags[None])[0, :, 0, :]  # (F, T)
    best, idx = scores.max(dim=0)
    return Alignment(
        image_fragment=[int(i) for i in idx],
        score=[float(s) for s in best],
        matched=[bool(s > 0) for s in best],
    )
