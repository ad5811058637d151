"""The read side of an index: candidates -> prescore -> exact re-rank -> payloads.

`Ranker.rank` scores a query's candidates (the backend's recall, optionally cut to the `rerank` best
by a prescore: the partial score of their retrieved fragments, or, with prescore codes (index.codes)
and an approximate score from the caller, the score of their codes) or every live item exactly (an
exhaustive search, or a collection under `SearchSettings.exact_below` fragments), and returns the top k
with their payloads and stored fragments; `rank_many` ranks many queries in one pass over the store;
`place` is where one item stands for a query (index.images' explain). The score is the caller's
(the model's S_kl, model.score), so the image and the sentence index rank through the same code.

Callers of `rank` and `rank_many` need no lock; the other reads are made under the index's
`reading()` lock, which the caller holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np

from fragsearch.index import ids as fid
from fragsearch.index.candidates import CandidateBackend
from fragsearch.index.codes import ApproxScore, PrescoreCodes
from fragsearch.index.items import ItemTable
from fragsearch.index.selection import best_positions
from fragsearch.index.shared import SharedFragments
from fragsearch.index.stored import StoredFragments
from fragsearch.index.types import ExplainScope, IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import RELEVANCE_TOP

SCAN_ITEMS = 2048  # items per chunk of an exhaustive scan
SHORTLIST = 8  # with summaries S: the thresholded summary score only for the 8 S best by the linear one
CONTEXT = RELEVANCE_TOP + 1  # the best scores of a ranking kept beside its page (a result's relevance reads them)
FILTERED_EXACT = 20_000  # a filtered search scores at most this many allowed items exactly, without candidates
SEARCH_PATHS = ("scan", "candidates")  # how a search found what it ranks (Ranker.searches)

P = TypeVar("P")
Score = Callable[[np.ndarray, np.ndarray], np.ndarray]  # stored (C, F, h), mask (C, F) -> (C, Q)
Ranked = tuple[int, float, P, np.ndarray]  # item, score, payload, its stored fragments (n, h)


# -- top k: ties always go to the smaller item id, as in the final ranking ------------------------------
RANK_DIGITS = 5  # significant digits of a score that ranking compares


def rank_key(scores: np.ndarray) -> np.ndarray:
    """Scores as ranking compares them: rounded to RANK_DIGITS significant digits. Two items whose S_kl
    differ only by float rounding (the same fragments summed in another order, in another batch, or by
    another instruction set's kernels) then tie, and the tie goes to the smaller id on every machine."""
    s = np.asarray(scores, dtype=np.float64)
    exponent = np.floor(np.log10(np.maximum(np.abs(s), 1e-300)))
    quantum = 10.0 ** (exponent - (RANK_DIGITS - 1))
    return np.round(s / quantum) * quantum


def top_k(scores: np.ndarray, items: np.ndarray, k: int) -> list[tuple[int, int, float]]:
    """The k best (position, item, score) by score (`rank_key`), ties broken by the smaller item id."""
    if len(items) == 0 or k <= 0:
        return []
    order = np.lexsort((items, -rank_key(scores)))[:k]
    return [(int(p), int(items[p]), float(scores[p])) for p in order]


def group_items(items: np.ndarray, weights: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids among `items` (ascending; each in [0, bound)) and the sum of their `weights`:
    counted over the id range when it is not much larger than the list (no sort), else sorted."""
    if len(items) and bound <= 8 * len(items):
        present = np.zeros(bound, bool)
        present[items] = True
        uniq = np.flatnonzero(present)
        return uniq, np.bincount(items, weights=weights, minlength=bound)[uniq]
    uniq, where = np.unique(items, return_inverse=True)
    return uniq, np.bincount(where, weights=weights, minlength=len(uniq))


def merge_top_k(best: list[tuple[int, float]], items: np.ndarray, scores: np.ndarray, k: int
                ) -> list[tuple[int, float]]:
    """Running top-k over chunks of an exhaustive scan: (item, score) pairs."""
    merged = best + [(int(i), float(s)) for _, i, s in top_k(scores, items, k)]
    keys = rank_key(np.array([s for _, s in merged]))
    order = sorted(range(len(merged)), key=lambda n: (-keys[n], merged[n][0]))
    return [merged[n] for n in order[:k]]


def exact_score(bundle: Bundle, queries: Sequence[np.ndarray], stored: Literal["images", "sentences"]) -> Score:
    """The model's S_kl of stored items against `queries` (each (T_q, h)): stored fragments (C, F, h) with
    their mask (C, F) -> scores (C, Q). `stored` says which side the items are: images scored for
    sentence queries, or sentences scored for image queries."""
    t_max = max((len(q) for q in queries), default=1)
    dim = queries[0].shape[-1] if len(queries) else bundle.dim
    padded = np.zeros((len(queries), t_max, dim), np.float32)
    q_mask = np.zeros((len(queries), t_max), np.float32)
    for n, q in enumerate(queries):
        padded[n, : len(q)] = q
        q_mask[n, : len(q)] = 1
    if stored == "images":
        return lambda vecs, mask: bundle.scores(vecs, mask, padded, q_mask)
    return lambda vecs, mask: bundle.scores(padded, q_mask, vecs, mask).T


class RankedIndex(Protocol[P]):
    """What the ranker reads of an index (index.base.FragmentIndex)."""

    @property
    def settings(self) -> IndexSettings: ...
    @property
    def candidates(self) -> CandidateBackend: ...
    @property
    def items(self) -> ItemTable[P]: ...
    @property
    def stored(self) -> StoredFragments: ...
    @property
    def shared(self) -> SharedFragments | None: ...
    @property
    def codes(self) -> PrescoreCodes | None: ...
    @property
    def PRESCORE_SMOOTHING(self) -> float: ...  # noqa: N802 (a class constant of the index)
    def reading(self) -> AbstractContextManager[None]: ...
    def payloads(self, items: Sequence[int]) -> dict[int, P]: ...


@dataclass(frozen=True)
class Placement:
    """Where one item stands for a query: its score, its rank among the `considered` items ranked
    (1 = best, ties to the smaller id), over the whole `scope` or the candidates, and whether the
    candidate recall finds it at all (always, for a collection ranked whole)."""

    score: float
    rank: int
    considered: int
    scope: ExplainScope
    recalled: bool
    best: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the best scores of those ranked (`CONTEXT`)
    collection: int = 0  # the live items of the collection


class Ranker(Generic[P]):
    """Candidate recall and the exact re-rank over one index's items."""

    def __init__(self, index: RankedIndex[P]) -> None:
        self.index = index
        self._searches = dict.fromkeys(SEARCH_PATHS, 0)
        self._searches_lock = threading.Lock()

    @property
    def searches(self) -> dict[str, int]:
        """Searches answered since the index was opened, per path: "scan" (the exact score over every
        live item: a collection under `SearchSettings.exact_below` fragments, or an exhaustive search) or
        "candidates" (the backend's recall, then the exact re-rank of what it recalled)."""
        with self._searches_lock:
            return dict(self._searches)

    def _searched(self, path: str) -> None:
        with self._searches_lock:
            self._searches[path] += 1

    # -- ranking -------------------------------------------------------------------------------------
    def rank(self, queries: np.ndarray, score: Score, k: int, exhaustive: bool = False,
             allowed: np.ndarray | None = None, approx: ApproxScore | None = None
             ) -> tuple[list[Ranked[P]], int, np.ndarray, int]:
        """The k best items by `score` of their stored fragments ((C, F, h), mask (C, F) -> (C, 1): one
        query, `exact_score`), and how many items the exact score ranked (the candidates, or every live item).

        Scored are the backend's candidates of `queries` (t, h), or every live item when `exhaustive`.
        `allowed` (sorted ids: a date and place filter) limits the ranking to those items: all of them
        scored exactly when they are at most FILTERED_EXACT (or the collection is scanned anyway),
        else their candidates. `approx` is the same score against other query fragments
        ((C, F, d), mask, queries (t, d) -> (C,)): given, the candidates are prescored on their codes.
        Returns (item, score, payload, fragments (n, h)) best first, ties to the smaller id, how many items the
        exact score ranked, the best `CONTEXT` of their scores, best first, and how many items the collection
        searched holds (every live item, or those passing the filter): what a result's relevance reads
        (model.calibration.Relevance.for_query).
        """
        index = self.index
        with index.reading():
            if allowed is not None and len(allowed):
                allowed = allowed[index.items.live_among(allowed)]
            if allowed is not None and not len(allowed):  # nothing passes the filter: nothing to rank
                return [], 0, np.zeros(0), 0
            held = index.items.count if allowed is None else len(allowed)
            if allowed is not None and not (exhaustive or self.small() or len(allowed) <= FILTERED_EXACT):
                return (*self._ranked(self.candidates(queries, allowed, approx), score, k), held)
            if exhaustive or self.small() or allowed is not None:
                best: list[tuple[int, float]] = []
                considered = 0
                for part, vecs, mask in self._scan(items=allowed):
                    best = merge_top_k(best, part, score(vecs, mask)[:, 0], max(k, CONTEXT))
                    considered += len(part)
                context = np.asarray([s for _, s in best[:CONTEXT]], dtype=np.float64)
                best = best[:k]
                items = np.asarray([i for i, _ in best], dtype=np.int64)
                vecs, mask = index.stored.vectors(items)
            else:
                candidates = self.candidates(queries, approx=approx)
                return (*self._ranked(candidates, score, k), held)
            payloads = index.payloads(items.tolist())
        return [(item, s, payloads[item], vecs[row, : int(mask[row].sum())])
                for row, (item, s) in enumerate(best)], considered, context, held

    def rank_many(self, score: Score, n_queries: int, k: int) -> list[list[tuple[int, float]]]:
        """Exact top k (item, score) of n queries in one pass over the store; `score` maps stored
        fragments ((C, F, h), mask (C, F)) to (C, n_queries) scores."""
        best: list[list[tuple[int, float]]] = [[] for _ in range(n_queries)]
        with self.index.reading():
            for part, vecs, mask in self._scan():
                scores = score(vecs, mask)
                for q in range(n_queries):
                    best[q] = merge_top_k(best[q], part, scores[:, q], k)
        return best

    def place(self, item: int, queries: np.ndarray, score: Score, approx: ApproxScore | None = None) -> Placement:
        """Where live `item` stands for `queries` by `score`, ranked as a search ranks: a collection a
        search scans whole is ranked whole; a larger one over the candidates the index recalls for
        the queries plus this item, so the cost stays that of a search (caller holds `reading`)."""
        ids, scores = [], []
        scope: ExplainScope = "collection"
        recalled = True
        if self.small():
            for part, vecs, mask in self._scan():  # the same batched score as an exhaustive search
                ids.append(part)
                scores.append(score(vecs, mask)[:, 0])
        else:
            candidates = self.candidates(queries, approx=approx)
            scope, recalled = "candidates", bool(np.isin(item, candidates))
            ranked = np.union1d(candidates, np.asarray([item], dtype=np.int64))
            vecs, mask = self.index.stored.vectors(ranked)
            ids.append(ranked)
            scores.append(score(vecs, mask)[:, 0])
        all_ids, all_scores = np.concatenate(ids), np.concatenate(scores)
        mine = float(all_scores[all_ids == item][0])
        keys = rank_key(all_scores)
        key = keys[all_ids == item][0]
        ahead = (keys > key) | ((keys == key) & (all_ids < item))
        return Placement(mine, 1 + int(np.count_nonzero(ahead)), len(all_ids), scope, recalled,
                         -np.sort(-all_scores.astype(np.float64))[:CONTEXT], self.index.items.count)

    def small(self) -> bool:
        """At most `SearchSettings.exact_below` live fragments: the exact scan is the cheaper search."""
        limit = self.index.settings.search.exact_below
        items = self.index.items
        return bool(limit) and items.count <= limit and items.fragments() <= limit

    # -- candidates ----------------------------------------------------------------------------------
    def candidates(self, queries: np.ndarray, allowed: np.ndarray | None = None,
                   approx: ApproxScore | None = None) -> np.ndarray:
        """queries: (t, dim) -> ids of the live items with a fragment among a query's k' nearest
        (k' = 0: every fragment with a positive score) (caller holds `reading`); with `allowed`
        (sorted ids), only those items: a backend that filters while it searches (Milvus) is given
        them, the others' results are filtered after.

        With `SearchSettings.rerank` = R > 0, only the R items with the best prescore are kept for the exact
        re-rank: the partial score (`_prescore` of the sum of max(0, backend score) over their retrieved
        fragments), or, when the index has prescore codes and `approx` is given, `approx` of their codes
        against the projected queries (of the `SearchSettings.prescore` best by partial score, 0: of all;
        with refining codes, the `SearchSettings.refine` best of those scored again on both codes);
        candidates without codes yet (added since the last save) are all kept.

        The stages, each a step of its own: `_recall` (the backend) or `_summary_cut` (the items'
        summaries), `_first_cut` (the partial score), `_code_cut` (the prescore codes), `_refine` (both
        codes); the exact re-rank of what is left is `rank`'s.
        """
        self._searched("candidates")
        index = self.index
        searching = index.settings.search  # the cascade reads the search settings only
        if index.candidates.ntotal == 0 or (allowed is not None and not len(allowed)):
            return np.zeros(0, np.int64)
        codes = index.codes if approx is not None else None
        if searching.summaries and searching.rerank and allowed is None and codes is not None:
            found, uncoded = self._summary_cut(queries)
        else:
            uniq, summed, live = self._recall(queries, allowed)
            limit = searching.rerank
            if not limit or live.sum() <= limit:
                return uniq[live]
            kept = self._first_cut(uniq, summed, live,
                                   limit if codes is None else searching.prescore or len(uniq))
            if codes is None:
                return kept
            coded = codes.covered(index.items, kept)
            found, uncoded = kept[coded], kept[~coded]
        assert approx is not None
        return np.sort(np.concatenate([self._code_cut(found, queries, approx), uncoded]))

    # -- the stages of the candidate cascade, in order ---------------------------------------------------
    def _recall(self, queries: np.ndarray, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The backend's recall: each query's k' nearest fragments (k' = 0: every fragment with a positive
        score) -> the distinct items they belong to (ascending), the sum of their positive backend
        scores, and which of them are live (and `allowed`)."""
        index = self.index
        backend, searching, shared = index.candidates, index.settings.search, index.shared
        only = None if shared is not None else allowed  # shared fragments: their representatives' items differ
        if searching.k_prime:
            search = backend.search if shared is not None else backend.search_items
            scores, found = search(queries, searching.k_prime, only)
            scores, found = scores[found >= 0], found[found >= 0]
        else:
            scores, found = backend.search_positive(queries, only)
        if shared is not None:
            items, weights = shared.expand(found, scores)
        else:
            items, weights = fid.decode(found)[0], scores
        items, weights = items[items >= 0], weights[items >= 0]
        bound = max(len(index.items.alive), int(items.max()) + 1 if len(items) else 0)
        uniq, summed = group_items(items, np.maximum(weights, 0), bound)
        live = index.items.live_among(uniq)
        if allowed is not None:
            live &= np.isin(uniq, allowed, assume_unique=True)
        return uniq, summed, live

    def _first_cut(self, uniq: np.ndarray, summed: np.ndarray, live: np.ndarray, first: int) -> np.ndarray:
        """The `first` live recalled items with the best partial score (`_prescore`), ties to the smaller
        id as in the final ranking; every live one when they are no more."""
        if live.sum() > first:
            partial = self._prescore(summed, np.where(live, uniq, 0))
            partial[~live] = -1.0
            return uniq[best_positions(partial, uniq, first)]
        return uniq[np.flatnonzero(live)]

    def _summary_cut(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first cut by the items' summaries instead of the backend's recall: the `SearchSettings.summaries`
        best of every live item with codes, and the live items without codes yet (added since the last
        save), all kept."""
        index = self.index
        codes = index.codes
        assert codes is not None
        ids, scores = codes.summary_scores(index.items, queries, SHORTLIST * index.settings.search.summaries)
        if len(ids) > index.settings.search.summaries:
            ids = ids[best_positions(scores, ids, index.settings.search.summaries)]
        live = index.items.live()
        return ids, live[~codes.covered(index.items, live)]

    def _code_cut(self, found: np.ndarray, queries: np.ndarray, approx: ApproxScore) -> np.ndarray:
        """The codes' step: the `rerank` best of the candidates `found` (with codes) by their first code's
        score; with refining codes and `refine` N > `rerank`, the N best of it go through `_refine` instead."""
        searching, codes = self.index.settings.search, self.index.codes
        assert codes is not None
        limit = searching.rerank
        if len(found) <= limit:
            return found
        refine = searching.refine if codes.refined is not None and searching.refine > limit else 0
        if len(found) > refine:  # the first code's score
            scores = codes.scores(self.index.items, found, queries, approx)
            if not refine:
                return found[best_positions(scores, found, limit)]
            found = found[best_positions(scores, found, refine)]
        return self._refine(found, queries, approx)

    def _refine(self, found: np.ndarray, queries: np.ndarray, approx: ApproxScore) -> np.ndarray:
        """The refining step: the `rerank` best of `found` scored on both codes (the first and the refining one)."""
        codes = self.index.codes
        assert codes is not None
        scores = codes.scores(self.index.items, found, queries, approx, refined=True)
        return found[best_positions(scores, found, self.index.settings.search.rerank)]

    def _prescore(self, partial: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Partial S_kl of candidates from their retrieved fragments: the sum over the item's fragment
        count plus the index's smoothing (images: 1/|g_k|; sentences: 1/(|g_l| + n))."""
        return partial / np.maximum(self.index.items.n[items] + self.index.PRESCORE_SMOOTHING, 1)

    def nearest_fragments(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Unique live (item, fragment) pairs among each query's k nearest fragments (caller holds `reading`)."""
        self._searched("candidates")
        backend = self.index.candidates
        if backend.ntotal == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        _, found = backend.search(queries, k)
        uniq = np.unique(found[found >= 0])
        items, frags = fid.decode(uniq)
        keep = self.index.items.live_among(items)
        return items[keep], frags[keep]

    # -- the exact score -----------------------------------------------------------------------------
    def _scan(self, chunk: int = SCAN_ITEMS, items: np.ndarray | None = None
              ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every live item (or the live `items` given) in chunks: (ids, vectors (C, F_max, dim), mask (C, F_max))."""
        self._searched("scan")
        table = self.index.items
        items = table.live() if items is None else items
        items = items[np.lexsort((table.off[items], table.seg[items]))]  # file order
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            yield (part, *self.index.stored.vectors(part))

    def _ranked(self, items: np.ndarray, score: Score, k: int) -> tuple[list[Ranked[P]], int, np.ndarray]:
        """The k best of candidate `items` by `score` (the exact re-rank), how many, and their best `CONTEXT`
        scores, as `rank` returns them."""
        considered = len(items)
        vecs, mask = self.index.stored.vectors(items)
        scores = score(vecs, mask)[:, 0]
        context = -np.sort(-np.asarray(scores, dtype=np.float64))[:CONTEXT]
        top = top_k(scores, items, k)
        keep = np.asarray([pos for pos, _, _ in top], dtype=np.int64)
        vecs, mask, items = vecs[keep], mask[keep], items[keep]
        payloads = self.index.payloads(items.tolist())
        return ([(i, s, payloads[i], vecs[row, : int(mask[row].sum())]) for row, (_, i, s) in enumerate(top)],
                considered, context)
