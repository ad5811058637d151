"""The image index: every image fragment in FAISS, sentences as queries, exact S_kl re-rank.

search: query sentence -> its fragments -> each fragment's k' nearest image fragments -> unique
images (candidates) -> the model's score (S_kl) over the candidates -> top k with alignments.
The image files behind the index (paths, the feature cache, EXIF date and place) are `fragsearch.index.photos`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fragsearch.index.base import FragmentIndex
from fragsearch.index.image_vectors import KeptVectors
from fragsearch.index.matches import aligned, aligned_all, label_at, read_sentence
from fragsearch.index.photos import Photos
from fragsearch.index.places import Place, PlaceFilter, read_place
from fragsearch.index.ranker import exact_score, rank_key
from fragsearch.index.types import (
    BackendOptions,
    Explanation,
    ImageHit,
    ImageRecord,
    IndexSettings,
    Page,
    PairShare,
    RegionHit,
)
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.embed import (
    EmbeddedImage,
    EmbeddedSentence,
    embed_extracted,
    embed_image,
    embed_phrase,
    embed_sentence,
    row_triplets,
)
from fragsearch.model.image import ImageFragments
from fragsearch.model.score import block_dots, pair_contributions, skl_of_items

logger = logging.getLogger(__name__)

NewImage = Image.Image | ImageFragments | EmbeddedImage  # an image to add: decoded, extracted or embedded


@dataclass
class StoredImage:
    """Metadata of an indexed image; boxes (F, 4) float32 in its own pixels."""

    name: str
    path: str
    width: int
    height: int
    boxes: np.ndarray
    place: Place | None = None  # from the file's EXIF; None: not read (an image indexed before it was)
    labels: tuple[str | None, ...] = ()  # each fragment's detector label (EmbeddedImage.labels); () none known


def embedded_images(vectors: np.ndarray, boxes: np.ndarray, sizes: np.ndarray,
                    labels: Sequence[tuple[str | None, ...]] | None = None) -> list[EmbeddedImage]:
    """Images embedded already, as `ImageIndex.add` takes them: vectors (K, F, h), boxes (K, F, 4),
    sizes (K, 2) width, height, and each image's fragment labels (`EmbeddedImage.labels`; none by default)."""
    named = labels if labels is not None else [()] * len(vectors)
    return [EmbeddedImage(v, np.asarray(b, dtype=np.float32), int(s[0]), int(s[1]), tuple(n))
            for v, b, s, n in zip(np.asarray(vectors, dtype=np.float32), boxes, sizes, named, strict=True)]


def exact_top_k(images: ImageIndex, sents: Sequence[np.ndarray], k: int = 10) -> list[list[tuple[int, float]]]:
    """Exact top k (image id, score) for many sentence queries (each (T_q, h)) in one pass over the store
    (the ground truth of benchmarks: `ImageIndex.search` ranks one query)."""
    return images.ranker.rank_many(exact_score(images.bundle, sents, "images"), len(sents), k)


