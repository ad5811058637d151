"""The runtime's large, thin matrix products through ONNX Runtime's MatMul: a search's scan of every image
fragment against the sentence's few, the sentence against the calibration's reference images, an upload's
fragments against every caption fragment (the annotation's recall).

NumPy's BLAS (OpenBLAS) runs such a tall, thin product (20,000 x 512 by 512 x 10) at about half the speed of
ONNX Runtime's own kernels on one thread (docs/benchmarks/service.md, "The scans' products"); the product is
the same float32 arithmetic, possibly rounded in another order. Small products, torch tensors (training) and arrays
ONNX Runtime cannot read in place stay with ``@``.

The graph is one MatMul node with free dimensions, written here as its protobuf bytes (the runtime has no
``onnx`` package to build it with): ``(n, d) x (d, m) -> (n, m)``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from fragsearch.model.arrays import Array, is_torch

# at least this many multiply-adds (n * d * m) go through ONNX Runtime (a call costs it ~20 us more than NumPy),
# with at most THIN columns: a wider product is BLAS's own ground (docs/results/product-shapes.csv, one thread:
# OpenBLAS 108 ms, ONNX Runtime 134 ms for 20,000 x 512 by 512 x 512; 7.2 and 3.9 ms by 512 x 8)
LARGE = 1 << 20
THIN = 64
_sessions: dict[int, Any] = {}
_lock = threading.Lock()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint (wire type 0) or length-delimited bytes (wire type 2)."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _float_matrix(name: str, rows: str, cols: str) -> bytes:
    """ValueInfoProto of a float32 (rows, cols) tensor with free dimensions."""
    dims = _field(1, _field(2, rows.encode())) + _field(1, _field(2, cols.encode()))
    tensor = _field(1, 1) + _field(2, dims)  # elem_type FLOAT, shape
    return _field(1, name.encode()) + _field(2, _field(1, tensor))


def matmul_graph() -> bytes:
    """The serialized ModelProto of ``y = a @ b`` (IR version 8, opset 17), float32 with free dimensions."""
    node = _field(1, b"a") + _field(1, b"b") + _field(2, b"y") + _field(4, b"MatMul")
    graph = (_field(1, node) + _field(2, b"product") + _field(11, _float_matrix("a", "n", "d"))
             + _field(11, _float_matrix("b", "d", "m")) + _field(12, _float_matrix("y", "n", "m")))
    opset = _field(1, b"") + _field(2, 17)
    return _field(1, 8) + _field(7, graph) + _field(8, opset)


def _session() -> Any:
    """The process's MatMul session on the threads of its products (model/onnx.py `numeric_threads`: in the
    service, each running request's share of the cores, as NumPy's BLAS)."""
    from fragsearch.model.onnx import numeric_threads, session

    threads = numeric_threads()
    with _lock:
        if threads not in _sessions:
            _sessions[threads] = session(matmul_graph(), threads=threads)
        return _sessions[threads]


def product(a: Array, b: Array) -> Array:
    """``a @ b.T`` for a: (n, d), b: (m, d); a large float32 NumPy product through ONNX Runtime."""
    if not is_large(a, b):
        return a @ b.T
    out = _session().run(None, {"a": a, "b": np.ascontiguousarray(b.T)})[0]
    return np.asarray(out)


def is_large(a: Array, b: Array, blocks: int = 1) -> bool:
    """Whether ``a @ b.T`` goes through ONNX Runtime (`product`; with `blocks`, `block_products` of that many
    slices: a product `blocks` times as wide)."""
    width = b.shape[0] * blocks
    return (not is_torch(a) and not is_torch(b) and a.ndim == 2 and b.ndim == 2 and a.dtype == np.float32
            and b.dtype == np.float32 and width <= THIN and a.shape[0] * a.shape[1] * width >= LARGE
            and a.flags.c_contiguous)


def block_products(a: np.ndarray, b: np.ndarray, parts: list[slice]) -> np.ndarray:
    """(n, B, m): each slice's ``a[:, part] @ b[:, part].T`` for a: (n, d), b: (m, d) and the B slices of d
    `parts`, in one pass over `a` (a product with b's slices laid block-diagonally: each of a's rows is read
    once)."""
    m = b.shape[0]
    diagonal = np.zeros((len(parts) * m, b.shape[1]), np.float32)
    for k, part in enumerate(parts):
        diagonal[k * m : (k + 1) * m, part] = b[:, part]
    return np.asarray(product(a, diagonal)).reshape(a.shape[0], len(parts), m)
