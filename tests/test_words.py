"""MiniLM word table, sentence embeddings and in-context word vectors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fragsearch.model.minilm import minilm
from fragsearch.model.words import WordTable, encode_sentences, encode_words_in_context


@pytest.fixture(scope="module")
def table() -> WordTable:
    return WordTable.build(["dog", "puppy", "car", "dog"])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_word_table_similarity(table: WordTable) -> None:
    assert table.words == ["car", "dog", "puppy"]
    assert table.vectors.shape == (3, 384) and table.vectors.dtype == np.float32
    assert table.dim == 384 and len(table) == 3
    assert table.lookup("zebra") is None
    idx = {w: table.lookup(w) for w in ("dog", "puppy", "car")}
    assert all(i is not None for i in idx.values())
    dog, puppy, car = (table.vectors[i] for i in idx.values())  # type: ignore[index]
    assert _cos(dog, puppy) > _cos(dog, car)


def test_save_load_round_trip(table: WordTable, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "table.npz"
    table.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["table.npz"]  # no temp file left
    again = WordTable.load(path)
    assert again.words == table.words
    np.testing.assert_array_equal(again.vectors, table.vectors)


def test_cached_reuses_file(table: WordTable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = WordTable.build.__func__  # type: ignore[attr-defined]

    def counting_build(cls: type[WordTable], words: list[str], batch_size: int = 256) -> WordTable:
        calls.append(1)
        return original(cls, words, batch_size)

    monkeypatch.setattr(WordTable, "build", classmethod(counting_build))
    first = WordTable.cached(["puppy", "dog", "car"], tmp_path)
    (path,) = list(tmp_path.glob("words-*.npz"))
    mtime = os.stat(path).st_mtime_ns
    second = WordTable.cached(["car", "dog", "puppy", "dog"], tmp_path)
    assert calls == [1]
    assert os.stat(path).st_mtime_ns == mtime
    assert second.words == first.words == table.words
    np.testing.assert_allclose(second.vectors, table.vectors, atol=1e-5)
    WordTable.cached(["dog"], tmp_path)  # another vocabulary: another file
    assert len(list(tmp_path.glob("words-*.npz"))) == 2 and calls == [1, 1]


def test_encode_sentences() -> None:
    emb = encode_sentences(["A dog runs on grass .", "A puppy plays in a field .", "A red car on a road ."])
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]


def test_words_in_context() -> None:
    toks = [["a", "snowboarder", "jumps"], ["dog"], []]
    out = encode_words_in_context(toks)
    assert [v.shape for v in out] == [(3, 384), (1, 384), (0, 384)]
    np.testing.assert_allclose(np.linalg.norm(out[0], axis=1), 1.0, atol=1e-4)
    assert minilm() is minilm(), "MiniLM is loaded once per process"


def test_warm_reuses_the_vectors_file(table: WordTable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fragsearch.model.config import TextConfig
    from fragsearch.model.fragments import TextPipeline
    from fragsearch.model.text import ParsedSentence, RelationVocab, Triplet

    cfg = TextConfig(sentence_fragment=True, word_vectors="contextual")
    rels = RelationVocab(TextPipeline.relation_names(cfg, ["det"]), {"det": 3}, 0.01)
    sentences = ["a dog runs", "a puppy", "a dog runs"]
    parsed = [ParsedSentence(tuple(s.split()), (Triplet("det", s.split()[-1], "a"),)) for s in sentences]
    fresh = TextPipeline(cfg, rels, table).encode_parsed(parsed, sentences)  # computed on the spot

    first = TextPipeline(cfg, rels, table)
    first.warm(parsed, sentences, tmp_path)
    (path,) = list(tmp_path.glob("vectors-*.npz"))
    assert not list(tmp_path.glob("*.tmp*"))

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the vectors file should have been used")

    monkeypatch.setattr("fragsearch.model.fragments.encode_texts", no_model)
    again = TextPipeline(cfg, rels, table)
    again.warm(parsed, sentences, tmp_path)
    enc = again.encode_parsed(parsed, sentences)
    assert [list(r) for r in enc.rel] == [list(r) for r in fresh.rel]
    np.testing.assert_allclose(enc.extra, fresh.extra, atol=1e-5)


def test_onnx_encoders_give_the_torch_outputs() -> None:
    """The ONNX Runtime path equals sentence-transformers' own encode and the torch transformer."""
    import torch

    from fragsearch.training.nets.minilm import load_minilm

    sentences = ["A black dog is running after a white dog in the snow .", "two men", "  padded  text "]
    model: Any = load_minilm()
    reference = np.asarray(model.encode(sentences, convert_to_numpy=True, normalize_embeddings=True))
    np.testing.assert_allclose(encode_sentences(sentences), reference, atol=1e-5)
    tokens = [["a", "hot", "dog", "stand"], ["dog"]]
    tokenizer, bert = model[0].tokenizer, model[0].auto_model
    enc = tokenizer(tokens, is_split_into_words=True, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state.numpy()
    got = encode_words_in_context(tokens, normalize=False)
    for b, toks in enumerate(tokens):
        pieces = [i for i, w in enumerate(enc.word_ids(b)) if w == len(toks) - 1]
        np.testing.assert_allclose(got[b][-1], hidden[b, pieces].mean(axis=0), atol=1e-4)
