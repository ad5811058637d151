"""The image–sentence score S_kl and fragment alignments: the one implementation.

Training, evaluation, the index's re-rank and the service all call these functions.

    S_kl = 1 / (|g_k| (|g_l| + n)) * sum_{i in g_k} sum_{j in g_l} max(0, v_i . s_j)

A merged model (training/merge.py) is B members' embeddings side by side: h = B equal slices
(``ModelConfig.blocks``). Its fragment pair scores are thresholded slice by slice,

    sum_b max(0, v_i^b . s_j^b)    in place of    max(0, v_i . s_j),

so its S_kl is the sum of the members' S_kl (with per-slice calibration, of their calibrated S_kl).
One block (every trained model) is the formula above, computed exactly as before.
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


def block_slices(h: int, blocks: int) -> list[slice]:
    """The `blocks` equal slices of an h-dimensional embedding (ValueError if h does not split evenly)."""
    if blocks < 1 or h % blocks:
        raise ValueError(f"h = {h} does not split into {blocks} equal blocks")
    w = h // blocks
    return [slice(b * w, (b + 1) * w) for b in range(blocks)]


def block_dots(v: torch.Tensor, s: torch.Tensor, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """v: (I, h), s: (J, h) -> (v . s (I, J), sum_b max(0, v^b . s^b) (I, J)) over `blocks` equal slices of h:
    the raw inner products and the thresholded pair scores S_kl sums."""
    parts = block_slices(v.shape[-1], blocks)
    if blocks == 1:
        dots = v @ s.T
        return dots, dots.clamp_min(0)
    # s^b . v^b with v^b (the many rows) as the transposed operand: BLAS reads each slice of v in place
    # (v[:, sl] on the left is copied first, which made a 2-block query's S_kl 2-3x dearer than one block's)
    per_block = torch.stack([s[:, sl] @ v[:, sl].T for sl in parts])  # (B, J, I)
    return per_block.sum(0).T.contiguous(), per_block.clamp_min(0).sum(0).T.contiguous()


@dataclass(frozen=True)
class FlatFragments:
    """Real fragments of a batch, flattened: pairwise scores (I, J) and which item each row/column is of.

    img_of: (I,) image index of each image fragment; sent_of: (J,) sentence index of each sentence
    fragment; n_images / n_sentences: how many items the batch has. `positive` (I, J): the thresholded
    pair scores of a model of several blocks (None for one block: ``scores.clamp_min(0)``).
    """

    scores: torch.Tensor
    img_of: torch.Tensor
    sent_of: torch.Tensor
    n_images: int
    n_sentences: int
    positive: torch.Tensor | None = None


def flatten(img_frags: torch.Tensor, img_mask: torch.Tensor, sent_frags: torch.Tensor,
            sent_mask: torch.Tensor, blocks: int = 1) -> FlatFragments:
    """Pairwise scores v_i . s_j of the real fragments only (padding never enters a product); with
    `blocks` > 1 also their slice-wise thresholded sums (`block_dots`)."""
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
    if blocks == 1:  # the training path: the thresholding is skl_from_flat's
        return FlatFragments(v @ s.T, img_of, sent_of, k, n_sent)
    dots, pos = block_dots(v, s, blocks)
    return FlatFragments(dots, img_of, sent_of, k, n_sent, pos)


def skl_from_flat(flat: FlatFragments, smoothing: float = SMOOTHING) -> torch.Tensor:
    """S_kl (K, L) from the pairwise scores of real fragments: the thresholded sum, normalised."""
    pos = flat.scores.clamp_min(0) if flat.positive is None else flat.positive  # (I, J)
    if flat.n_sentences == 1:  # one sentence (a search): its fragments summed first, one add per image fragment
        total = pos.new_zeros(flat.n_images).index_add(0, flat.img_of, pos.sum(1))[:, None]  # (K, 1)
    else:
        per_image = pos.new_zeros(flat.n_images, pos.shape[1]).index_add(0, flat.img_of, pos)  # (K, J)
        total = pos.new_zeros(flat.n_images, flat.n_sentences).index_add(1, flat.sent_of, per_image)  # (K, L)
    n_img = torch.bincount(flat.img_of, minlength=flat.n_images).to(pos.dtype).clamp_min(1)
    n_sent = torch.bincount(flat.sent_of, minlength=flat.n_sentences).to(pos.dtype)
    return total / (n_img[:, None] * (n_sent[None, :] + smoothing))


def skl_of_items(dots: torch.Tensor, owner: torch.Tensor, n_items: int, smoothing: float = SMOOTHING
                 ) -> torch.Tensor:
    """S_kl (n_items,) of items against one sentence from the inner products of the items' real
    fragments with the sentence's T fragments: dots (N, T), owner (N,) the item (0 .. n_items - 1) of
    each row, every item with at least one row (one block). The form a search scores many candidates
    in without padding them (index.codes)."""
    sent_of = torch.zeros(dots.shape[1], dtype=torch.long, device=dots.device)
    return skl_from_flat(FlatFragments(dots, owner, sent_of, n_items, 1), smoothing)[:, 0]


def skl(
    img_frags: torch.Tensor,
    img_mask: torch.Tensor,
    sent_frags: torch.Tensor,
    sent_mask: torch.Tensor,
    smoothing: float = SMOOTHING,
    chunk: int | None = None,
    blocks: int = 1,
) -> torch.Tensor:
    """Image–sentence scores S_kl for every image k and sentence l.

    img_frags: (K, F, h) with img_mask: (K, F) (1 = real fragment, 0 = padding);
    sent_frags: (L, T, h) with sent_mask: (L, T). Returns (K, L). Differentiable.
    `chunk` bounds memory by scoring at most that many sentences at a time; `blocks`: the model's
    (``ModelConfig.blocks``, see the module doc).
    """
    if chunk is not None and sent_frags.shape[0] > chunk:
        parts = [
            skl(img_frags, img_mask, sent_frags[s : s + chunk], sent_mask[s : s + chunk], smoothing, blocks=blocks)
            for s in range(0, sent_frags.shape[0], chunk)
        ]
        return torch.cat(parts, dim=1)
    return skl_from_flat(flatten(img_frags, img_mask, sent_frags, sent_mask, blocks), smoothing)


def pair_contributions(img_frags: torch.Tensor, sent_frags: torch.Tensor,
                       smoothing: float = SMOOTHING, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each fragment pair's share of one pair's S_kl: (v_i . s_j (F, T), max(0, v_i . s_j) / (F (T + n)))
    (for several blocks the share is sum_b max(0, v_i^b . s_j^b) / (F (T + n))).

    img_frags: (F, h), sent_frags: (T, h), real fragments only; the shares sum to `skl` of the pair.
    """
    dots, pos = block_dots(img_frags, sent_frags, blocks)
    norm = len(img_frags) * (len(sent_frags) + smoothing)
    return dots, pos / norm


@dataclass(frozen=True)
class Alignment:
    """For each sentence fragment j: its best image fragment and their score v_i . s_j.

    `matched[j]` is False where no image fragment scores above zero (the fragment then
    contributes nothing to S_kl).
    """

    image_fragment: list[int]
    score: list[float]
    matched: list[bool]


def align(img_frags: torch.Tensor, sent_frags: torch.Tensor, blocks: int = 1) -> Alignment:
    """Alignment of one pair. img_frags: (F, h), sent_frags: (T, h) (real fragments only).

    One block: the best v_i . s_j; several: the best thresholded pair score sum_b max(0, v_i^b . s_j^b),
    the pair's share in S_kl (the same choice wherever one block's best score is positive)."""
    dots, pos = block_dots(img_frags, sent_frags, blocks)  # (F, T)
    best, idx = (dots if blocks == 1 else pos).max(dim=0)
    return Alignment(
        image_fragment=[int(i) for i in idx],
        score=[float(s) for s in best],
        matched=[bool(s > 0) for s in best],
    )
