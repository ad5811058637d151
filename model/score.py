"""The image–sentence score S_kl and fragment alignments: the one implementation.

Training, evaluation, the index's re-rank and the service all call these functions. They are written once
against the array API (model/arrays.py): NumPy arrays in the service and the index, torch tensors (with
autograd, on any device) in training.

    S_kl = 1 / (|g_k| (|g_l| + n)) * sum_{i in g_k} sum_{j in g_l} max(0, v_i . s_j)

A merged model (training/merge.py) is B members' embeddings side by side: h = B equal slices
(``ModelConfig.blocks``). Its fragment pair scores are thresholded slice by slice,

    sum_b max(0, v_i^b . s_j^b)    in place of    max(0, v_i . s_j),

so its S_kl is the sum of the members' S_kl (with per-slice calibration, of their calibrated S_kl).
One block (every trained model) is the formula above, computed exactly as before.

Pooling over ranks (``ModelConfig.pool_ranks``, `pool`: weights w_1..w_F summing to 1): for each sentence
fragment j, the image's F thresholded pair scores sorted from the largest, p_(1)j >= ... >= p_(F)j, are summed
with the weights in place of their mean,

    S_kl = 1 / (|g_l| + n) * sum_{j in g_l} sum_r w_r p_(r)j,

the mean's S_kl when every w_r = 1 / F (a max over the image's fragments when w_1 = 1). It needs every image
to have its F fragments (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from array_api_compat import device as array_device

from fragsearch.model.arrays import Array, contiguous, counts, namespace, segment_sum
from fragsearch.model.product import QuantizedRows, block_products, is_large, product

SMOOTHING = 5.0  # the paper's n


def fragment_scores(img_frags: Array, sent_frags: Array) -> Array:
    """Inner products v_i . s_j.

    img_frags: (K, F, h), sent_frags: (L, T, h) -> (K, F, L, T).
    """
    xp = namespace(img_frags, sent_frags)
    k, f, h = img_frags.shape
    n_sent, t, _ = sent_frags.shape
    flat = xp.reshape(img_frags, (k * f, h)) @ xp.reshape(sent_frags, (n_sent * t, h)).T
    return xp.reshape(flat, (k, f, n_sent, t))


def block_slices(h: int, blocks: int) -> list[slice]:
    """The `blocks` equal slices of an h-dimensional embedding (ValueError if h does not split evenly)."""
    if blocks < 1 or h % blocks:
        raise ValueError(f"h = {h} does not split into {blocks} equal blocks")
    w = h // blocks
    return [slice(b * w, (b + 1) * w) for b in range(blocks)]


def positive(x: Array) -> Array:
    """max(0, x), elementwise."""
    return namespace(x).clip(x, min=0.0)


def block_dots(v: Array, s: Array, blocks: int = 1, rows: QuantizedRows | None = None) -> tuple[Array, Array]:
    """v: (I, h), s: (J, h) -> (v . s (I, J), sum_b max(0, v^b . s^b) (I, J)) over `blocks` equal slices of h:
    the raw inner products and the thresholded pair scores S_kl sums. `rows`: v's codes (a fixed matrix read
    through them, model/product.py), which the products then read in its place."""
    xp = namespace(v, s)
    parts = block_slices(v.shape[-1], blocks)
    if rows is not None and rows.shape != tuple(v.shape):
        raise ValueError(f"codes of {rows.shape} rows for fragments of shape {tuple(v.shape)}")
    if blocks == 1:
        dots = product(v, s) if rows is None else rows.product(s)
        return dots, positive(dots)
    if rows is not None or is_large(v, s, blocks):  # a scan: each row of v read once, by ONNX Runtime
        each = block_products(v if rows is None else rows, s, parts)  # (I, B, J)
        dots, pos = each[:, 0].copy(), positive(each[:, 0])
        for b in range(1, blocks):
            dots += each[:, b]
            pos += positive(each[:, b])
        return dots, pos
    # s^b . v^b with v^b (the many rows) as the transposed operand: BLAS reads each slice of v in place
    # (v[:, sl] on the left is copied first, which made a 2-block query's S_kl 2-3x dearer than one block's)
    per_block = xp.stack([s[:, sl] @ v[:, sl].T for sl in parts])  # (B, J, I)
    return contiguous(xp.sum(per_block, axis=0).T), contiguous(xp.sum(positive(per_block), axis=0).T)


@dataclass(frozen=True)
class FlatFragments:
    """Real fragments of a batch, flattened: pairwise scores (I, J) and which item each row/column is of.

    img_of: (I,) image index of each image fragment; sent_of: (J,) sentence index of each sentence
    fragment (both ascending); n_images / n_sentences: how many items the batch has. `positive` (I, J): the
    thresholded pair scores of a model of several blocks (None for one block: ``positive(scores)``).
    `img_per` > 0: every image has that many rows (no padding was left out), so its sums are a reshape's.
    """

    scores: Array
    img_of: Array
    sent_of: Array
    n_images: int
    n_sentences: int
    positive: Array | None = None
    img_per: int = 0


def _owners(n: int, per: int, like: Array) -> Array:
    """(n * per,) ascending owner ids 0, 0, ..., 1, 1, ... of n items with `per` rows each, where `like` is."""
    xp = namespace(like)
    return xp.repeat(xp.arange(n, device=array_device(like)), per)


def flatten(img_frags: Array, img_mask: Array, sent_frags: Array, sent_mask: Array, blocks: int = 1,
            rows: QuantizedRows | None = None) -> FlatFragments:
    """Pairwise scores v_i . s_j of the real fragments only (padding never enters a product); with
    `blocks` > 1 also their slice-wise thresholded sums (`block_dots`). `rows`: the image fragments' codes
    (every fragment real), read by the products in their place."""
    xp = namespace(img_frags, sent_frags)
    k, f, h = img_frags.shape
    n_sent, t, _ = sent_frags.shape
    img_real = xp.reshape(img_mask, (-1,)) > 0
    sent_real = xp.reshape(sent_mask, (-1,)) > 0
    v = xp.reshape(img_frags, (k * f, h))
    s = xp.reshape(sent_frags, (n_sent * t, h))
    img_of = _owners(k, f, img_frags)
    sent_of = _owners(n_sent, t, img_frags)
    img_per = f
    if not bool(xp.all(img_real)):  # selecting copies the fragments: skipped when none is padding
        if rows is not None:
            raise ValueError("coded image fragments are read whole: none may be padding")
        v, img_of, img_per = v[img_real], img_of[img_real], 0
    if not bool(xp.all(sent_real)):
        s, sent_of = s[sent_real], sent_of[sent_real]
    if blocks == 1:  # the training path: the thresholding is skl_from_flat's
        return FlatFragments(product(v, s) if rows is None else rows.product(s), img_of, sent_of, k, n_sent,
                             img_per=img_per)
    dots, pos = block_dots(v, s, blocks, rows)
    return FlatFragments(dots, img_of, sent_of, k, n_sent, pos, img_per)


def _per_image(flat: FlatFragments, rows: Array) -> Array:
    """Sums of `rows` (I, ...) per image (K, ...): a reshape's sum where every image has `img_per` rows."""
    if flat.img_per:
        xp = namespace(rows)
        return xp.sum(xp.reshape(rows, (flat.n_images, flat.img_per, *rows.shape[1:])), axis=1)
    return segment_sum(rows, flat.img_of, flat.n_images, axis=0)


