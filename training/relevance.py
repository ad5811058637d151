"""The relevance scale's fit (its form and maths in model/calibration.py `Relevance`): the probability that a
person would call a result a match, fitted on the validation part of the training data (the images
--selection val held out, never dev).

A pair is a match when the sentence was written for the image, or when one of the image's captions says what
the sentence says as closely as the sentence's own image's other captions typically do (`described_alike`:
MiniLM sentence vectors, the median of each sentence's best cosine to its own image's other captions as the
bar); a scale with phrase evidence is fitted with the matches of training/evidence.py `named_alike` beside
them. The curve is fitted on what searches show: the top `FIT_TOP_K` of every query of the validation part,
both ways (images for a sentence, sentences for an image), in collections of its images and of its images
with the other training images and their captions beside them (`DISTRACTORS`, whose own queries are not
asked), so that the best of many is not taken for a match. Training fits it for the epoch it keeps;
training/calibrate.py refits it for a checkpoint or a model in the runtime's form, training/evidence.py with
the phrase evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import RELEVANCE_TOP, Relevance, competition, probability
from fragsearch.model.dataset import SplitData, select_images
from fragsearch.training.evaluate import evaluate_scores, score_split
from fragsearch.training.nets.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


RIDGE = 1e-3  # L2 penalty of the relevance fit (keeps it finite when the kinds of pairs separate)
FIT_TOP_K = 10  # results of each query the relevance is fitted on (what a search shows)
FIT_SIZES = (0.2, 0.5, 1.0)  # collection sizes the fit draws, as shares of the validation part's images
FIT_DRAWS = 3  # collections drawn at each size below the largest
DISTRACTORS: int | None = None  # training images (with their captions) the fit's collections add to the
# validation part's: None, every image trained on (more of them fit the larger collections better: dev ECE 0.025
# -> 0.014 and 0.060 -> 0.016 from none to 5,500, search / annotation)
DISTRACTOR_SHARES = (0.25, 0.5, 1.0)  # collections of the validation part and these shares of the distractors
# the competition's sharpness the fit chooses among (model.calibration `competition`), in units of one over the
# spread (standard deviation) of the shown pairs' scores, so that it does not depend on the score's scale
BETAS = (0.35, 0.7, 1.4, 2.8)
# the share of the validation part's queries also asked of their collection without what they were written for
# (searches for what a collection does not hold; chosen on the released model's validation part as the largest
# of 0.1, 0.25 and 0.5 whose relevance stays within 0.05 calibration error on the queries whose collection holds
# it, each side: 0.013 / 0.033 at 0.25, 0.020 / 0.054 at 0.5; docs/results/relevance.md)
WITHOUT_OWN = 0.25
RELIABILITY_BINS = 10  # equal-width bins of relevance in a reliability table
ALIKE_QUANTILE = 0.5  # the bar of `described_alike`: this quantile of the own image's other captions' best cosine


@dataclass
class Judged:
    """What a relevance fit reads: the validation part's queries (its captions, its images) against the
    validation part's items and the distractors' (training items beside it, whose own queries are not asked),
    with which pairs are a match (`alike_blocks`).

    search: (I, Lq) every image's score for the validation part's Lq captions, its `n_images` images first;
    annotate: (n_images, L) the validation part's images' scores for every caption, its Lq captions first;
    caption_image: (L,) the image each caption describes."""

    search: np.ndarray
    search_matches: np.ndarray
    annotate: np.ndarray
    annotate_matches: np.ndarray
    caption_image: np.ndarray
    n_images: int

    @property
    def n_captions(self) -> int:
        return int(self.search.shape[1])


def alike_blocks(vectors: np.ndarray, caption_image: np.ndarray, n_images: int, n_captions: int,
                 quantile: float = ALIKE_QUANTILE, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Which pairs are a match, for `Judged`'s two blocks: (every image x the first `n_captions` captions,
    the first `n_images` images x every caption), bool. A pair is a match when the caption describes the
    image, or when one of the image's captions is as close to it (cosine of unit `vectors` (L, d)) as the
    bar: the `quantile` of each of the first captions' best cosine to its own image's other captions. An
    image's captions are compared one short (one left out at random) so that it has as many as a caption's
    own image has others; a caption is not its own paraphrase. The first `n_captions` captions are those of
    the first `n_images` images."""
    vectors = np.asarray(vectors, dtype=np.float32)
    caption_image = np.asarray(caption_image)
    n, n_sent = int(caption_image.max()) + 1, len(caption_image)
    rng = np.random.default_rng(seed)
    cos = vectors[:n_captions] @ vectors.T  # (Lq, L)
    cos[np.arange(n_captions), np.arange(n_captions)] = -np.inf
    captions = [np.flatnonzero(caption_image == k) for k in range(n)]
    own_best = np.array([cos[i, captions[caption_image[i]]].max() for i in range(n_captions)])
    finite = own_best[np.isfinite(own_best)]  # images with one caption have no others
    bar = float(np.quantile(finite, quantile)) if len(finite) else np.inf
    search = np.full((n, n_captions), -np.inf, dtype=np.float32)
    annotate = np.full((n_images, n_sent), -np.inf, dtype=np.float32)
    for k, caps in enumerate(captions):
        kept = caps if len(caps) < 2 else np.delete(caps, rng.integers(len(caps)))
        if len(kept):
            search[k] = cos[:, kept].max(axis=1)
            if k < n_images:
                annotate[k] = cos[kept].max(axis=0)
    search_matches, annotate_matches = search >= bar, annotate >= bar
    search_matches[caption_image[:n_captions], np.arange(n_captions)] = True
    mine = np.flatnonzero(caption_image < n_images)
    annotate_matches[caption_image[mine], mine] = True
    return search_matches, annotate_matches


