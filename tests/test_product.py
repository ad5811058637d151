"""The runtime's large products (model/product.py): the MatMul graph written by hand, the same numbers as NumPy's
``@``, the thin scans only, and the process's product threads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.model import product as products
from fragsearch.model.product import LARGE, THIN, block_products, is_large, matmul_graph, product
from fragsearch.model.score import block_dots, block_slices, skl

ROOT = Path(__file__).resolve().parent.parent


def _arrays(n: int, d: int, m: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)


def test_the_graph_is_one_matmul_with_free_dimensions() -> None:
    onnx = pytest.importorskip("onnx")
    model = onnx.load_from_string(matmul_graph())
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    assert model.opset_import[0].version == 17
    dims = [[d.dim_param for d in v.type.tensor_type.shape.dim] for v in (*model.graph.input, *model.graph.output)]
    assert dims == [["n", "d"], ["d", "m"], ["n", "m"]]


def test_a_scan_goes_through_onnx_runtime_with_numpys_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _arrays(4000, 512, 10)
    assert a.shape[0] * a.shape[1] * b.shape[0] >= LARGE and is_large(a, b)
    runs: list[tuple[int, ...]] = []
    session = products._session()

    class Counted:
        def run(self, names: object, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            runs.append(feed["a"].shape)
            return session.run(names, feed)

    monkeypatch.setattr(products, "_session", lambda: Counted())
    got = product(a, b)
    assert runs == [(4000, 512)]
    assert got.shape == (4000, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, a @ b.T, rtol=1e-5, atol=1e-4)


def test_what_is_not_a_thin_float32_scan_stays_with_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("ONNX Runtime was asked")

    monkeypatch.setattr(products, "_session", refuse)
    a, b = _arrays(4000, 512, 10)
    small_a, small_b = _arrays(20, 512, 10)
    wide_a, wide_b = _arrays(4000, 512, THIN + 1)
    cases = [
        (small_a, small_b),  # few multiply-adds
        (wide_a, wide_b),  # a wide product: BLAS's ground
        (a.astype(np.float64), b.astype(np.float64)),
        (np.asfortranarray(a), b),  # ONNX Runtime would need a copy of the large operand
        (a[:, :256], b[:, :256]),  # a slice of the columns: not contiguous
    ]
    for x, y in cases:
        assert not is_large(x, y)
        assert np.array_equal(product(x, y), x @ y.T)
    t = torch.from_numpy(a)
    assert torch.equal(product(t, torch.from_numpy(b)), t @ torch.from_numpy(b).T)
    assert not is_large(a, b, blocks=THIN // 10 + 1)  # as a block-diagonal product, too wide


def test_block_products_are_each_slices_product() -> None:
    a, b = _arrays(3000, 512, 12, seed=1)
    parts = block_slices(512, 2)
    each = block_products(a, b, parts)
    assert each.shape == (3000, 2, 12)
    for k, part in enumerate(parts):
        np.testing.assert_allclose(each[:, k], a[:, part] @ b[:, part].T, rtol=1e-5, atol=1e-4)


def test_a_two_block_scan_scores_as_the_small_path_does() -> None:
    """The search's S_kl of a merged model over a collection large enough for the scan's product equals the
    one-block-at-a-time arithmetic of the formula."""
    rng = np.random.default_rng(2)
    img = rng.standard_normal((300, 20, 64)).astype(np.float32) / 8
    sent = rng.standard_normal((1, 9, 64)).astype(np.float32) / 8
    v, s = img.reshape(-1, 64), sent[0]
    assert is_large(v, s, 2)
    dots, pos = block_dots(v, s, 2)
    halves = [v[:, p] @ s[:, p].T for p in block_slices(64, 2)]
    np.testing.assert_allclose(dots, halves[0] + halves[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pos, np.maximum(halves[0], 0) + np.maximum(halves[1], 0), rtol=1e-5, atol=1e-5)
    got = skl(img, np.ones((300, 20), np.float32), sent, np.ones((1, 9), np.float32), blocks=2)
    want = (np.maximum(halves[0], 0) + np.maximum(halves[1], 0)).reshape(300, 20 * 9).sum(1) / (20 * (9 + 5))
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)


def test_the_products_run_on_the_numeric_threads() -> None:
    """In a process of its own (the limit is the process's): the service's per-request share of the cores is the
    product session's too, as it is NumPy's BLAS."""
    code = ("import json; from fragsearch.model.onnx import limit_numeric_threads; "
            "from fragsearch.model.product import _session; limits = limit_numeric_threads(1); "
            "print(json.dumps([limits, _session().get_session_options().intra_op_num_threads]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=120)
    limits, threads = json.loads(out.stdout.strip().splitlines()[-1])
    assert limits["products"] == 1 and threads == 1


def test_the_integer_graph_is_one_matmulinteger_of_bytes() -> None:
    onnx = pytest.importorskip("onnx")
    model = onnx.load_from_string(matmul_graph(*products.GRAPHS["integer"]))
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["MatMulInteger"]
    kinds = [v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)]
    assert kinds == [onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.INT32]


def test_the_integer_product_is_exact_at_the_codes_extremes() -> None:
    """The largest codes against the largest query codes, of either sign: the product a CPU that adds byte
    products pairwise in 16 bits (AVX2, AVX-512 without VNNI) would saturate if the query's codes went past
    QUERY_LEVELS. It must equal the exact integer product on every instruction set."""
    rng = np.random.default_rng(3)
    codes = np.full((64, 512), 255, np.uint8)
    codes[1::2] = rng.integers(0, 256, (32, 512), dtype=np.uint8)
    q = np.empty((512, 4), np.int8)
    q[:, 0], q[:, 1] = products.QUERY_LEVELS, -products.QUERY_LEVELS
    q[:, 2:] = rng.integers(-products.QUERY_LEVELS, products.QUERY_LEVELS + 1, (512, 2))
    got = products._session("integer").run(None, {"a": codes, "b": q})[0]
    np.testing.assert_array_equal(got, codes.astype(np.int64) @ q.astype(np.int64))
    assert 255 * products.QUERY_LEVELS * 2 < 2**15


def test_quantized_rows_score_as_their_float_rows_within_their_rounding() -> None:
    a, b = _arrays(3000, 512, 12, seed=4)
    rows = products.QuantizedRows.of(a)
    assert rows.codes.dtype == np.uint8 and rows.shape == a.shape
    step = np.abs(a).max(axis=1, keepdims=True) / products.ROW_LEVELS
    assert np.all(np.abs(rows.dequantized() - a) <= step / 2 + 1e-6)  # each coordinate within half a step
    got = rows.product(b)
    coded = rows.dequantized().astype(np.float64) @ b.T.astype(np.float64)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    # the query's two-part codes: nearly the coded rows' own product; the rows' codes: within 1 % of the scores
    assert np.abs(got - coded).max() < 2e-3 * np.abs(exact).max()
    assert np.sqrt(np.mean((got - exact) ** 2)) < 0.01 * np.sqrt(np.mean(exact**2))


def test_a_wide_query_scores_each_row_as_alone() -> None:
    """A query's row scores the same whatever rows it is multiplied with (a sentence calibrated alone or in a
    batch of thousands: the same vector)."""
    a, b = _arrays(2000, 256, 2 * products.QUERY_ROWS + 5, seed=5)
    rows = products.QuantizedRows.of(a)
    wide = rows.product(b)
    for j in (0, products.QUERY_ROWS - 1, products.QUERY_ROWS, len(b) - 1):
        np.testing.assert_array_equal(wide[:, j], rows.product(b[j : j + 1])[:, 0])


def test_two_block_coded_scores_are_the_blocks_thresholded_sums() -> None:
    a, b = _arrays(4000, 64, 9, seed=6)
    rows = products.QuantizedRows.of(a)
    dots, pos = block_dots(a, b, 2, rows)
    plain = rows.dequantized()
    halves = [plain[:, p] @ b[:, p].T for p in block_slices(64, 2)]
    np.testing.assert_allclose(dots, halves[0] + halves[1], atol=0.02)
    np.testing.assert_allclose(pos, np.maximum(halves[0], 0) + np.maximum(halves[1], 0), atol=0.02)
    with pytest.raises(ValueError, match="codes of"):
        block_dots(a[:10], b, 2, rows)


def test_only_large_float32_arrays_are_read_through_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = _arrays(1000, 512, 1)
    assert products.quantizes(a)
    assert not products.quantizes(a[:2]) and not products.quantizes(a.astype(np.float64))
    assert not products.quantizes(torch.from_numpy(a))
    monkeypatch.setattr(products, "QUANTIZED", False)
    assert not products.quantizes(a)