def pooled(flat: FlatFragments, pos: Array, pool: Array) -> Array:
    """(K, J): each image's thresholded pair scores with each sentence fragment (`pos` (I, J)), sorted from the
    largest over the image's fragments and summed with the weights `pool` (F,) (see the module doc)."""
    f = flat.img_per
    if not f:
        raise ValueError("pooling over ranks needs every image with all its fragments (no padding)")
    if pool.shape[0] != f:
        raise ValueError(f"the pooling weighs {pool.shape[0]} ranks, the images have {f} fragments")
    xp = namespace(pos, pool)
    # each image's scores of a sentence fragment sorted along the last axis (a copy with them contiguous: sorting
    # the strided middle axis in place of it took half as long again), the weights reversed for the ascending order
    ranked = xp.sort(contiguous(xp.permute_dims(xp.reshape(pos, (flat.n_images, f, pos.shape[1])), (0, 2, 1))),
                     axis=-1)
    return ranked @ xp.flip(pool, axis=0)


def skl_from_flat(flat: FlatFragments, smoothing: float = SMOOTHING, scratch: bool = False,
                  pool: Array | None = None) -> Array:
    """S_kl (K, L) from the pairwise scores of real fragments: the thresholded sum, normalised. `scratch`: the
    caller needs `flat.scores` no more, so NumPy thresholds it in place (a copy less of the largest array).
    `pool`: the model's weights over ranks (`pooled`), None for the mean."""
    if flat.positive is not None:
        pos = flat.positive  # (I, J)
    elif scratch and isinstance(flat.scores, np.ndarray):
        pos = np.maximum(flat.scores, 0.0, out=flat.scores)
    else:
        pos = positive(flat.scores)
    xp = namespace(pos)
    if pool is not None:
        per_image = pooled(flat, pos, pool)  # (K, J), the image's own normalisation in the weights
        total = (xp.sum(per_image, axis=1)[:, None] if flat.n_sentences == 1
                 else segment_sum(per_image, flat.sent_of, flat.n_sentences, axis=1))
        return total / (counts(flat.sent_of, flat.n_sentences, pos)[None, :] + smoothing)
    if flat.n_sentences == 1:  # one sentence (a search): its fragments summed first, one add per image fragment
        total = _per_image(flat, xp.sum(pos, axis=1))[:, None]  # (K, 1)
    else:
        per_image = _per_image(flat, pos)  # (K, J)
        total = segment_sum(per_image, flat.sent_of, flat.n_sentences, axis=1)  # (K, L)
    n_img = xp.clip(counts(flat.img_of, flat.n_images, pos), min=1.0)
    n_sent = counts(flat.sent_of, flat.n_sentences, pos)
    return total / (n_img[:, None] * (n_sent[None, :] + smoothing))