def described_alike(vectors: np.ndarray, pair_image: np.ndarray, quantile: float = ALIKE_QUANTILE,
                    seed: int = 0) -> np.ndarray:
    """Which pairs of one collection are a match (N_images, L) bool (`alike_blocks` with every image and
    caption a query's)."""
    pair_image = np.asarray(pair_image)
    return alike_blocks(vectors, pair_image, int(pair_image.max()) + 1, len(pair_image), quantile, seed)[0]


@dataclass
class Shown:
    """The pairs queries show (their `FIT_TOP_K` best) in collections: each pair's score, whether it is a match,
    its side, and its query's best `RELEVANCE_TOP` + 1 scores in its collection (`best`, one row a query)."""

    score: np.ndarray
    match: np.ndarray
    search: np.ndarray  # bool: a search's pair (else an annotation's)
    query: np.ndarray  # the row of `best` of each pair's query
    best: np.ndarray
    items: np.ndarray  # the items of each pair's query's collection
    caption: np.ndarray | None = None  # each pair's caption and image (`Judged`'s numbering), where known
    image: np.ndarray | None = None
    evidence: np.ndarray | None = None  # (n, 2) each pair's phrase evidence terms (model/evidence.py), when read

    def competition(self, rel: Relevance | None = None, beta: float = 0.0, pad: float = 0.0) -> np.ndarray:
        """Each pair's `fragsearch.model.calibration.competition` (with `rel`'s beta and pad, or these)."""
        beta, pad = (beta, pad) if rel is None else (rel.beta, rel.pad)
        out = np.zeros(len(self.score))
        for q0 in range(0, len(self.best), 4096):  # queries a step
            sel = np.flatnonzero((self.query >= q0) & (self.query < q0 + 4096))
            order = sel[np.argsort(self.query[sel], kind="stable")]
            q = self.query[order]
            counts = np.bincount(q - q0, minlength=min(4096, len(self.best) - q0))
            width = int(counts.max(initial=0))
            if not width:
                continue
            slot = np.arange(len(q)) - np.repeat(np.cumsum(counts) - counts, counts)
            grid = np.full((len(counts), width), -np.inf)
            grid[q - q0, slot] = self.score[order]
            x = competition(self.best[q0 : q0 + len(counts)], np.where(np.isfinite(grid), grid, 0.0), beta,
                            RELEVANCE_TOP, pad)
            out[order] = x[q - q0, slot]
        return out

    def of_queries(self, keep: np.ndarray) -> Shown:
        """The pairs of the queries `keep` (bool, one a row of `best`) alone."""
        return self.of_pairs(keep[self.query])

    def of_pairs(self, sel: np.ndarray) -> Shown:
        """The pairs `sel` (bool) alone."""
        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[sel]

        return Shown(self.score[sel], self.match[sel], self.search[sel], self.query[sel], self.best, self.items[sel],
                     cut(self.caption), cut(self.image), cut(self.evidence))

    def relevance(self, rel: Relevance) -> np.ndarray:
        """Each pair's relevance by `rel` for its query."""
        return probability(rel.log_odds_of(self.score, self.competition(rel), self.search, self.items,
                                           self.evidence))


