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
import torch
from PIL import Image
from tqdm import tqdm

from index.base import FragmentIndex
from index.candidates import BackendOptions
from index.matches import matches
from index.types import IndexSettings, Page, SentenceHit, SentenceRecord
from model.bundle import Bundle
from model.embed import EmbeddedImage, embed_encoded, embed_extracted, embed_image
from model.fragments import EncodedSentences
from model.image import ImageFragments
from model.score import SMOOTHING
from model.text import ParsedSentence, Triplet

logger = logging.getLogger(__name__)

ENCODE_CHUNK = 512  # sentences parsed and embedded at a time
DEFAULT_RERANK = 100
DEFAULT_SETTINGS = IndexSettings(k_prime=0, rerank=DEFAULT_RERANK)


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
        if settings.store_dtype == "int8":  # shared fragments are told apart by their stored values
            raise ValueError("a sentence index keeps its store in float32 or float16, not int8")
        index: SentenceIndex = cls._create(root, bundle, settings, backend)
        return index

    @classmethod
    def load(cls, root: Path, bundle: Bundle, backend: BackendOptions | None = None, **search: Any) -> SentenceIndex:
        """Open an index folder built for `bundle` (IndexLoadError when missing, corrupt or mismatched)."""
        index: SentenceIndex = cls._load(root, bundle, search, backend)
        return index

    # -- adding -----------------------------------------------------------------------------------
    def add_sentences(self, texts: Sequence[str]) -> list[int]:
        """Parse, embed and insert sentences; returns the ids of those added, in order. Empty
        sentences and sentences without a usable fragment are skipped (and counted in the log)."""
        keep = [t.strip() for t in texts if t.strip()]
        return self._add_chunks(keep, None)

    def add_parsed(self, parsed: Sequence[ParsedSentence], texts: Sequence[str]) -> list[int]:
        """Like add_sentences for sentences parsed already (e.g. the trainer's cached parses)."""
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
                vecs.append(sent.numpy())
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

    def annotate(self, image: Image.Image, k: int = 10) -> list[SentenceHit]:
        """Top k sentences for an image; alignment boxes are in the image's own pixels."""
        return self.annotate_page(image, 0, k).hits

    def annotate_page(self, image: Image.Image, offset: int, limit: int) -> Page[SentenceHit]:
        """Sentences ranked offset + 1 .. offset + limit for an image (boxes in its own pixels)."""
        return self.annotate_embedded(embed_image(self.bundle, image), offset, limit)

    def annotate_fragments(self, frags: ImageFragments, k: int = 10, exhaustive: bool = False) -> list[SentenceHit]:
        """Top k sentences for extracted image fragments (features (F, 1280), boxes (F, 4))."""
        return self.annotate_embedded(embed_extracted(self.bundle, [frags])[0], 0, k, exhaustive).hits

    def annotate_embedded(self, image: EmbeddedImage, offset: int, limit: int,
                          exhaustive: bool = False) -> Page[SentenceHit]:
        """Sentences ranked offset + 1 .. offset + limit for an embedded image."""
        return self.annotate_vectors_page(image.vectors, image.boxes, offset, limit, exhaustive)

    def annotate_exhaustive(self, frags: ImageFragments, k: int = 10) -> list[SentenceHit]:
        """Top k sentences by the exact score over the whole collection (no candidate stage)."""
        return self.annotate_fragments(frags, k, exhaustive=True)

    @torch.inference_mode()
    def annotate_vectors(self, img: torch.Tensor, boxes: np.ndarray, k: int = 10,
                         exhaustive: bool = False) -> list[SentenceHit]:
        """Top k sentences for image fragments img (F, h) with boxes (F, 4)."""
        return self.annotate_vectors_page(img, boxes, 0, k, exhaustive).hits

    @torch.inference_mode()
    def annotate_vectors_page(self, img: torch.Tensor, boxes: np.ndarray, offset: int, limit: int,
                              exhaustive: bool = False) -> Page[SentenceHit]:
        """Sentences ranked offset .. offset + limit - 1 for image fragments img (F, h) with boxes (F, 4)."""
        img = torch.as_tensor(img, dtype=torch.float32)
        img_mask = torch.ones(1, len(img))

        def score(sent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bundle.scores(img[None], img_mask, sent, mask)[0]

        ranked, considered = self.ranker.rank(img.numpy(), score, offset + limit, exhaustive)
        return Page([SentenceHit(item, p.text, s, matches(img, frags, p.triplets, boxes, self.bundle.blocks))
                     for item, s, p, frags in ranked[offset:]], offset, considered)

    # -- SQLite rows ------------------------------------------------------------------------------
    def row(self, payload: StoredSentence) -> tuple[Any, ...]:
        return payload.text, json.dumps([t.to_list() for t in payload.triplets])

    def from_row(self, row: Sequence[Any]) -> StoredSentence:
        text, triplets = row
        return StoredSentence(str(text), [Triplet.from_list(t) for t in json.loads(triplets)])