def skl_of_items(dots: Array, owner: Array, n_items: int, smoothing: float = SMOOTHING) -> Array:
    """S_kl (n_items,) of items against one sentence from the inner products of the items' real
    fragments with the sentence's T fragments: dots (N, T), owner (N,) the item (0 .. n_items - 1) of
    each row, ascending, every item with at least one row (one block). The form a search scores many
    candidates in without padding them (index.codes)."""
    xp = namespace(dots)
    sent_of = xp.zeros(dots.shape[1], dtype=owner.dtype, device=array_device(dots))
    return skl_from_flat(FlatFragments(dots, owner, sent_of, n_items, 1), smoothing)[:, 0]


def skl(
    img_frags: Array,
    img_mask: Array,
    sent_frags: Array,
    sent_mask: Array,
    smoothing: float = SMOOTHING,
    chunk: int | None = None,
    blocks: int = 1,
    pool: Array | None = None,
    rows: QuantizedRows | None = None,
) -> Array:
    """Image–sentence scores S_kl for every image k and sentence l.

    img_frags: (K, F, h) with img_mask: (K, F) (1 = real fragment, 0 = padding);
    sent_frags: (L, T, h) with sent_mask: (L, T). Returns (K, L). Differentiable (torch).
    `chunk` bounds memory by scoring at most that many sentences at a time; `blocks`: the model's
    (``ModelConfig.blocks``, see the module doc); `pool`: its weights over ranks (None: the mean); `rows`: the
    image fragments' codes (model/product.py `QuantizedRows`: a fixed set of images, scored through them).
    """
    if chunk is not None and sent_frags.shape[0] > chunk:
        xp = namespace(img_frags, sent_frags)
        parts = [
            skl(img_frags, img_mask, sent_frags[s : s + chunk], sent_mask[s : s + chunk], smoothing, blocks=blocks,
                pool=pool, rows=rows)
            for s in range(0, sent_frags.shape[0], chunk)
        ]
        return xp.concat(parts, axis=1)
    return skl_from_flat(flatten(img_frags, img_mask, sent_frags, sent_mask, blocks, rows), smoothing,
                         scratch=True, pool=pool)


def pair_contributions(img_frags: Array, sent_frags: Array,
                       smoothing: float = SMOOTHING, blocks: int = 1) -> tuple[Array, Array]:
    """Each fragment pair's share of one pair's S_kl: (v_i . s_j (F, T), max(0, v_i . s_j) / (F (T + n)))
    (for several blocks the share is sum_b max(0, v_i^b . s_j^b) / (F (T + n))).

    img_frags: (F, h), sent_frags: (T, h), real fragments only; the shares sum to `skl` of the pair.
    """
    dots, pos = block_dots(img_frags, sent_frags, blocks)
    norm = img_frags.shape[0] * (sent_frags.shape[0] + smoothing)
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


def alignment_scores(img_frags: Array, sent_frags: Array, blocks: int = 1) -> Array:
    """(F, T) the score by which each sentence fragment picks its image fragment: v_i . s_j for one block, the
    thresholded pair score sum_b max(0, v_i^b . s_j^b) for several (`align`; phrase evidence reads the same)."""
    dots, pos = block_dots(img_frags, sent_frags, blocks)
    return dots if blocks == 1 else pos


def align(img_frags: Array, sent_frags: Array, blocks: int = 1) -> Alignment:
    """Alignment of one pair. img_frags: (F, h), sent_frags: (T, h) (real fragments only).

    One block: the best v_i . s_j; several: the best thresholded pair score sum_b max(0, v_i^b . s_j^b),
    the pair's share in S_kl (the same choice wherever one block's best score is positive). Ties go to the
    first image fragment."""
    xp = namespace(img_frags, sent_frags)
    chosen = alignment_scores(img_frags, sent_frags, blocks)  # (F, T)
    idx = xp.argmax(chosen, axis=0)
    best = xp.max(chosen, axis=0)
    return Alignment(
        image_fragment=[int(i) for i in idx],
        score=[float(s) for s in best],
        matched=[bool(s > 0) for s in best],
    )
