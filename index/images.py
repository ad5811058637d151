"""The image index: every image fragment in FAISS, sentences as queries, exact S_kl re-rank.

search: query sentence -> its fragments -> each fragment's k' nearest image fragments -> unique
images (candidates) -> the model's score (S_kl) over the candidates -> top k with alignments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from index.base import FragmentIndex
from index.candidates import BackendOptions
from index.image_vectors import KeptVectors
from index.matches import matches
from index.places import Place, PlaceFilter, read_place
from index.ranker import rank_key
from index.types import (
    AddReport,
    Explanation,
    ImageHit,
    ImageRecord,
    IndexSettings,
    Page,
    PairShare,
    RegionHit,
)
from model.bundle import Bundle
from model.cache import FeatureCache
from model.embed import EmbeddedImage, embed_extracted, embed_image, embed_phrase, embed_sentence, row_triplets
from model.image import ImageFragments
from model.score import block_dots, pair_contributions, skl_of_items
from model.text import Triplet

logger = logging.getLogger(__name__)

ADD_CHUNK = 64  # images embedded and inserted at a time by add_paths


@dataclass
class StoredImage:
    """Metadata of an indexed image; boxes (F, 4) float32 in its own pixels."""

    name: str
    path: str
    width: int
    height: int
    boxes: np.ndarray
    place: Place | None = None  # from the file's EXIF; None: not read (an image indexed before it was)


PLACE_COLUMNS = ("taken", "lat", "lon", "exif_read")


class ImageIndex(FragmentIndex[StoredImage]):
    """Images of a collection as fragment vectors (see index.base for storage and concurrency)."""

    KIND = "image"
    # taken / lat / lon: when and where (EXIF), NULL when unknown; exif_read: 1 once the file's EXIF was
    # read (NULL in rows of a catalogue made before these columns: `read_missing_places` fills them)
    COLUMNS = (("name", "TEXT"), ("path", "TEXT"), ("width", "INTEGER"), ("height", "INTEGER"), ("boxes", "BLOB"),
               ("taken", "REAL"), ("lat", "REAL"), ("lon", "REAL"), ("exif_read", "INTEGER"))

    cache: FeatureCache | None

    collection_root: Path | None

    @classmethod
    def create(cls, root: Path, bundle: Bundle, settings: IndexSettings | None = None,
               cache: FeatureCache | None = None, collection_root: Path | None = None,
               backend: BackendOptions | None = None) -> ImageIndex:
        """A new, empty index folder (FileExistsError if one is there already); `backend` chooses where
        the candidate search runs (default: in-process FAISS).

        Images under `collection_root` are stored by their path relative to it, so that the index
        still finds them where the collection is mounted elsewhere (host / container); others by
        their absolute path."""
        index: ImageIndex = cls._create(root, bundle, settings or IndexSettings(), backend)
        return index._attach(cache, collection_root)

    @classmethod
    def load(cls, root: Path, bundle: Bundle, cache: FeatureCache | None = None,
             collection_root: Path | None = None, backend: BackendOptions | None = None,
             **search: Any) -> ImageIndex:
        """Open an index folder built for `bundle`; IndexLoadError when it is missing, corrupt, or was
        built for another model or dimension. Relative image paths are read against `collection_root`.
        `search` overrides search-time settings (nprobe, k_prime, use_gpu...); `backend` the Milvus URI
        (it must name the backend the index was built with)."""
        index: ImageIndex = cls._load(root, bundle, search, backend)
        return index._attach(cache, collection_root)

    def _attach(self, cache: FeatureCache | None, collection_root: Path | None) -> ImageIndex:
        if cache is not None:
            want = dataclasses.replace(self.bundle.image_cfg, full_frame_only=False)
            if dataclasses.replace(cache.cfg, full_frame_only=False) != want:
                raise ValueError("the feature cache was made with other image settings than the model's")
        self.cache = cache
        self.collection_root = None if collection_root is None else Path(collection_root).resolve()
        self.vectors = KeptVectors()  # one vector per live image, for more-like-this and near-duplicates
        return self

    def stored_path(self, path: Path | str) -> str:
        """How `path` is stored: relative to the collection root (POSIX form) when under it, else as given."""
        root = self.collection_root
        if root is not None:
            p = Path(path)
            full = p if p.is_absolute() else p.resolve()
            if full.is_relative_to(root):
                return full.relative_to(root).as_posix()
        return str(path)

    def real_path(self, stored: str) -> str:
        """The file of a stored path: relative ones are read against the collection root."""
        if self.collection_root is None or Path(stored).is_absolute():
            return stored
        return str(self.collection_root / stored)

    # -- adding -----------------------------------------------------------------------------------
    def add_image(self, image: Image.Image, name: str, path: Path | str) -> int:
        """Extract, embed and insert one image; returns its id."""
        return self.add_embedded([embed_image(self.bundle, image)], [name], [path])[0]

    def add_extracted(self, frags: Sequence[ImageFragments], names: Sequence[str],
                      paths: Sequence[Path | str]) -> list[int]:
        """Embed and insert extracted images (features (F, 1280), boxes (F, 4)); returns their ids."""
        return self.add_embedded(embed_extracted(self.bundle, frags), names, paths)

    def add_embedded(self, images: Sequence[EmbeddedImage], names: Sequence[str],
                     paths: Sequence[Path | str]) -> list[int]:
        """Insert embedded images; returns their ids. The date and place are read from each file's EXIF."""
        payloads = [StoredImage(str(name), self.stored_path(path), e.width, e.height, e.boxes, read_place(path))
                    for e, name, path in zip(images, names, paths, strict=True)]
        return self.insert([e.vectors.numpy() for e in images], payloads)

    def add_vectors(self, vectors: np.ndarray, boxes: np.ndarray, sizes: np.ndarray, names: Sequence[str],
                    paths: Sequence[str]) -> list[int]:
        """Insert already embedded images: vectors (K, F, h), boxes (K, F, 4), sizes (K, 2) width, height.
        Their EXIF is not read here (the files may live on another machine): `read_missing_places` does."""
        payloads = [StoredImage(str(n), self.stored_path(p), int(s[0]), int(s[1]), np.asarray(b, dtype=np.float32))
                    for n, p, s, b in zip(names, paths, sizes, boxes, strict=True)]
        return self.insert(list(np.asarray(vectors, dtype=np.float32)), payloads)

    def add_paths(self, paths: Sequence[Path | str], workers: int = 1, skip_present: bool = True) -> AddReport:
        """Index image files. Unreadable files are skipped and listed; with `skip_present`, files whose
        path is indexed already are not added again. Features go through the feature cache (a
        temporary one when the index has none), extracted by `workers` processes."""
        report = AddReport()
        todo: list[Path] = []
        seen: set[Path] = set()
        for p in paths:
            path = Path(p).resolve()
            if path.name.startswith("."):
                report.skipped.append((str(path), "hidden file name"))
            elif path not in seen:
                seen.add(path)
                todo.append(path)
        if skip_present:
            present = self.find_paths(todo)
            report.present = len(present)
            todo = [p for p in todo if str(p) not in present]
        # a cache entry is keyed by file name: images sharing a name go in separate rounds
        rounds: list[list[Path]] = []
        seen_names: dict[str, int] = {}
        for path in todo:
            n = seen_names[path.name] = seen_names.get(path.name, -1) + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(path)
        for batch in rounds:
            with self._feature_cache() as cache:
                ensured = cache.ensure(batch, workers=workers)
                failed = dict(ensured.failed)
                report.skipped += [(str(p), failed[p.name]) for p in batch if p.name in failed]
                good = [p for p in batch if p.name not in failed]
                bar = tqdm(total=len(good), desc=f"indexing {self.root.name}", unit="img", disable=len(good) < 50)
                for start in range(0, len(good), ADD_CHUNK):
                    chunk = good[start : start + ADD_CHUNK]
                    frags = [cache.load_or_reason(p) for p in chunk]
                    ok = [(p, f) for p, f in zip(chunk, frags, strict=True) if isinstance(f, ImageFragments)]
                    report.skipped += [(str(p), f) for p, f in zip(chunk, frags, strict=True) if isinstance(f, str)]
                    report.added += self.add_extracted([f for _, f in ok], [p.name for p, _ in ok],
                                                       [p for p, _ in ok])
                    bar.update(len(chunk))
                bar.close()
        if report.skipped:
            logger.warning("%d unreadable images skipped (first: %s)", len(report.skipped), report.skipped[0])
        logger.info("added %d images to %s (%d skipped, %d already indexed)", len(report.added), self.root,
                    len(report.skipped), report.present)
        return report

    @contextlib.contextmanager
    def _feature_cache(self) -> Iterator[FeatureCache]:
        if self.cache is not None:
            yield self.cache
            return
        with tempfile.TemporaryDirectory(prefix="fragsearch-features-") as tmp:
            yield FeatureCache(Path(tmp), self.bundle.image_cfg, str(self.bundle.device))

    def find_paths(self, paths: Sequence[Path | str]) -> dict[str, int]:
        """Live images among `paths` (compared as given, resolve them first) -> their ids."""
        given = {self.stored_path(p): str(p) for p in paths}
        wanted = set(given)
        with self.reading():
            found = {p.path: i for i, p in self.items.pending.items() if p.path in wanted and self.contains(i)}
            found.update({str(path): i for i, path in self.catalogue.lookup("path", sorted(wanted))
                          if self.contains(i)})
        return {given[stored]: i for stored, i in found.items()}

    # -- reading ----------------------------------------------------------------------------------
    def get(self, image_id: int) -> ImageRecord | None:
        """The image's record, or None when it is unknown or removed."""
        with self.reading():
            if not self.contains(image_id):
                return None
            p = self.payloads([image_id])[image_id]
        return ImageRecord(image_id, p.name, self.real_path(p.path), p.width, p.height, p.boxes.tolist())

    def fragments(self, image_id: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """An indexed image's embedded fragments (F, h) and their boxes (F, 4), or None."""
        with self.reading():
            if not self.contains(image_id):
                return None
            vecs, mask = self.stored.vectors(np.asarray([image_id], dtype=np.int64))
            boxes = self.payloads([image_id])[image_id].boxes
        return vecs[0, : int(mask[0].sum())], boxes

    def search(self, sentence: str, k: int = 10) -> list[ImageHit]:
        """Top k images for a sentence: FAISS candidates, exact score, alignments."""
        return self.search_page(sentence, 0, k).hits

    def search_exhaustive(self, sentence: str, k: int = 10) -> list[ImageHit]:
        """Top k images by the exact score over the whole collection (no candidate stage)."""
        return self.search_page(sentence, 0, k, exhaustive=True).hits

    def search_page(self, sentence: str, offset: int, limit: int, exhaustive: bool = False,
                    where: PlaceFilter | None = None) -> Page[ImageHit]:
        """Images ranked offset + 1 .. offset + limit for a sentence (ValueError when it is empty,
        model.fragments.NoFragmentsError when it has no usable fragment); with `where`, among the
        images that pass the date and place filter only."""
        sent, triplets = embed_sentence(self.bundle, sentence)
        return self.search_vectors_page(sent, triplets, offset, limit, exhaustive, where)

    @torch.inference_mode()
    def search_vectors(self, sent: torch.Tensor, k: int = 10, triplets: Sequence[Triplet] | None = None,
                       exhaustive: bool = False) -> list[ImageHit]:
        """Top k images for sentence fragments sent (T, h) (their triplets name the alignment)."""
        return self.search_vectors_page(sent, triplets, 0, k, exhaustive).hits

    @torch.inference_mode()
    def search_vectors_page(self, sent: torch.Tensor, triplets: Sequence[Triplet] | None, offset: int, limit: int,
                            exhaustive: bool = False, where: PlaceFilter | None = None) -> Page[ImageHit]:
        """Images ranked offset .. offset + limit - 1 for sentence fragments sent (T, h); with `where`,
        among the images that pass the date and place filter only (applied before the exact re-rank)."""
        sent = torch.as_tensor(sent, dtype=torch.float32)
        sent_mask = torch.ones(1, len(sent))

        def score(img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bundle.scores(img, mask, sent[None], sent_mask)[:, 0]

        allowed = self.allowed(where) if where else None
        ranked, considered = self.ranker.rank(sent.numpy(), score, offset + limit, exhaustive, allowed,
                                              self._code_score)
        return Page([ImageHit(item, p.name, self.real_path(p.path), p.width, p.height, s,
                              matches(frags, sent, triplets, p.boxes, self.bundle.blocks), p.place)
                     for item, s, p, frags in ranked[offset:]], offset, considered)

    def _code_score(self, dots: torch.Tensor, owner: torch.Tensor, count: int) -> torch.Tensor:
        """S_kl of `count` candidates from the products (N, t) of their prescore codes with the projected
        query and each row's candidate (index.codes): one block, as the projection mixes a merged
        model's member slices."""
        return skl_of_items(dots, owner, count)

    @torch.inference_mode()
    def explain(self, image_id: int, sentence: str) -> Explanation | None:
        """Why image `image_id` scores what it does for `sentence` (None when it is not indexed): its
        S_kl, its rank as a search ranks it, its alignment and every fragment pair's share of the score.

        A collection a search scans whole (`settings.exact_below`) is ranked whole; a larger one over
        the candidates the index recalls for the sentence plus this image, so the cost stays that of
        a search, and `recalled` tells whether a search could return the image at all."""
        sent, triplets = embed_sentence(self.bundle, sentence)
        sent_mask = torch.ones(1, len(sent))

        def score(img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # as a search scores
            return self.bundle.scores(img, mask, sent[None], sent_mask)[:, 0]

        with self.reading():
            if not self.contains(image_id):
                return None
            placed = self.ranker.place(image_id, sent.numpy(), score, self._code_score)
            vecs, mask = self.stored.vectors(np.asarray([image_id], dtype=np.int64))
            payload = self.payloads([image_id])[image_id]
        frags = vecs[0, : int(mask[0].sum())]
        dots, shares = pair_contributions(frags, sent, blocks=self.bundle.blocks)
        names = row_triplets(triplets, len(sent))
        pairs = [PairShare(names[j].text(), names[j].rel, (names[j].w1, names[j].w2), i,
                           [float(v) for v in payload.boxes[i]], float(dots[i, j]), bool(shares[i, j] > 0),
                           float(shares[i, j]))
                 for j in range(len(sent)) for i in range(len(frags))]
        return Explanation(image_id, payload.name, payload.width, payload.height, placed.score, placed.rank,
                           placed.considered, len(frags), len(sent),
                           matches(frags, sent, triplets, payload.boxes, self.bundle.blocks),
                           pairs, placed.scope, placed.recalled)

    @torch.inference_mode()
    def rank_exhaustive(self, sents: Sequence[torch.Tensor], k: int = 10) -> list[list[tuple[int, float]]]:
        """Exact top k (image id, score) for many queries (each (T_q, h)) in one pass over the store."""
        t_max = max((len(s) for s in sents), default=1)
        queries = torch.zeros(len(sents), t_max, self.dim)
        q_mask = torch.zeros(len(sents), t_max)
        for q, s in enumerate(sents):
            queries[q, : len(s)] = torch.as_tensor(s, dtype=torch.float32)
            q_mask[q, : len(s)] = 1

        def score(img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bundle.scores(img, mask, queries, q_mask)

        return self.ranker.rank_many(score, len(sents), k)

    def search_fragments(self, phrase: str, k: int = 10) -> list[RegionHit]:
        """The k image regions that best match a phrase or a triplet "rel(w1, w2)" (paper Fig. 5)."""
        return self.search_fragments_page(phrase, 0, k).hits

    @torch.inference_mode()
    def search_fragments_page(self, phrase: str, offset: int, limit: int) -> Page[RegionHit]:
        """Regions ranked offset + 1 .. offset + limit for a phrase or a triplet "rel(w1, w2)".

        A region's score is the sum over the phrase's fragments of max(0, v_i . s_j) (for a merged model
        the thresholded pair score, model/score.py's `block_dots`); FAISS proposes
        max(k', offset + limit) regions per phrase fragment and those are scored exactly (regions
        scoring 0 are not matches and end the ranking).
        """
        sent, _ = embed_phrase(self.bundle, phrase)
        with self.reading():
            items, frags = self.ranker.nearest_fragments(sent.numpy(), max(self.settings.k_prime, offset + limit))
            if len(items) == 0:
                return Page([], offset, 0)
            regions = torch.from_numpy(self.stored.fragment_vectors(items, frags))
            scores = block_dots(regions, sent, self.bundle.blocks)[1].sum(-1).numpy()
            order = np.lexsort((frags, items, -rank_key(scores)))[offset : offset + limit]
            order = order[scores[order] > 0]
            payloads = self.payloads(items[order].tolist())
        hits = [RegionHit(int(items[o]), payloads[int(items[o])].name,
                          [float(v) for v in payloads[int(items[o])].boxes[frags[o]]], int(frags[o]), float(scores[o]))
                for o in order]
        return Page(hits, offset, int(np.count_nonzero(scores > 0)))

    # -- date and place -------------------------------------------------------------------------
    def allowed(self, where: PlaceFilter) -> np.ndarray:
        """Ids of the live images that pass the date and place filter, sorted (caller may hold `reading`)."""
        cond, params = where.sql()
        with self.reading():
            rows = self.catalogue.select(["taken", "lat", "lon"], cond, params)
            pending = [(i, p.place or Place()) for i, p in self.items.pending.items() if self.contains(i)]
            rows += [(i, pl.taken, pl.lat, pl.lon) for i, pl in pending]
            if not rows:
                return np.zeros(0, np.int64)
            table = np.asarray([[np.nan if v is None else float(v) for v in r[1:]] for r in rows], dtype=np.float64)
            ids = np.asarray([int(r[0]) for r in rows], dtype=np.int64)
            keep = where.keeps(table[:, 0], table[:, 1], table[:, 2])
            ids = ids[keep]
            ids = ids[self.items.live_among(ids)] if len(ids) else ids
        return np.unique(ids)

    def read_missing_places(self) -> int:
        """Read the EXIF date and place of saved images indexed before they were kept (their
        `exif_read` is NULL) and store them; how many were read."""
        rows = self.catalogue.select(["path"], "exif_read IS NULL", [])
        if not rows:
            return 0
        updates = []
        for image_id, path in tqdm(rows, desc="reading EXIF", unit="img", disable=len(rows) < 200):
            pl = read_place(self.real_path(str(path)))
            updates.append((pl.taken, pl.lat, pl.lon, 1, int(image_id)))
        self.catalogue.update_columns(PLACE_COLUMNS, updates)
        logger.info("read the EXIF date and place of %d images indexed before they were kept", len(updates))
        return len(updates)

    # -- SQLite rows ------------------------------------------------------------------------------
    def row(self, payload: StoredImage) -> tuple[Any, ...]:
        boxes = np.ascontiguousarray(payload.boxes, dtype="<f4")
        pl = payload.place
        return (payload.name, payload.path, payload.width, payload.height, boxes.tobytes(),
                None if pl is None else pl.taken, None if pl is None else pl.lat, None if pl is None else pl.lon,
                None if pl is None else 1)

    def from_row(self, row: Sequence[Any]) -> StoredImage:
        name, path, width, height, blob, taken, lat, lon, exif_read = row
        boxes = np.frombuffer(blob, dtype="<f4").reshape(-1, 4).astype(np.float32)
        place = Place(taken, lat, lon) if exif_read else None
        return StoredImage(str(name), str(path), int(width), int(height), boxes, place)
