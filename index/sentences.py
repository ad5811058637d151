"""The sentence index: every sentence fragment in FAISS, images as queries (/annotate).

annotate: image -> its fragments -> each fragment's k' nearest sentence fragments -> unique
sentences (candidates) -> the model's score (S_kl) over the candidates -> top k with alignments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from fragsearch.index.base import FragmentIndex
from fragsearch.index.matches import aligned, read_sentence
from fragsearch.index.ranker import exact_score
from fragsearch.index.types import BackendOptions, IndexSettings, Page, SentenceHit, SentenceRecord
from fragsearch.model.bundle import Bundle
from fragsearch.model.embed import EmbeddedImage, embed_encoded, embed_extracted, embed_image
from fragsearch.model.fragments import EncodedSentences
from fragsearch.model.image import ImageFragments
from fragsearch.model.imageio import Photo
from fragsearch.model.score import SMOOTHING
from fragsearch.model.text import ParsedSentence, Triplet

logger = logging.getLogger(__name__)

ENCODE_CHUNK = 512  # sentences parsed and embedded at a time
DEFAULT_RERANK = 100
DEFAULT_SETTINGS = IndexSettings.of(k_prime=0, rerank=DEFAULT_RERANK)


@dataclass
class StoredSentence:
    text: str
    triplets: list[Triplet]


class SentenceIndex(FragmentIndex[StoredSentence]):
    """A sentence collection as fragment vectors (see index.base for storage and concurrency)."""

    KIND = "sentence"
    COLUMNS = (("text", "TEXT"), ("triplets", "TEXT"))
    SHARED_FRAGMENTS = True  # a triplet embeds to the same vector in every caption that has it
    PRESCORE_SMOOTHING = SMOOTHING  # a candidate's partial S_kl: the sum over (|g_l| + n)

    @classmethod
    def create(cls, root: Path, bundle: Bundle, settings: IndexSettings | None = None,
               backend: BackendOptions | None = None) -> SentenceIndex:
        """A new, empty index folder (FileExistsError if one is there already). The default settings
        take every sentence fragment with a positive score (few distinct ones: captions share
        triplets) and score the `DEFAULT_RERANK` best candidates exactly."""
        settings = settings or DEFAULT_SETTINGS
        if settings.shape.store_dtype == "int8":  # shared fragments are told apart by their stored values
            raise ValueError("a sentence index keeps its store in float32 or float16, not int8")
        index: SentenceIndex = cls._create(root, bundle, settings, backend)
        return index

    @classmethod
    def load(cls, root: Path, bundle: Bundle, backend: BackendOptions | None = None, **search: Any) -> SentenceIndex:
        """Open an index folder built for `bundle` (IndexLoadError when missing, corrupt or mismatched)."""
        index: SentenceIndex = cls._load(root, bundle, search, backend)
        return index

    # -- adding -----------------------------------------------------------------------------------
    def add(self, texts: Sequence[str], parsed: Sequence[ParsedSentence] | None = None) -> list[int]:
        """Parse, embed and insert sentences (`parsed`: their parses made already, e.g. the trainer's
        cached ones, one per text); returns the ids of those added, in order. Without `parsed`, empty
        sentences are left out; sentences without a usable fragment are skipped (and counted in the log)."""
        if parsed is None:
            return self._add_chunks([t.strip() for t in texts if t.strip()], None)
        return self._add_chunks(list(texts), list(parsed))

    def _add_chunks(self, texts: list[str], parsed: list[ParsedSentence] | None) -> list[int]:
        added: list[int] = []
        skipped = 0
        for start in tqdm(range(0, len(texts), ENCODE_CHUNK), desc=f"sentences {self.root.name}", unit="chunk",
                          disable=len(texts) < 5 * ENCODE_CHUNK):
            part = texts[start : start + ENCODE_CHUNK]
            with self.bundle.text.lock:
                enc: EncodedSentences = (
                    self.bundle.text.encode(part, strict=False) if parsed is None
                    else self.bundle.text.encode_parsed(parsed[start : start + ENCODE_CHUNK], part))
            vecs, payloads = [], []
            for text, (sent, triplets) in zip(part, embed_encoded(self.bundle, enc), strict=True):
                if len(sent) == 0:
                    skipped += 1
                    continue
                vecs.append(sent)
                payloads.append(StoredSentence(text, triplets))
            added += self.insert(vecs, payloads)
        if skipped:
            logger.warning("%d sentences without a usable fragment were skipped", skipped)
        return added

    # -- reading ----------------------------------------------------------------------------------
    def get(self, sentence_id: int) -> SentenceRecord | None:
        with self.reading():
            if not self.contains(sentence_id):
                return None
            p = self.payloads([sentence_id])[sentence_id]
        return SentenceRecord(sentence_id, p.text, [t.text() for t in p.triplets])

    def annotate(self, image: Image.Image | Photo | ImageFragments | EmbeddedImage, k: int = 10, offset: int = 0,
                 exhaustive: bool = False) -> Page[SentenceHit]:
        """Sentences ranked offset + 1 .. offset + k for an image: decoded, extracted (features (F, 1280),
        boxes (F, 4)) or embedded; alignment boxes are in the image's own pixels. `exhaustive` ranks
        every sentence by the exact score (no candidate stage)."""
        if isinstance(image, Image.Image | Photo):
            image = embed_image(self.bundle, image)
        elif isinstance(image, ImageFragments):
            image = embed_extracted(self.bundle, [image])[0]
        img = np.asarray(image.vectors, dtype=np.float32)
        ranked, considered, best, held = self.ranker.rank(img, exact_score(self.bundle, [img], "sentences"),
                                                          offset + k, exhaustive)
        hits = []
        for item, s, p, frags in ranked[offset:]:
            alignment, found = aligned(img, frags, p.triplets, image.boxes, self.bundle.blocks, image.labels,
                                       read_sentence(self.bundle, frags, p.triplets))
            hits.append(SentenceHit(item, p.text, s, alignment, found))
        return Page(hits, offset, considered, best, held)

    # -- SQLite rows ------------------------------------------------------------------------------
    def row(self, payload: StoredSentence) -> tuple[Any, ...]:
        return payload.text, json.dumps([t.to_list() for t in payload.triplets])

    def from_row(self, row: Sequence[Any]) -> StoredSentence:
        text, triplets = row
        return StoredSentence(str(text), [Triplet.from_list(t) for t in json.loads(triplets)])