def best_of(scores: np.ndarray, k: int) -> np.ndarray:
    """(Q, k) the best k of each row of `scores` (Q, n), best first, -inf past n."""
    out = np.full((len(scores), k), -np.inf)
    m = min(k, scores.shape[1])
    if m:
        part = -np.partition(-scores, m - 1, axis=1)[:, :m] if m < scores.shape[1] else scores.copy()
        out[:, :m] = -np.sort(-part, axis=1)
    return out


def shown(scores: np.ndarray, matches: np.ndarray, search: bool, k: int = FIT_TOP_K,
          rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> Shown:
    """What one collection's queries show: `scores` (Q, n) each query's scores for the collection's items,
    `matches` (Q, n) which are a match; `rows` and `cols`, where given, the queries' and the items' numbers
    (captions and images of a search, images and captions of an annotation) the pairs then carry."""
    idx = np.argsort(-scores, axis=1, kind="stable")[:, : min(k, scores.shape[1])]
    q = np.repeat(np.arange(len(scores)), idx.shape[1])
    top = np.take_along_axis(scores, idx, 1).ravel().astype(np.float64)
    real = np.isfinite(top)  # an item left out of a query's collection scores -inf
    held = np.isfinite(scores).sum(axis=1)  # the items of each query's collection
    caption = image = None
    if rows is not None and cols is not None:
        query_of, item_of = np.asarray(rows)[q[real]], np.asarray(cols)[idx.ravel()[real]]
        caption, image = (query_of, item_of) if search else (item_of, query_of)
    return Shown(top[real], np.take_along_axis(matches, idx, 1).ravel()[real], np.full(int(real.sum()), search),
                 q[real], best_of(scores.astype(np.float64), RELEVANCE_TOP + 1), held[q[real]], caption, image)


def joined(parts: list[Shown]) -> Shown:
    """The pairs of several collections' queries as one."""
    offsets = np.cumsum([0] + [len(p.best) for p in parts])[:-1]

    def whole(name: str) -> np.ndarray | None:
        got = [getattr(p, name) for p in parts]
        return None if any(g is None for g in got) else np.concatenate(got)

    return Shown(np.concatenate([p.score for p in parts]), np.concatenate([p.match for p in parts]),
                 np.concatenate([p.search for p in parts]),
                 np.concatenate([p.query + o for p, o in zip(parts, offsets, strict=True)]),
                 np.concatenate([p.best for p in parts]), np.concatenate([p.items for p in parts]),
                 whole("caption"), whole("image"), whole("evidence"))


def collections(judged: Judged, seed: int = 0) -> tuple[list[Shown], list[Shown]]:
    """What the validation part's queries show in collections of its images (`FIT_SIZES` of them,
    `FIT_DRAWS` draws below the whole part) and of all of them with `DISTRACTOR_SHARES` of the distractors,
    both sides of each collection (the images for its captions, the captions for its images): as they are,
    and with each query's own items left out (what it was written for: a search for what the collection does
    not hold)."""
    rng = np.random.default_rng(seed)
    iq, total = judged.n_images, judged.search.shape[0]
    picks: list[np.ndarray] = []
    for share in FIT_SIZES:
        size = max(2, round(share * iq))
        for _ in range(1 if size >= iq else FIT_DRAWS):
            picks.append(np.arange(iq) if size >= iq else np.sort(rng.choice(iq, size, replace=False)))
    extra = total - iq
    for share in DISTRACTOR_SHARES if extra else ():
        size = max(1, round(share * extra))
        for _ in range(1 if size >= extra else FIT_DRAWS):
            more = np.arange(extra) if size >= extra else np.sort(rng.choice(extra, size, replace=False))
            picks.append(np.concatenate([np.arange(iq), iq + more]))
    present: list[Shown] = []
    absent: list[Shown] = []
    for images in picks:
        mine = images[images < iq]
        queries = np.flatnonzero(np.isin(judged.caption_image[: judged.n_captions], mine))
        items = np.flatnonzero(np.isin(judged.caption_image, images))
        if len(queries) < 2 or len(items) < 2:
            continue
        search = judged.search[np.ix_(images, queries)].T
        search_matches = judged.search_matches[np.ix_(images, queries)].T
        annotate = judged.annotate[np.ix_(mine, items)]
        annotate_matches = judged.annotate_matches[np.ix_(mine, items)]
        own = judged.caption_image[queries][:, None] == images[None, :]
        mine_own = judged.caption_image[items][None, :] == mine[:, None]
        present += [shown(search, search_matches, True, rows=queries, cols=images),
                    shown(annotate, annotate_matches, False, rows=mine, cols=items)]
        absent += [shown(np.where(own, -np.inf, search), search_matches & ~own, True, rows=queries, cols=images),
                   shown(np.where(mine_own, -np.inf, annotate), annotate_matches & ~mine_own, False, rows=mine,
                         cols=items)]
    return present, absent


def reliability(pred: np.ndarray, truth: np.ndarray, bins: int = RELIABILITY_BINS) -> list[dict[str, float]]:
    """Per equal-width bin of predicted relevance: pairs, mean prediction, observed share of matches."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(pred, edges[1:-1]), 0, bins - 1)
    rows = []
    for b in range(bins):
        sel = which == b
        n = int(sel.sum())
        rows.append({"bin_low": round(float(edges[b]), 2), "bin_high": round(float(edges[b + 1]), 2), "pairs": n,
                     "predicted": round(float(pred[sel].mean()), 4) if n else float("nan"),
                     "observed": round(float(truth[sel].mean()), 4) if n else float("nan")})
    return rows


def calibration_error(table: list[dict[str, float]]) -> float:
    """The expected calibration error of a `reliability` table: |predicted - observed| weighed by pairs."""
    total = sum(r["pairs"] for r in table)
    return float(sum(r["pairs"] * abs(r["predicted"] - r["observed"]) for r in table if r["pairs"]) / max(1, total))


def _logistic(x: np.ndarray, y: np.ndarray, steps: int = 100, weights: np.ndarray | None = None
              ) -> tuple[np.ndarray, float]:
    """Maximum-likelihood weights of a logistic regression (Newton's method, ridge `RIDGE`; `weights`: each
    row's weight in the likelihood, default 1) and the negative log-likelihood they reach."""
    w = np.zeros(x.shape[1])
    c = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)

    def nll(v: np.ndarray) -> float:
        z = x @ v
        return float(np.sum(c * (np.logaddexp(0.0, z) - y * z)) + RIDGE * v @ v / 2)

    f = nll(w)
    for _ in range(steps):
        p = probability(x @ w)
        grad = x.T @ (c * (p - y)) + RIDGE * w
        hess = (x * (c * p * (1 - p))[:, None]).T @ x + RIDGE * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6 and nll(w - t * step) > f:
            t /= 2
        if t <= 1e-6:
            break
        w = w - t * step
        f_new = nll(w)
        if f - f_new < 1e-10 * max(1.0, abs(f)):
            f = f_new
            break
        f = f_new
    return w, f


def _fit(pairs: Shown, pad: float) -> Relevance:
    """The likeliest scale of these pairs, its beta the likeliest of `BETAS` (over the scores' spread); with
    the pairs' phrase evidence (`Shown.evidence`), its two terms beside them. The score's, the competition's and
    the evidence terms' weights are kept >= 0 (a better score, a result further ahead, a thing likelier found
    never lowers the odds): a column whose weight comes out negative is left out and the rest refitted — the
    competition first, then the score, then the evidence term that came out lowest."""
    y = pairs.match.astype(np.float64)
    sides = np.stack([pairs.search, ~pairs.search], axis=1).astype(np.float64)
    sizes = sides * np.log(pairs.items)[:, None]
    best: tuple[float, Relevance] | None = None
    spread = float(np.std(pairs.score)) or 1.0
    terms = np.zeros((len(y), 0)) if pairs.evidence is None else np.asarray(pairs.evidence, dtype=np.float64)
    n_terms = terms.shape[1]
    for beta in (b / spread for b in BETAS):
        x = pairs.competition(beta=beta, pad=pad)
        columns = np.column_stack([pairs.score, x, sides, sizes, terms])
        kept = list(range(columns.shape[1]))
        while True:
            w_kept, f = _logistic(columns[:, kept], y)
            w = np.zeros(columns.shape[1])
            w[kept] = w_kept
            negative: list[int] = [c for c in (1, 0) if c in kept and w[c] < 0]
            negative += sorted((c for c in range(6, 6 + n_terms) if c in kept and w[c] < 0), key=lambda c: w[c])
            if not negative:
                break
            kept.remove(negative[0])
        if not (w[0] > 0 or w[1] > 0):
            continue
        evidence = (float(w[6]), float(w[7])) if n_terms else (0.0, 0.0)
        rel = Relevance(float(w[0]), float(w[1]), beta, float(w[2]), float(w[3]), pad, float(w[4]), float(w[5]),
                        evidence=evidence)
        logger.debug("relevance with beta %.3g: negative log-likelihood %.1f", beta, f)
        if best is None or f < best[0]:
            best = (f, rel)
    if best is None:
        raise ValueError("the score does not rise with the odds of a match: no relevance scale")
    return best[1]


def fit_relevance(judged: Judged, seed: int = 0,
                  evidence_of: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> Relevance:
    """The relevance scale (model.calibration.Relevance) fitted by maximum likelihood on what the validation
    part's queries show (`collections`), a share (`WITHOUT_OWN`) of them also of the collection without what
    they were written for; with `evidence_of` (captions, images -> (n, 2) phrase evidence terms, `Judged`'s
    numbering), the scale reads the phrase evidence too.
    ValueError when the score does not rise with the odds of a match."""
    present, absent = collections(judged, seed)
    pairs = joined(present)
    if not len(pairs.score) or not pairs.match.any() or pairs.match.all():
        raise ValueError("the validation part's shown pairs are all matches or none: no relevance scale")
    # a missing competitor scores as the last one counted does in the largest collection's searches (median)
    largest = max(range(0, len(present), 2), key=lambda i: int(present[i].items[0]) if len(present[i].items) else 0)
    kth = present[largest].best[:, :RELEVANCE_TOP]
    pad = float(np.median(np.nanmin(np.where(np.isfinite(kth), kth, np.nan), axis=1)))
    rng = np.random.default_rng(seed)
    asked = [p.of_queries(rng.random(len(p.best)) < WITHOUT_OWN) for p in absent]
    fitted = joined([*present, *asked])
    if evidence_of is not None:
        assert fitted.caption is not None and fitted.image is not None
        fitted = replace(fitted, evidence=evidence_of(fitted.caption, fitted.image))
    return _fit(fitted, pad)


def matches_of(data: SplitData) -> np.ndarray:
    """`described_alike` of a split's sentences (their MiniLM sentence vectors)."""
    from fragsearch.model.words import encode_sentences

    return described_alike(encode_sentences(data.sentences), data.pair_image)


def distractors_of(rest: SplitData, n: int | None = DISTRACTORS, seed: int = 0) -> SplitData:
    """`n` images of the training part (with their captions; None: all), drawn with `seed`: what the relevance
    fit's larger collections add to the validation part."""
    if n is None or len(rest.names) <= n:
        return rest
    return select_images(rest, np.random.default_rng(seed).choice(len(rest.names), n, replace=False))


def judge(bundle: Checkpoint | Bundle, val: SplitData, distractors: SplitData | None = None,
          scores: np.ndarray | None = None) -> Judged:
    """The validation part's queries scored against its items and the `distractors`' (training images and
    captions), with which pairs are a match (MiniLM sentence vectors: `alike_blocks`); `scores`: the
    validation part's own (images x captions) matrix, when it was scored already."""
    from fragsearch.model.words import encode_sentences

    if scores is None:
        scores = evaluate_scores(bundle, val)[1]
    search, annotate, caption_image, sentences = scores, scores, np.asarray(val.pair_image), list(val.sentences)
    if distractors is not None and len(distractors.names):
        val_enc = bundle.text.encode_parsed(val.parsed, val.sentences)
        other_enc = bundle.text.encode_parsed(distractors.parsed, distractors.sentences)
        search = np.concatenate([scores, score_split(bundle, distractors.feats, val_enc)])
        annotate = np.concatenate([scores, score_split(bundle, val.feats, other_enc)], axis=1)
        caption_image = np.concatenate([caption_image, np.asarray(distractors.pair_image) + len(val.names)])
        sentences += distractors.sentences
    search_matches, annotate_matches = alike_blocks(encode_sentences(sentences), caption_image, len(val.names),
                                                    len(val.sentences))
    return Judged(search, search_matches, annotate, annotate_matches, caption_image, len(val.names))
