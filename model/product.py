"""The runtime's large, thin matrix products through ONNX Runtime's MatMul: a search's scan of every image
fragment against the sentence's few, the sentence against the calibration's reference images, an upload's
fragments against every caption fragment (the annotation's recall).

NumPy's BLAS (OpenBLAS) runs such a tall, thin product (20,000 x 512 by 512 x 10) at about half the speed of
ONNX Runtime's own kernels on one thread (docs/benchmarks/service.md, "The scans' products"); the product is
the same float32 arithmetic, possibly rounded in another order. Small products, torch tensors (training) and arrays
ONNX Runtime cannot read in place stay with ``@``.

A fixed tall matrix, the calibration's reference images, is read through its 8-bit codes (`QuantizedRows`):
a quarter of the bytes, multiplied in integers by MatMulInteger, exact on every instruction set; the scores
read from it are the float32 ones within the codes' rounding (docs/benchmarks/service.md, "The references through
their codes").

Each graph is one node with free dimensions, written here as its protobuf bytes (the runtime has no ``onnx``
package to build it with): ``(n, d) x (d, m) -> (n, m)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from fragsearch.model.arrays import Array, is_torch

# at least this many multiply-adds (n * d * m) go through ONNX Runtime (a call costs it ~20 us more than NumPy),
# with at most THIN columns: a wider product is BLAS's own ground (docs/results/product-shapes.csv, one thread:
# OpenBLAS 108 ms, ONNX Runtime 134 ms for 20,000 x 512 by 512 x 512; 7.2 and 3.9 ms by 512 x 8)
LARGE = 1 << 20
THIN = 64
_sessions: dict[tuple[str, int], Any] = {}
_lock = threading.Lock()

# the quantized products (`QuantizedRows`): the stored rows' codes are round(a / scale) in [-ROW_LEVELS, ROW_LEVELS],
# kept as code + OFFSET in uint8; the query's in [-QUERY_LEVELS, QUERY_LEVELS], so that no two byte products summed
# in 16 bits (as AVX2's and AVX-512's byte multiply-adds do before VNNI) can overflow: 255 * 63 * 2 < 2^15. The
# integer product is then exact on every instruction set, and so is every score read from it.
ROW_LEVELS = 127
QUERY_LEVELS = 63
OFFSET = 128
QUERY_ROWS = 32  # a wide query's rows multiplied at a time (`QuantizedRows.product`)
QUANTIZED = True  # the references' products are read through their codes (False: in float32, as before)
FLOAT, UINT8, INT8, INT32 = 1, 2, 3, 6  # ONNX's element types


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


def _matrix(name: str, rows: str, cols: str, elem: int = FLOAT) -> bytes:
    """ValueInfoProto of a (rows, cols) tensor of element type `elem` with free dimensions."""
    dims = _field(1, _field(2, rows.encode())) + _field(1, _field(2, cols.encode()))
    tensor = _field(1, elem) + _field(2, dims)  # elem_type, shape
    return _field(1, name.encode()) + _field(2, _field(1, tensor))


def matmul_graph(op: str = "MatMul", types: tuple[int, int, int] = (FLOAT, FLOAT, FLOAT)) -> bytes:
    """The serialized ModelProto of ``y = a @ b`` (IR version 8, opset 17) with free dimensions: float32
    (MatMul), or `types` (a, b, y) with MatMulInteger (uint8 by int8 into int32)."""
    node = _field(1, b"a") + _field(1, b"b") + _field(2, b"y") + _field(4, op.encode())
    graph = (_field(1, node) + _field(2, b"product") + _field(11, _matrix("a", "n", "d", types[0]))
             + _field(11, _matrix("b", "d", "m", types[1])) + _field(12, _matrix("y", "n", "m", types[2])))
    opset = _field(1, b"") + _field(2, 17)
    return _field(1, 8) + _field(7, graph) + _field(8, opset)


GRAPHS = {"float": ("MatMul", (FLOAT, FLOAT, FLOAT)), "integer": ("MatMulInteger", (UINT8, INT8, INT32))}


def _session(kind: str = "float") -> Any:
    """The process's session of a product of `kind` (GRAPHS) on the threads of its products (model/onnx.py
    `numeric_threads`: in the service, each running request's share of the cores, as NumPy's BLAS)."""
    from fragsearch.model.onnx import numeric_threads, session

    threads = numeric_threads()
    with _lock:
        if (kind, threads) not in _sessions:
            _sessions[kind, threads] = session(matmul_graph(*GRAPHS[kind]), threads=threads)
        return _sessions[kind, threads]


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


def _diagonal(b: np.ndarray, parts: list[slice]) -> np.ndarray:
    """(B m, d): b's (m, d) slices of d laid block-diagonally, slice k in rows k m .. (k + 1) m."""
    m = b.shape[0]
    diagonal = np.zeros((len(parts) * m, b.shape[1]), np.float32)
    for k, part in enumerate(parts):
        diagonal[k * m : (k + 1) * m, part] = b[:, part]
    return diagonal


