"""Sentences -> sentence fragments as ids: relation, and the pool rows of the two words.

The pool of frozen vectors a model reads is the word table's rows followed by `extra` rows that a
batch of sentences brings with it (whole-sentence vectors, or words in their sentence's context).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.atomic import cached_file
from fragsearch.model.config import TextConfig
from fragsearch.model.minilm import minilm
from fragsearch.model.parsers import make_parser, stop_words
from fragsearch.model.text import ParsedSentence, Parser, RelationVocab, Triplet, sentence_triplets
from fragsearch.model.textlayers import TextLayers
from fragsearch.model.trees import SentenceTree
from fragsearch.model.words import WordTable, encode_texts, encode_tuned

STOP_WORDS = stop_words()

logger = logging.getLogger(__name__)

CACHE_LIMIT = 200_000  # sentences whose frozen vectors a pipeline keeps in memory
WORD_REL = "<word>"  # fallback: a sentence with no usable triplet becomes its known words, (w, w) each
SENTENCE_REL = "<sentence>"  # the whole-sentence fragment, mirror of the whole-image fragment
OTHER_REL = "<other>"  # tree encoders: the relations under the cut-off share one matrix
PARSE_FORMAT = "tree-1"  # parse cache entries hold the tree (ParsedSentence.heads, labels)


Vectors = tuple[np.ndarray, np.ndarray, np.ndarray]  # frozen vectors on disk: tokens, offsets, sentences

class NoFragmentsError(ValueError):
    """A query has nothing to match: no content word the model was trained on."""


@dataclass
class EncodedSentences:
    """Fragments of L sentences: per sentence the kept triplets and their ids.

    rel[l], a[l], b[l]: (T_l,) int64 — relation id and pool rows of w1 and w2.
    extra: (E, d) float32 pool rows that follow the word table.
    trees: with fragments "tree" (the global sentence encoders), each sentence's dependency tree over
    the same pool; its one fragment is then the whole sentence (a, b unused).
    """

    triplets: list[list[Triplet]]
    rel: list[np.ndarray]
    a: list[np.ndarray]
    b: list[np.ndarray]
    extra: np.ndarray = field(default_factory=lambda: np.zeros((0, 384), np.float32))
    trees: list[SentenceTree] | None = None

    def __len__(self) -> int:
        return len(self.triplets)

    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.rel], dtype=np.int64)


def pad_rows(rel: Sequence[np.ndarray], a: Sequence[np.ndarray], b: Sequence[np.ndarray],
             device: Any = None) -> tuple[Any, ...]:
    """Padded (rel, a, b, mask), each (L, T_max) int64, from per-sentence id arrays: NumPy arrays, or torch
    tensors on `device` when one is given (training)."""
    t = max([len(r) for r in rel] + [1])
    out = np.zeros((4, len(rel), t), dtype=np.int64)
    for row, (r, x, y) in enumerate(zip(rel, a, b, strict=True)):
        n = len(r)
        out[0, row, :n] = r
        out[1, row, :n] = x
        out[2, row, :n] = y
        out[3, row, :n] = 1
    if device is None:
        return out[0], out[1], out[2], out[3]
    import torch

    r_t, a_t, b_t, m_t = (torch.from_numpy(x).to(device) for x in out)
    return r_t, a_t, b_t, m_t


def pad(enc: EncodedSentences, idx: Sequence[int] | None = None, device: Any = None) -> tuple[Any, ...]:
    """Padded (rel, a, b, mask), each (L, T_max), for the sentences `idx` (default all)."""
    ids = list(range(len(enc))) if idx is None else list(idx)
    return pad_rows([enc.rel[i] for i in ids], [enc.a[i] for i in ids], [enc.b[i] for i in ids], device)


class TextPipeline:
    """Parser + kept relations + fixed word table: sentences -> EncodedSentences."""

    def __init__(self, cfg: TextConfig, relations: RelationVocab, words: WordTable,
                 parser: Parser | None = None) -> None:
        self.cfg = cfg
        self.relations = relations
        self.words = words
        self._parser = parser
        self.device = "cpu"  # where MiniLM runs (the bundle's device once loaded)
        self.graphs: Path | None = None  # where MiniLM's graph is found after the release folder (the bundle's)
        # a model's own trained top layers of MiniLM (ModelConfig.text_layers; set by the Bundle from the model's
        # weights, `use_layers`): its words in context and sentence vectors come from them (`encode_tuned`)
        self.layers: TextLayers | None = None
        self._sentence_vecs: dict[str, np.ndarray] = {}  # MiniLM sentence vectors already computed
        self._context_vecs: dict[tuple[str, ...], np.ndarray] = {}  # contextual word vectors, per token list
        # held around encoding by callers that share the pipeline between threads (the parser and the
        # caches above are not made for threads)
        self.lock = threading.Lock()

    def use_layers(self, layers: TextLayers | None) -> None:
        """Read words and sentences through a model's trained top layers (None: MiniLM's own); the vectors kept
        in memory are dropped when the layers' weights change."""
        if (None if layers is None else layers.digest) != (None if self.layers is None else self.layers.digest):
            self.forget()
        self.layers = layers

    def _encode(self, sentences: Sequence[str], token_lists: Sequence[Sequence[str]], contextual: bool,
                whole: bool) -> tuple[list[np.ndarray], np.ndarray]:
        """MiniLM's vectors of these sentences (`encode_texts`), or the model's trained layers' (`encode_tuned`:
        words and sentence from the one pass of the token list)."""
        if self.layers is None:
            return encode_texts(list(sentences), [list(k) for k in token_lists], contextual=contextual, whole=whole,
                                model=minilm(self.device, folder=self.graphs),
                                one_pass=self.cfg.sentence_pass == "words")
        ctx, sent = encode_tuned(token_lists, self.layers, device=self.device, folder=self.graphs)
        return (ctx if contextual else [], sent if whole else sent[:0])

    def frozen_vectors(self, parsed: Sequence[ParsedSentence], sentences: Sequence[str]
                       ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """The per-sentence frozen vectors these settings read: the words in context ((T_l, d) per sentence, or
        [] for static words) and the whole-sentence vectors ((L, d), or None without the whole-sentence
        fragment). What the in-memory caches miss is computed in one MiniLM call (`encode_texts`: one pass for
        both where the inputs allow; a model with trained layers: `encode_tuned`); the caches are bounded
        (cleared past CACHE_LIMIT entries)."""
        contextual, whole = self.cfg.word_vectors == "contextual", self.cfg.sentence_fragment and len(sentences) > 0
        keys = [tuple(p.tokens) or ("",) for p in parsed]
        todo = sorted({i for i, k in enumerate(keys) if contextual and k not in self._context_vecs}
                      | {i for i, t in enumerate(sentences) if whole and t not in self._sentence_vecs})
        if todo:
            todo = list({(keys[i], sentences[i]): i for i in todo}.values())  # each (words, text) once
            ctx, sent = self._encode([sentences[i] for i in todo], [keys[i] for i in todo], contextual, whole)
            for cache, kind in ((self._context_vecs, contextual), (self._sentence_vecs, whole)):
                if kind and len(cache) + len(todo) > CACHE_LIMIT:
                    cache.clear()
            if contextual:
                self._context_vecs.update(zip((keys[i] for i in todo), ctx, strict=True))
            if whole:
                self._sentence_vecs.update(zip((sentences[i] for i in todo), sent, strict=True))
        return ([self._context_vecs[k] for k in keys] if contextual else [],
                np.stack([self._sentence_vecs[t] for t in sentences]) if whole else None)

    @property
    def parser(self) -> Parser:
        if self._parser is None:
            self._parser = make_parser(self.cfg.parser)
        return self._parser

    @staticmethod
    def relation_names(cfg: TextConfig, kept: Sequence[str]) -> list[str]:
        """Relation ids of a model: the kept relations, then the fallback and sentence types."""
        names = [r for r in kept if r not in (WORD_REL, SENTENCE_REL, OTHER_REL)] + [WORD_REL]
        if cfg.sentence_fragment or cfg.fragments == "tree":
            names.append(SENTENCE_REL)
        if cfg.fragments == "tree":
            names.append(OTHER_REL)
        return names

    @classmethod
    def fit(cls, cfg: TextConfig, parsed: Sequence[ParsedSentence], cache_dir: Path,
            parser: Parser | None = None) -> TextPipeline:
        """Kept relations (cut-off on the training relations) and the word table of the training words."""
        found = RelationVocab.fit((sentence_triplets(p, cfg.fragments) for p in parsed), cfg.relation_cutoff)
        kept = RelationVocab(cls.relation_names(cfg, found.kept), found.counts, cfg.relation_cutoff)
        logger.info("relations kept: %s", ", ".join(found.kept))
        counts = Counter(w for p in parsed for w in p.tokens)
        vocab = sorted(w for w, c in counts.items() if c >= cfg.min_word_count)
        words = WordTable.cached(vocab, cache_dir)
        logger.info("word table: %d words (%d-d)", len(words), words.dim)
        return cls(cfg, kept, words, parser)

    def forget(self) -> None:
        """Drop the in-memory frozen vectors (after a bulk job that `warm`-ed them)."""
        self._sentence_vecs.clear()
        self._context_vecs.clear()

    def warm(self, parsed: Sequence[ParsedSentence], sentences: Sequence[str], cache_dir: Path) -> None:
        """Fill the in-memory caches of frozen vectors for these sentences from one file under cache_dir.

        The file holds the contextual word vectors and the whole-sentence vectors this pipeline's
        settings use, keyed by the token lists and texts; it is computed once and written atomically.
        """
        contextual = self.cfg.word_vectors == "contextual"
        if not (contextual or self.cfg.sentence_fragment) or not len(sentences):
            return
        keys = [tuple(p.tokens) or ("",) for p in parsed]
        what: list[Any] = [contextual, self.cfg.sentence_fragment, keys, list(sentences)]
        if self.layers is not None:  # a model's trained layers: their own vectors
            what.append(self.layers.digest)
        if self.cfg.sentence_pass != "text":  # the sentence vectors of the words' pass (the default's keys stay)
            what.append(f"sentence_pass={self.cfg.sentence_pass}")
        digest = hashlib.sha1(json.dumps(what).encode())
        path = Path(cache_dir) / f"vectors-{digest.hexdigest()[:16]}.npz"

        def compute() -> Vectors:
            logger.info("computing frozen vectors of %d sentences", len(sentences))
            ctx, sent = self._encode(sentences, keys, contextual, self.cfg.sentence_fragment)
            tokens = np.concatenate(ctx) if ctx else np.zeros((0, self.words.dim), np.float32)
            offsets = np.cumsum([0] + [len(c) for c in ctx]) if ctx else np.zeros(1, np.int64)
            return tokens, offsets, sent

        def read(file: Path) -> Vectors:
            with np.load(file) as z:
                logger.info("frozen vectors of %d sentences from %s", len(sentences), file)
                return z["tokens"], z["offsets"], z["sentences"]

        tokens, offsets, sent = cached_file(
            path, compute, lambda v, fh: np.savez(fh, tokens=v[0], offsets=v[1], sentences=v[2]), read)
        if contextual:
            self._context_vecs.update(
                (k, tokens[offsets[i] : offsets[i + 1]]) for i, k in enumerate(keys))
        if self.cfg.sentence_fragment:
            self._sentence_vecs.update(zip(sentences, sent, strict=True))

    def parse(self, sentences: Sequence[str]) -> list[ParsedSentence]:
        return self.parser.parse(list(sentences))

    def content_words(self, words: Sequence[str]) -> list[str]:
        """The words of a query that carry meaning the model learnt: in the training vocabulary (the
        word table) and not function words. A query without one has nothing to match, whatever the
        word vectors: contextual vectors exist for any token, and the whole-sentence fragment exists
        for any text, so "!!!", emoji or made-up words would otherwise be scored like a sentence."""
        return [w for w in words if w in self.words and w not in STOP_WORDS]

    def kept_triplets(self, parsed: ParsedSentence, unigram: bool = False) -> list[Triplet]:
        """Triplets whose relation is kept and whose words are known; fallback to unigrams."""
        known = (lambda w: True) if self.cfg.word_vectors == "contextual" else (
            lambda w: self.words.lookup(w) is not None)
        out: list[Triplet] = []
        if not unigram:
            out = [t for t in sentence_triplets(parsed, self.cfg.fragments)
                   if self.relations.index(t.rel) is not None and known(t.w1) and known(t.w2)]
        if not out:
            seen: set[str] = set()
            for w in parsed.tokens:
                if known(w) and w not in seen:
                    seen.add(w)
                    out.append(Triplet(WORD_REL, w, w))
        return out

    def encode_parsed(self, parsed: Sequence[ParsedSentence], sentences: Sequence[str],
                      unigram: bool = False, strict: bool = False) -> EncodedSentences:
        """Ids for parsed sentences. `strict`: a sentence with no fragment raises NoFragmentsError."""
        base = len(self.words)
        contextual = self.cfg.word_vectors == "contextual"
        extra: list[np.ndarray] = []
        n_extra = 0
        ctx, sent_vecs = self.frozen_vectors(parsed, sentences)
        tree_mode = self.cfg.fragments == "tree"
        enc = EncodedSentences([], [], [], [], trees=[] if tree_mode else None)
        for li, p in enumerate(parsed):
            if tree_mode:
                self._append_tree(enc, p, sentences[li], base + n_extra if contextual else None)
            trip = [] if tree_mode else self.kept_triplets(p, unigram)
            row_of: dict[str, int] = {}
            if contextual and p.tokens:
                extra.append(ctx[li].astype(np.float32))
                for pos, w in enumerate(p.tokens):
                    row_of.setdefault(w, base + n_extra + pos)
                n_extra += len(p.tokens)

            def row(w: str, row_of: dict[str, int] = row_of) -> int:
                if contextual:
                    return row_of[w]
                r = self.words.lookup(w)
                assert r is not None
                return r

            rel = [self.relations.index(t.rel) for t in trip]
            a = [row(t.w1) for t in trip]
            b = [row(t.w2) for t in trip]
            if sent_vecs is not None:
                text = " ".join(p.tokens) or sentences[li].strip().lower()
                trip = [*trip, Triplet(SENTENCE_REL, text, text)]
                extra.append(sent_vecs[li : li + 1].astype(np.float32))
                rel.append(self.relations.index(SENTENCE_REL))
                a.append(base + n_extra)
                b.append(base + n_extra)
                n_extra += 1
            if strict and ((not trip and not tree_mode) or not self.content_words(p.tokens)):
                raise NoFragmentsError(
                    f"nothing to match in {sentences[li]!r}: none of its words is a content word of the "
                    f"model's training vocabulary")
            if tree_mode:  # one fragment, the whole sentence, composed from enc.trees[li]
                text = " ".join(p.tokens) or sentences[li].strip().lower()
                trip, rel, a, b = [Triplet(SENTENCE_REL, text, text)], [self.relations.index(SENTENCE_REL)], [0], [0]
            enc.triplets.append(trip)
            enc.rel.append(np.array(rel, dtype=np.int64))
            enc.a.append(np.array(a, dtype=np.int64))
            enc.b.append(np.array(b, dtype=np.int64))
        enc.extra = np.concatenate(extra) if extra else np.zeros((0, self.words.dim), np.float32)
        return enc

    def _append_tree(self, enc: EncodedSentences, p: ParsedSentence, sentence: str, first_row: int | None) -> None:
        """The sentence's tree: token i reads pool row first_row + i (contextual vectors) or its word
        table row (static; -1 for a word outside the table)."""
        if len(p.heads) != len(p.tokens):
            raise ValueError(f"the parse of {sentence!r} has no dependency tree (a parse cache from before trees?)")
        if first_row is not None:
            rows = [first_row + i for i in range(len(p.tokens))]
        else:
            rows = [-1 if (r := self.words.lookup(w)) is None else r for w in p.tokens]
        other = self.relations.index(OTHER_REL)
        assert enc.trees is not None and other is not None
        rels = [other if (r := self.relations.index(lab)) is None else r for lab in p.labels]
        enc.trees.append(SentenceTree.build(rows, p.heads, rels, root_rel=other))

    def encode(self, sentences: Sequence[str], strict: bool = True) -> EncodedSentences:
        """Parse and encode query sentences (`strict`: NoFragmentsError for one with nothing to match)."""
        return self.encode_parsed(self.parse(sentences), sentences, strict=strict)

    def pool_of(self, enc: EncodedSentences, a: np.ndarray, b: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The frozen vectors that ids a and b (any shape) point to: (U, d) float32, and a, b re-pointed into it.

        Ids below the word table's size are its rows, the others rows of ``enc.extra`` (the per-sentence
        vectors: contextual words, whole sentences); only the rows used are copied."""
        ids = np.unique(np.concatenate([np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)]))  # sorted
        base = len(self.words)
        table = self.words.vectors
        rows = np.concatenate([table[ids[ids < base]], enc.extra[ids[ids >= base] - base]])
        pool = np.ascontiguousarray(rows, dtype=np.float32)
        return pool, np.searchsorted(ids, a), np.searchsorted(ids, b)


def parse_cached(parser: Parser, sentences: Sequence[str], cache_dir: Path) -> list[ParsedSentence]:
    """Parses of a sentence list, stored once under cache_dir (keyed by the text, the parser and its
    version: another spaCy or parser model release parses anew)."""
    key = "\n".join(sentences) + parser.name + PARSE_FORMAT + "\0" + parser.version
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]

    def parse() -> list[ParsedSentence]:
        logger.info("parsing %d sentences with %s", len(sentences), parser.name)
        return parser.parse(list(sentences))

    return cached_file(Path(cache_dir) / f"parses-{parser.name}-{digest}.json", parse,
                       lambda parsed, fh: fh.write(json.dumps([p.to_dict() for p in parsed]).encode()),
                       lambda path: [ParsedSentence.from_dict(d) for d in json.loads(path.read_text())])
