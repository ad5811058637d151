"""Prescore codes: a compact code of every stored fragment, to score many candidates approximately
before the exact re-rank reads the full vectors of the few best (PLAID's idea, ColBERT's engine).

A fragment's code is its projection on the `IndexShape.codes` leading directions of the uncentred
second moment of the stored fragments (`fragsearch.index.ann.uncentred_pca`, fitted once on a sample), stored
in int8 with one scale per fragment (`fragsearch.index.store`'s int8 rows: d + 4 bytes a fragment). The codes
are a `VectorStore` whose saved segments mirror the re-rank store's row for row, so an item's
(segment, offset, n) addresses both; they are `codes-*.npy` files beside the store, read into memory
when the index is opened (a search gathers thousands of candidates' codes at random: no page faults,
no cold reads; 64 dimensions: 68 bytes a fragment, 1.4 GB for a million images of 20 fragments,
against 20 GB of float16 vectors, which stay memory-mapped).

The approximate score of a candidate is THE score (model.score's S_kl, through the caller's
`ApproxScore`) of its decoded codes against the queries projected on the same directions: v . s is
replaced by (P v) . (P s), the thresholds and normalisation are the exact score's.

Codes are derived at every save (`derive`, inside the commit protocol of index.saving): each store
segment the committed codes do not cover yet (the segment written from the live rows, a segment a
compaction merged, or every segment of an index that had no codes) is read back and encoded into a
new file under a fresh name; the commit names them, so a crash keeps the last committed state. Rows
added since the last save have no codes yet: a search scores those candidates exactly.

Refining codes (`IndexShape.refine_codes`): a second code of every fragment, its projection on the
leading directions of what the first code's projection leaves out (the residual's uncentred second
moment, orthogonal to the first directions), read into memory as the first code is. A search
scores its many candidates on the first code, keeps the `SearchSettings.refine` best, and scores those
on both codes (v . s replaced by the products on all the first and second directions): a closer
score, so the exact re-rank can read the full vectors of fewer items.

Summaries (`SearchSettings.summaries`): each item's mean first code (the mean of its fragments'
projections), computed from the codes in memory when first needed and kept per code file. A scan of
every live item's summary against the projected queries is a first cut that needs no candidate
backend: the mean's product with the sum of the query fragments (every pair counted: breadth) for
every item, and for the best of those by it the products with each query fragment summed thresholded
at 0 (the pairs S_kl keeps); each sum standardised over the items it covers, the two added. On a
million images it keeps far more of the exact top 10 among its best few thousand than the partial
score of the FAISS candidates does (docs/results/index-bench.md), for one matrix-vector product over
every item's mean.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.index.ann import uncentred_pca
from fragsearch.index.files import unique_name
from fragsearch.index.items import ItemTable
from fragsearch.index.selection import best_positions
from fragsearch.index.store import VectorStore, release_rows
from fragsearch.model.arrays import segment_sum
from fragsearch.model.atomic import atomic_path

logger = logging.getLogger(__name__)

CODES_PREFIX, CODES_SUFFIX = "codes", ".npy"
REFINE_PREFIX = "codes-refine"
PROJECTION_SAMPLE = 65_536  # stored fragments the projection is fitted on
ENCODE_ROWS = 1 << 16  # store rows encoded at a time
SCORE_ITEMS = 4096  # candidates whose codes are decoded and scored at a time

# the exact score (model.score.skl_of_items) of C candidates from the inner products (N, t) of their
# fragments' codes with the projected queries and the candidate of each row (N,): (dots, owner, C) -> (C,)
ApproxScore = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class CodesInfo:
    """What a commit names of the codes: their dimension, the projection file, one code file per
    store segment (in the store's order), and the refining codes' own (None: no refining codes)."""

    dim: int
    projection: str
    files: list[str]
    refine: CodesInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "projection": self.projection, "files": list(self.files)}
        if self.refine is not None:
            out["refine"] = self.refine.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodesInfo:
        refine = cls.from_dict(data["refine"]) if data.get("refine") else None
        return cls(int(data["dim"]), str(data["projection"]), [str(f) for f in data["files"]], refine)

    def names(self) -> set[str]:
        """Every file the codes consist of."""
        return {self.projection, *self.files} | (self.refine.names() if self.refine is not None else set())


class PrescoreCodes:
    """The committed codes of an index: the projection (d, dim) and the code segments, parallel to
    the re-rank store's saved segments; `refined`: the refining codes (the same, of the residual)."""

    def __init__(self, info: CodesInfo, projection: np.ndarray, arrays: list[np.ndarray],
                 refined: PrescoreCodes | None = None) -> None:
        self.info = info
        self.projection = projection
        self.dim = info.dim
        self.store = VectorStore(info.dim, "int8")
        self.store.commit(info.files, arrays)
        self.refined = refined
        self._summaries: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # code file -> its items, their means
        self._summaries_lock = threading.Lock()

    @property
    def segments(self) -> int:
        """Store segments covered (0 .. segments - 1)."""
        return len(self.store.segments)

    @classmethod
    def open(cls, root: Path, info: CodesInfo, store_dim: int, rows: list[int],
             opened: PrescoreCodes | None = None) -> PrescoreCodes:
        """The codes a commit names, read into memory, those `opened` (the codes before the commit)
        already holds kept; ValueError / OSError when a file is missing or of another shape."""
        if opened is not None and opened.info.projection == info.projection:
            projection = opened.projection
            have = dict(zip(opened.info.files, opened.store.segments, strict=True))
        else:
            projection, have = np.load(Path(root) / info.projection, allow_pickle=False), {}
            if projection.shape != (info.dim, store_dim) or projection.dtype != np.float32:
                raise ValueError(f"{info.projection}: {projection.dtype} {projection.shape}, expected float32 "
                                 f"({info.dim}, {store_dim})")
        if len(info.files) != len(rows):
            raise ValueError(f"{len(info.files)} code files for {len(rows)} store segments")
        arrays = [have[f] if f in have
                  else VectorStore.open_segment(Path(root) / f, info.dim, np.dtype(np.int8), r, in_memory=True)
                  for f, r in zip(info.files, rows, strict=True)]
        refined = None if info.refine is None else cls.open(
            root, info.refine, store_dim, rows, opened=opened.refined if opened else None)
        codes = cls(info, projection, arrays, refined)
        if opened is not None and opened.info.projection == info.projection:
            codes._summaries = {f: v for f, v in opened._summaries.items() if f in set(info.files)}
        return codes

    def project(self, vecs: np.ndarray) -> np.ndarray:
        """(n, dim) -> (n, d) float32 on the codes' directions."""
        return np.asarray(vecs, dtype=np.float32) @ self.projection.T

    def covered(self, items: ItemTable[Any], cand: np.ndarray) -> np.ndarray:
        """Mask of candidate items whose rows have codes (saved segments)."""
        seg = items.seg[cand]
        return (seg >= 0) & (seg < self.segments)

    def scores(self, items: ItemTable[Any], cand: np.ndarray, queries: np.ndarray, approx: ApproxScore,
               refined: bool = False) -> np.ndarray:
        """The approximate score (C,) of covered candidate items for queries (t, dim): their codes'
        rows gathered without padding, their products with the projected queries, S_kl of those;
        `refined` (with refining codes): the products on both codes' directions."""
        levels = [self] + ([self.refined] if refined and self.refined is not None else [])
        qs = [level.project(queries) for level in levels]
        out = np.empty(len(cand), np.float32)
        order = np.lexsort((items.off[cand], items.seg[cand]))  # file order: each segment's rows read in one pass
        for start in range(0, len(cand), SCORE_ITEMS):
            at = order[start : start + SCORE_ITEMS]
            part = cand[at]
            seg, off, n = items.seg[part], items.off[part], items.n[part]
            dots = levels[0].store.dots(levels[0].store.gather_rows(seg, off, n), qs[0])
            for level, q in zip(levels[1:], qs[1:], strict=True):
                dots += level.store.dots(level.store.gather_rows(seg, off, n), q)
            owner = np.repeat(np.arange(len(part)), n)
            out[at] = approx(dots, owner, len(part))
        return out

    def summaries(self, items: ItemTable[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per code segment, its live items (ids ascending) and their summaries (n, d): the mean of each
        item's decoded first codes. Computed on first use and kept per code file: a committed file's
        rows and items never change (a compaction writes the items it moves into a new file and drops
        the files it merged; the segments it keeps only change their number), and an item that dies
        later is dropped by the caller."""
        with self._summaries_lock:
            out = []
            for s, name in enumerate(self.info.files):
                kept = self._summaries.get(name)
                if kept is None:
                    kept = self._summaries[name] = self._summarise(items, s)
                out.append(kept)
            return out

    def _summarise(self, items: ItemTable[Any], s: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(items.alive & (items.seg == s) & (items.n > 0))
        ids = ids[np.argsort(items.off[ids], kind="stable")]  # the segment's rows in file order
        means = np.empty((len(ids), self.dim), np.float32)
        for start in range(0, len(ids), ENCODE_ROWS // 16):
            part = ids[start : start + ENCODE_ROWS // 16]
            n = items.n[part]
            rows = self.store.decode(self.store.gather_rows(items.seg[part], items.off[part], n))
            sums = segment_sum(rows, np.repeat(np.arange(len(part)), n), len(part))
            means[start : start + len(part)] = sums / n.astype(np.float32)[:, None]
        return ids, means

    def summary_scores(self, items: ItemTable[Any], queries: np.ndarray, shortlist: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Live items with codes and their summary score against queries (t, dim): z(sum of m . s) +
        z(sum of max(0, m . s)) over the sentence's projected fragments s, m the item's mean code, z
        standardising over the items scored. `shortlist` L > 0: the thresholded sum (t products an
        item) only for the L best by the linear one (one product an item), the others left out."""
        q = self.project(queries).T  # (d, t)
        total = np.ascontiguousarray(q.sum(1))
        per_segment = self.summaries(items)
        ids = np.concatenate([seg_ids for seg_ids, _ in per_segment]) if per_segment else np.zeros(0, np.int64)
        linear = np.concatenate([means @ total for _, means in per_segment]) \
            if per_segment else np.zeros(0, np.float32)  # numpy's matrix-vector product reads these 2x faster
        live = np.flatnonzero(items.alive[ids])
        if shortlist and len(live) > shortlist:
            live = live[best_positions(linear[live], ids[live], shortlist)]
        bounds = np.cumsum([0] + [len(seg_ids) for seg_ids, _ in per_segment])
        means = np.empty((len(live), self.dim), np.float32)
        for k, (_, seg_means) in enumerate(per_segment):  # the kept items' means, segment by segment
            lo, hi = np.searchsorted(live, bounds[k : k + 2])
            np.take(seg_means, live[lo:hi] - bounds[k], axis=0, out=means[lo:hi])
        dots = means @ q  # (n, t)
        positive = np.maximum(dots, 0, out=dots).sum(1)
        return ids[live], standardised(linear[live]) + standardised(positive)


def standardised(x: np.ndarray) -> np.ndarray:
    """(x - mean) / std (float32; all zeros when x does not vary)."""
    if not len(x):
        return x.astype(np.float32)
    spread = float(x.std())
    return ((x - float(x.mean())) / (spread if spread > 0 else 1.0)).astype(np.float32)


def derive(root: Path, store: VectorStore, files: list[str], rows: list[int], dim: int,
           current: PrescoreCodes | None, sample: Callable[[int], np.ndarray], gen: int,
           created: list[Path], refine: int = 0, prefix: str = CODES_PREFIX) -> CodesInfo | None:
    """The codes of the store segments `files` (rows each) a save is about to commit: those `current`
    covers are kept, the others encoded into new files (added to `created`). A new projection is
    fitted on a sample when there is none of dimension `dim` (then every segment is encoded anew).
    `refine` > 0: the refining codes too, of that dimension, derived the same way on the directions
    the first projection leaves out (fitted anew with it). None when `dim` is 0 or nothing is stored."""
    if not dim or not sum(rows):
        return None
    root = Path(root)
    if current is not None and current.dim == dim:
        projection, projection_file = current.projection, current.info.projection
        have = dict(zip(store.files[: current.segments], current.info.files, strict=True))
    else:
        projection = uncentred_pca(sample(PROJECTION_SAMPLE), dim)
        store.release_all()  # the sample's reads touched pages all over the store
        current = None  # refining codes of another first projection are fitted anew
        projection_file = unique_name(f"{prefix}-projection", gen, CODES_SUFFIX)
        with atomic_path(root / projection_file) as tmp, open(tmp, "wb") as fh:
            np.save(fh, projection)
        created.append(root / projection_file)
        have = {}
    encoder = VectorStore(dim, "int8")
    todo = [(f, r) for f, r in zip(files, rows, strict=True) if f not in have]
    total = sum(r for _, r in todo)
    with tqdm(total=total, desc=f"{prefix} ({dim}-d)", unit="frag", disable=total < 4 * ENCODE_ROWS) as bar:
        for file, n_rows in todo:
            name = unique_name(prefix, gen, CODES_SUFFIX)
            created.append(root / name)
            source = VectorStore.open_segment(root / file, store.dim, store.dtype, n_rows)
            with atomic_path(root / name) as tmp:
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int8, shape=(n_rows, encoder.cols))
                for start in range(0, n_rows, ENCODE_ROWS):
                    vecs = store.decode(np.asarray(source[start : start + ENCODE_ROWS]))
                    out[start : start + len(vecs)] = encoder.encode(vecs @ projection.T)
                    release_rows(source, start, start + len(vecs))  # resident memory stays one block's
                    bar.update(len(vecs))
                out.flush()
                del out
            del source
            have[file] = name
    if todo:
        logger.info("prescore codes (%d-d) of %d store segment(s), %d fragments, in %s", dim, len(todo), total, root)
    refined = None
    if refine:
        def residual(size: int) -> np.ndarray:  # what the first projection leaves out of a sample
            x = np.asarray(sample(size), dtype=np.float32)
            return x - (x @ projection.T) @ projection

        refined = derive(root, store, files, rows, refine, current.refined if current else None, residual, gen,
                         created, prefix=REFINE_PREFIX)
    return CodesInfo(dim, projection_file, [have[f] for f in files], refined)