class ImageIndex(FragmentIndex[StoredImage]):
    """Images of a collection as fragment vectors (see index.base for storage and concurrency)."""

    KIND = "image"
    # taken / lat / lon: when and where (EXIF), NULL when unknown; exif_read: 1 once the file's EXIF was
    # read (NULL in rows of a catalogue made before these columns: `photos.read_missing_places` fills them)
    # labels: a JSON list of each fragment's detector label (null where none), NULL when the model has none
    COLUMNS = (("name", "TEXT"), ("path", "TEXT"), ("width", "INTEGER"), ("height", "INTEGER"), ("boxes", "BLOB"),
               ("taken", "REAL"), ("lat", "REAL"), ("lon", "REAL"), ("exif_read", "INTEGER"), ("labels", "TEXT"))

    photos: Photos

    @classmethod
    def create(cls, root: Path, bundle: Bundle, settings: IndexSettings | None = None,
               cache: FeatureCache | None = None, collection_root: Path | None = None,
               backend: BackendOptions | None = None) -> ImageIndex:
        """A new, empty index folder (FileExistsError if one is there already); `backend` chooses where
        the candidate search runs (default: in-process FAISS).

        Images under `collection_root` are stored by their path relative to it, so that the index
        still finds them where the collection is mounted elsewhere (host / container); others by
        their absolute path (index.photos)."""
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
        self.photos = Photos(self, collection_root, cache)
        self.vectors = KeptVectors()  # one vector per live image, for more-like-this and near-duplicates
        return self

    # -- adding -----------------------------------------------------------------------------------
    def add(self, images: Sequence[NewImage], names: Sequence[str], paths: Sequence[Path | str],
            read_places: bool = True) -> list[int]:
        """Insert images, each decoded (extracted and embedded here), extracted (features (F, 1280),
        boxes (F, 4): embedded here, in one batch) or embedded (`embedded_images` makes them from
        arrays); returns their ids. The date and place are read from each file's EXIF unless
        `read_places` is off (the files may live on another machine: `photos.read_missing_places`
        reads them later). Image files are added by `photos.add`."""
        extracted = {i: im for i, im in enumerate(images) if isinstance(im, ImageFragments)}
        embedded: list[EmbeddedImage | None] = [
            im if isinstance(im, EmbeddedImage) else embed_image(self.bundle, im) if isinstance(im, Image.Image)
            else None for im in images]
        for i, e in zip(extracted, embed_extracted(self.bundle, list(extracted.values())), strict=True):
            embedded[i] = e
        ready = [e for e in embedded if e is not None]
        payloads = [StoredImage(str(name), self.photos.stored_path(path), e.width, e.height, e.boxes,
                                read_place(path) if read_places else None, e.labels)
                    for e, name, path in zip(ready, names, paths, strict=True)]
        return self.insert([e.vectors for e in ready], payloads)

    # -- reading ----------------------------------------------------------------------------------
    def get(self, image_id: int) -> ImageRecord | None:
        """The image's record, or None when it is unknown or removed."""
        with self.reading():
            if not self.contains(image_id):
                return None
            p = self.payloads([image_id])[image_id]
        return ImageRecord(image_id, p.name, self.photos.real_path(p.path), p.width, p.height, p.boxes.tolist(),
                           p.labels, p.path)

    def fragments(self, image_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """An indexed image's embedded fragments (F, h) and their boxes (F, 4), or None."""
        with self.reading():
            if not self.contains(image_id):
                return None
            vecs, mask = self.stored.vectors(np.asarray([image_id], dtype=np.int64))
            boxes = self.payloads([image_id])[image_id].boxes
        return vecs[0, : int(mask[0].sum())], boxes

    def search(self, query: str | EmbeddedSentence, k: int = 10, offset: int = 0, exhaustive: bool = False,
               where: PlaceFilter | None = None) -> Page[ImageHit]:
        """Images ranked offset + 1 .. offset + k for a sentence (its text, or its fragments (T, h) with
        the triplets that name the alignment): candidates, exact score, alignments. `exhaustive` ranks
        the whole collection by the exact score (no candidate stage); with `where`, only the images
        that pass the date and place filter are ranked (applied before the exact re-rank). A text
        raises ValueError when it is empty, model.fragments.NoFragmentsError when it has no usable
        fragment."""
        if isinstance(query, str):
            query = EmbeddedSentence(*embed_sentence(self.bundle, query))
        sent = np.asarray(query.vectors, dtype=np.float32)
        allowed = self.photos.allowed(where) if where else None
        ranked, considered, best, held = self.ranker.rank(sent, exact_score(self.bundle, [sent], "images"),
                                                          offset + k, exhaustive, allowed, skl_of_items)
        # (codes: one block; the projection mixes a merged model's member slices)
        reading = read_sentence(self.bundle, sent, query.triplets)
        shown = ranked[offset:]
        read = aligned_all([frags for _, _, _, frags in shown], sent, query.triplets, [p.boxes for _, _, p, _ in shown],
                           self.bundle.blocks, [p.labels for _, _, p, _ in shown], reading)
        hits = [ImageHit(item, p.name, self.photos.real_path(p.path), p.width, p.height, s, alignment, p.place, p.path,
                         found)
                for (item, s, p, _), (alignment, found) in zip(shown, read, strict=True)]
        return Page(hits, offset, considered, best, held)

    def explain(self, image_id: int, sentence: str) -> Explanation | None:
        """Why image `image_id` scores what it does for `sentence` (None when it is not indexed): its
        S_kl, its rank as a search ranks it, its alignment and every fragment pair's share of the score.

        A collection a search scans whole (`settings.search.exact_below`) is ranked whole; a larger one over
        the candidates the index recalls for the sentence plus this image, so the cost stays that of
        a search, and `recalled` tells whether a search could return the image at all."""
        sent, triplets = embed_sentence(self.bundle, sentence)
        with self.reading():
            if not self.contains(image_id):
                return None
            placed = self.ranker.place(image_id, sent, exact_score(self.bundle, [sent], "images"),
                                       skl_of_items)
            vecs, mask = self.stored.vectors(np.asarray([image_id], dtype=np.int64))
            payload = self.payloads([image_id])[image_id]
        frags = vecs[0, : int(mask[0].sum())]
        dots, shares = pair_contributions(frags, sent, blocks=self.bundle.blocks)
        names = row_triplets(triplets, len(sent))
        pairs = [PairShare(names[j].text(), names[j].rel, (names[j].w1, names[j].w2), i,
                           [float(v) for v in payload.boxes[i]], float(dots[i, j]), bool(shares[i, j] > 0),
                           float(shares[i, j]), label_at(payload.labels, i))
                 for j in range(len(sent)) for i in range(len(frags))]
        alignment, found = aligned(frags, sent, triplets, payload.boxes, self.bundle.blocks, payload.labels,
                                   read_sentence(self.bundle, sent, names))
        return Explanation(image_id, payload.name, payload.width, payload.height, placed.score, placed.rank,
                           placed.considered, len(frags), len(sent), alignment, pairs, placed.scope,
                           placed.recalled, placed.best, placed.collection, found)

    def search_fragments(self, phrase: str, k: int = 10, offset: int = 0) -> Page[RegionHit]:
        """Image regions ranked offset + 1 .. offset + k for a phrase or a triplet "rel(w1, w2)" (paper Fig. 5).

        A region's score is the sum over the phrase's fragments of max(0, v_i . s_j) (for a merged model
        the thresholded pair score, model/score.py's `block_dots`); FAISS proposes
        max(k', offset + k) regions per phrase fragment and those are scored exactly (regions
        scoring 0 are not matches and end the ranking).
        """
        sent, triplets = embed_phrase(self.bundle, phrase)
        evidence = read_sentence(self.bundle, sent, triplets).evidence
        with self.reading():
            items, frags = self.ranker.nearest_fragments(sent, max(self.settings.search.k_prime, offset + k))
            if len(items) == 0:
                return Page([], offset, 0)
            regions = self.stored.fragment_vectors(items, frags)
            scores = block_dots(regions, sent, self.bundle.blocks)[1].sum(-1)
            order = np.lexsort((frags, items, -rank_key(scores)))[offset : offset + k]
            order = order[scores[order] > 0]
            payloads = self.payloads(items[order].tolist())
            found: dict[int, float | None] = {}
            if evidence is not None and len(order):
                shown = np.unique(items[order])
                vecs, mask = self.stored.vectors(shown)
                found = {int(i): evidence.found(vecs[n, : int(mask[n].sum())]).weakest
                         for n, i in enumerate(shown.tolist())}
        hits = []
        for o in order:
            p = payloads[int(items[o])]
            hits.append(RegionHit(int(items[o]), p.name, [float(v) for v in p.boxes[frags[o]]], int(frags[o]),
                                  float(scores[o]), label_at(p.labels, int(frags[o])), p.width, p.height, p.path,
                                  found.get(int(items[o]))))
        return Page(hits, offset, int(np.count_nonzero(scores > 0)))

    # -- SQLite rows ------------------------------------------------------------------------------
    def row(self, payload: StoredImage) -> tuple[Any, ...]:
        boxes = np.ascontiguousarray(payload.boxes, dtype="<f4")
        pl = payload.place
        return (payload.name, payload.path, payload.width, payload.height, boxes.tobytes(),
                None if pl is None else pl.taken, None if pl is None else pl.lat, None if pl is None else pl.lon,
                None if pl is None else 1, json.dumps(list(payload.labels)) if payload.labels else None)

    def from_row(self, row: Sequence[Any]) -> StoredImage:
        name, path, width, height, blob, taken, lat, lon, exif_read, labels = row
        boxes = np.frombuffer(blob, dtype="<f4").reshape(-1, 4).astype(np.float32)
        place = Place(taken, lat, lon) if exif_read else None
        return StoredImage(str(name), str(path), int(width), int(height), boxes, place,
                           tuple(json.loads(labels)) if labels else ())
