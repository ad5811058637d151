"""Queries as fragment vectors, and alignments as results: the glue between the model and the indexes."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from index.types import FragmentMatch
from model.bundle import Bundle
from model.fragments import SENTENCE_REL, EncodedSentences
from model.score import align
from model.text import Triplet

# "rel(w1, w2)", the form FragmentMatch.triplet is written in
MODIFIERS_FIRST = ("amod", "det", "compound", "nn", "nummod", "num", "poss", "advmod", "nsubj", "aux")
TRIPLET_RE = re.compile(r"^\s*([\w:<>-]+)\(\s*([^,()\s]+)\s*,\s*([^,()\s]+)\s*\)\s*$")


_text_locks: weakref.WeakKeyDictionary[Bundle, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def text_lock(bundle: Bundle) -> threading.Lock:
    """One lock per model around parsing and sentence encoding (the parser is not made for threads)."""
    with _locks_guard:
        lock = _text_locks.get(bundle)
        if lock is None:
            lock = _text_locks[bundle] = threading.Lock()
        return lock


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
                  ) -> list[tuple[torch.Tensor, list[Triplet]]]:
    """Per sentence: its fragments (T, h) float32 and their triplets; T = 0 when it has none."""
    with torch.inference_mode():
        sent, mask = bundle.embed_sentences(enc, calibrated=calibrated)
    out = []
    for row in range(len(enc)):
        t = int(mask[row].sum())
        out.append((sent[row, :t].clone(), row_triplets(enc.triplets[row], t) if t else []))
    return out


def encode_sentence(bundle: Bundle, text: str) -> tuple[torch.Tensor, list[Triplet]]:
    """A query sentence -> its fragments (T, h) and triplets.

    Raises ValueError for an empty sentence and model.fragments.NoFragmentsError when no fragment is usable.
    """
    if not text.strip():
        raise ValueError("the sentence is empty")
    with text_lock(bundle):
        enc = bundle.text.encode([text], strict=True)
    return embed_encoded(bundle, enc)[0]


def encode_phrase(bundle: Bundle, phrase: str) -> tuple[torch.Tensor, list[Triplet]]:
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
    return encode_sentence(bundle, phrase)


def triplet_words(rel: str, w1: str, w2: str) -> str:
    """A triplet back as words in reading order, for parsing: prep_in(runs, grass) -> "runs in grass"."""
    if rel.startswith(("prep_", "prepc_")):
        return f"{w1} {rel.split('_', 1)[1].replace('_', ' ')} {w2}"
    if rel in MODIFIERS_FIRST:
        return f"{w2} {w1}"
    return f"{w1} {w2}"


def matches(img: torch.Tensor, sent: torch.Tensor, triplets: Sequence[Triplet] | None,
            boxes: np.ndarray) -> list[FragmentMatch]:
    """The alignment of one image-sentence pair as results, in sentence-fragment order.

    img: (F, h) image fragments with boxes (F, 4); sent: (T, h) sentence fragments with their
    triplets. Sentence fragments without a positive match (no share in S_kl) are left out.
    """
    al = align(img, sent)
    out = []
    for j, (i, score, ok) in enumerate(zip(al.image_fragment, al.score, al.matched, strict=True)):
        if not ok:
            continue
        t = triplets[j] if triplets else Triplet("", f"fragment {j}", f"fragment {j}")
        out.append(FragmentMatch(triplet=t.text() if triplets else f"fragment {j}", relation=t.rel,
                                 words=(t.w1, t.w2), box=[float(v) for v in boxes[i]], fragment=int(i),
                                 score=float(score)))
    return out
