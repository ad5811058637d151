"""Inputs as fragments: the one place where a sentence, a phrase or an image becomes embedded
fragment vectors, for both indexes (what they add and what they are asked) and the service alike.

    embed_sentence(bundle, text)      -> fragments (T, h) and their triplets
    embed_phrase(bundle, phrase)      -> the same for a phrase, or one triplet "rel(w1, w2)"
    embed_encoded(bundle, encoded)    -> the same for sentences encoded (parsed) already, per sentence
    embed_image(bundle, image)        -> EmbeddedImage: fragments (F, h) and boxes (F, 4) in its pixels
    embed_extracted(bundle, frags)    -> the same for images extracted already (the feature cache)

Regions come from the bundle's region extractor (`Bundle.extractor`); the text side parses under
the pipeline's own lock (`TextPipeline.lock`: the parser is not made for threads).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from fragsearch.model.bundle import Bundle
from fragsearch.model.features import fragment_labels
from fragsearch.model.fragments import SENTENCE_REL, EncodedSentences
from fragsearch.model.image import ImageFragments
from fragsearch.model.imageio import Photo
from fragsearch.model.text import Triplet

# "rel(w1, w2)", the form a triplet is written in
MODIFIERS_FIRST = ("amod", "det", "compound", "nn", "nummod", "num", "poss", "advmod", "nsubj", "aux")
TRIPLET_RE = re.compile(r"^\s*([\w:<>-]+)\(\s*([^,()\s]+)\s*,\s*([^,()\s]+)\s*\)\s*$")


# -- sentences --------------------------------------------------------------------------------------------
def row_triplets(triplets: Sequence[Triplet], rows: int) -> list[Triplet]:
    """The triplets behind the `rows` embedded fragments of one sentence.

    A fragment model embeds every triplet; the two-branch model embeds only the whole sentence.
    """
    if len(triplets) == rows:
        return list(triplets)
    whole = [t for t in triplets if t.rel == SENTENCE_REL]
    if len(whole) == rows:
        return whole
    raise ValueError(f"{rows} embedded fragments for {len(triplets)} triplets: cannot tell which is which")


def embed_encoded(bundle: Bundle, enc: EncodedSentences, calibrated: bool = True
                  ) -> list[tuple[np.ndarray, list[Triplet]]]:
    """Per sentence: its fragments (T, h) float32 and their triplets; T = 0 when it has none."""
    sent, mask = bundle.embed_sentences(enc, calibrated=calibrated)
    out = []
    for row in range(len(enc)):
        t = int(mask[row].sum())
        out.append((sent[row, :t].copy(), row_triplets(enc.triplets[row], t) if t else []))
    return out


def embed_texts(bundle: Bundle, texts: Sequence[str], strict: bool = True
                ) -> list[tuple[np.ndarray, list[Triplet]]]:
    """Sentences parsed and embedded, per sentence as `embed_encoded` gives them (`strict`:
    NoFragmentsError for one with nothing to match)."""
    with bundle.text.lock:
        enc = bundle.text.encode(list(texts), strict=strict)
    return embed_encoded(bundle, enc)


def embed_sentence(bundle: Bundle, text: str) -> tuple[np.ndarray, list[Triplet]]:
    """A query sentence -> its fragments (T, h) and triplets.

    Raises ValueError for an empty sentence and model.fragments.NoFragmentsError when no fragment is usable.
    """
    if not text.strip():
        raise ValueError("the sentence is empty")
    return embed_texts(bundle, [text], strict=True)[0]


@dataclass
class EmbeddedSentence:
    """A sentence as embedded fragments (T, h), and the triplets that name its rows (None: unnamed)."""

    vectors: np.ndarray
    triplets: Sequence[Triplet] | None = None


def embed_phrase(bundle: Bundle, phrase: str) -> tuple[np.ndarray, list[Triplet]]:
    """A short phrase, or one triplet written "rel(w1, w2)" with a kept relation and known words
    (fragment models with static word vectors), -> fragments (T, h) and triplets."""
    m = TRIPLET_RE.match(phrase)
    text = bundle.text
    if m and bundle.cfg.kind == "fragment" and text.cfg.word_vectors == "static":
        rel, w1, w2 = m.group(1), m.group(2).lower(), m.group(3).lower()
        rid, a, b = text.relations.index(rel), text.words.lookup(w1), text.words.lookup(w2)
        if rid is not None and a is not None and b is not None and text.content_words([w1, w2]):
            enc = EncodedSentences([[Triplet(rel, w1, w2)]], [np.array([rid])], [np.array([a])], [np.array([b])],
                                   np.zeros((0, text.words.dim), np.float32))
            return embed_encoded(bundle, enc)[0]
    if m:
        phrase = triplet_words(m.group(1), m.group(2), m.group(3))
    return embed_sentence(bundle, phrase)


def triplet_words(rel: str, w1: str, w2: str) -> str:
    """A triplet back as words in reading order, for parsing: prep_in(runs, grass) -> "runs in grass"."""
    if rel.startswith(("prep_", "prepc_")):
        return f"{w1} {rel.split('_', 1)[1].replace('_', ' ')} {w2}"
    if rel in MODIFIERS_FIRST:
        return f"{w2} {w1}"
    return f"{w1} {w2}"


# -- images -----------------------------------------------------------------------------------------------
@dataclass
class EmbeddedImage:
    """One image as embedded fragments: vectors (F, h) float32 and their boxes (F, 4) float32 in the
    image's own pixels; the image's width and height; each fragment's detector label (model/features.py
    ``fragment_labels``; empty when the model's features have no detector classes)."""

    vectors: np.ndarray
    boxes: np.ndarray
    width: int
    height: int
    labels: tuple[str | None, ...] = ()


def embed_extracted(bundle: Bundle, frags: Sequence[ImageFragments]) -> list[EmbeddedImage]:
    """Extracted images (features (F, D), boxes (F, 4)) embedded, with their fragments' detector labels: one
    batch when they have as many fragments each, else one at a time."""
    if not frags:
        return []
    if len({len(f.features) for f in frags}) == 1:
        vecs = list(bundle.embed_images(np.stack([f.features for f in frags])))
    else:
        vecs = [bundle.embed_images(f.features[None])[0] for f in frags]
    return [EmbeddedImage(v, np.asarray(f.boxes[: len(v)], dtype=np.float32), int(f.width), int(f.height),
                          fragment_labels(f.features, bundle.image_cfg)[: len(v)])
            for f, v in zip(frags, vecs, strict=True)]


def embed_image(bundle: Bundle, image: Image.Image | Photo) -> EmbeddedImage:
    """An image's regions (the bundle's region extractor) embedded; boxes in the picture's own pixels.

    A Photo read from bytes (an upload: its `digest`) is looked up first among the bundle's recent uploads
    (`Bundle.recent_uploads`, by the bytes' sha256 and the decoded size): the same file sent again (the next
    page of an annotation, a second look, "more like this") is not extracted again."""
    key = (image.digest, image.image.size) if isinstance(image, Photo) and image.digest else None
    if key is not None:
        found = bundle.recent_uploads.get(key)
        if found is not None:
            return found
    embedded = embed_extracted(bundle, [bundle.extractor.extract(image)])[0]
    if key is not None:
        bundle.recent_uploads.put(key, embedded)
    return embedded