def block_products(a: np.ndarray | QuantizedRows, b: np.ndarray, parts: list[slice]) -> np.ndarray:
    """(n, B, m): each slice's ``a[:, part] @ b[:, part].T`` for a: (n, d) (or its `QuantizedRows`), b: (m, d)
    and the B slices of d `parts`, in one pass over `a` (a product with b's slices laid block-diagonally: each of
    a's rows is read once)."""
    diagonal = _diagonal(b, parts)
    out = a.product(diagonal) if isinstance(a, QuantizedRows) else product(a, diagonal)
    return np.asarray(out).reshape(a.shape[0], len(parts), b.shape[0])


@dataclass(frozen=True)
class QuantizedRows:
    """A fixed tall matrix (n, d) kept as 8-bit codes, one scale per row (`of`), read by `product`: a quarter
    of the float32 rows' bytes, multiplied in integers by ONNX Runtime's MatMulInteger (VNNI, AMX or AVX2 byte
    multiply-adds, exact on each). A score read from it differs from the float32 product's by the codes'
    rounding: at most each row's largest entry / 254 per coordinate (the query's own, coded in two parts by
    `product`, is 252 times finer than its step)."""

    codes: np.ndarray  # (n, d) uint8: round(a / scale) + OFFSET
    scale: np.ndarray  # (n, 1) float32

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @classmethod
    def of(cls, a: np.ndarray) -> QuantizedRows:
        a = np.asarray(a, np.float32).reshape(-1, a.shape[-1])
        top = np.abs(a).max(axis=1, keepdims=True)
        scale = np.where(top > 0, top / ROW_LEVELS, 1.0).astype(np.float32)
        codes = (np.rint(a / scale) + OFFSET).astype(np.uint8)
        return cls(np.ascontiguousarray(codes), scale)

    def dequantized(self) -> np.ndarray:
        """(n, d) the float32 rows the codes stand for."""
        return (self.codes.astype(np.float32) - OFFSET) * self.scale

    def product(self, b: np.ndarray) -> np.ndarray:
        """(n, m) float32: ``a @ b.T`` of the rows the codes stand for and b (m, d). b is coded per row in two
        parts, its codes and their remainder's, b ~ scale (q + r / (2 QUERY_LEVELS)), multiplied in one product:
        within 1/252 of a code's step of b, so the rows' codes are the difference that counts (a query's own
        rounding would move every score of it alike; the rows' differ row by row and average out in a sum).
        A wide b goes `QUERY_ROWS` rows at a time (thin products: the integer kernels' ground, and each step's
        arrays stay in the cache); every column is the same arithmetic however many b has."""
        b = np.asarray(b, np.float32)
        out = np.empty((self.codes.shape[0], b.shape[0]), np.float32)
        for start in range(0, b.shape[0], QUERY_ROWS):
            part = b[start : start + QUERY_ROWS]
            out[:, start : start + len(part)] = self._thin(part)
        return out

    def _thin(self, b: np.ndarray) -> np.ndarray:
        m = b.shape[0]
        top = np.abs(b).max(axis=1, keepdims=True)
        b_scale = np.where(top > 0, top / QUERY_LEVELS, 1.0).astype(np.float32)
        whole = np.rint(b / b_scale)
        q = np.empty((b.shape[1], 2 * m), np.int8)  # (d, 2 m): the codes, then the remainders', by column
        q[:, :m] = whole.T
        q[:, m:] = np.rint((b / b_scale - whole) * (2 * QUERY_LEVELS)).T
        y = np.asarray(_session("integer").run(None, {"a": self.codes, "b": q})[0])  # (n, 2 m) int32
        y -= OFFSET * q.sum(axis=0, dtype=np.int32)[None, :]  # the codes' offset, in integers
        # |y| <= d * 127 * 63 per part: exact in float32 for d < 2,097; each step one pass, in float32
        out = np.multiply(y[:, m:], np.float32(1.0 / (2 * QUERY_LEVELS)), dtype=np.float32)
        np.add(y[:, :m], out, out=out, dtype=np.float32)
        out *= self.scale
        out *= b_scale.T
        return out


def codable(a: Array) -> bool:
    """Whether a fixed tall matrix `a` ((..., d) rows) has codes (`QuantizedRows`): a float32 NumPy array large
    enough for its products to go through ONNX Runtime."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim >= 2 and a.size >= LARGE // THIN


def quantizes(a: Array) -> bool:
    """Whether `a` is read through its codes: `codable`, while `QUANTIZED` holds."""
    return QUANTIZED and codable(a)
