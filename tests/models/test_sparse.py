"""Sparse input features (dorylus.models.sparse.SparseRows) against dense numpy: products,
slices, row normalization, the layout choice, and layer 0's dropout through ``ops.prepare``.

Tolerances: a CSR product sums each output's terms in another order than BLAS does, in float32;
with at most a few hundred terms of magnitude <= ~3 the difference stays below 1e-5 absolute
(float32's epsilon is 1.2e-7 per addition), so products are compared at rtol 1e-5, atol 1e-5.
Everything that involves no sum (slices, dropout, row normalization) must be bit-identical.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dorylus.masks import keep_mask
from dorylus.models import ops, sparse
from dorylus.models.sparse import AUTO_MAX_DENSITY, SparseRows, in_layout, to_dense, use_sparse
from dorylus.normalize import row_normalize

SEED, EPOCH, LAYER = 3, 7, 0


def sparse_matrix(n: int = 120, width: int = 37, density: float = 0.08, seed: int = 0) -> np.ndarray:
    """A dense float32 matrix with about ``density`` non-zeros, an all-zero first row, an all-zero
    run in the middle and all-zero last rows (the edge cases of CSR products)."""
    rng = np.random.default_rng(seed)
    x = np.where(rng.random((n, width)) < density, rng.standard_normal((n, width)), 0.0).astype(np.float32)
    x[0] = 0.0
    x[n // 2:n // 2 + 3] = 0.0
    x[-2:] = 0.0
    x[5, :] = rng.standard_normal(width)  # one full row
    return x


@pytest.fixture(params=[sparse.CHUNK_NNZ, 7], ids=["one-block", "many-blocks"])
def chunk(request, monkeypatch):
    """Run with the default block size and with blocks of 7 entries (rows and columns split
    across blocks; a block boundary inside a row's or a column's run)."""
    monkeypatch.setattr(sparse, "CHUNK_NNZ", request.param)
    return request.param


def test_round_trip_and_arrays():
    x = sparse_matrix()
    s = SparseRows.from_dense(x)
    assert s.shape == x.shape and s.nnz == np.count_nonzero(x) and s.density == pytest.approx(np.mean(x != 0))
    assert s.data.dtype == np.float32 and s.indices.dtype == np.int32 and s.indptr.dtype == np.int64
    np.testing.assert_array_equal(s.toarray(), x)
    np.testing.assert_array_equal(np.diff(s.indptr), np.count_nonzero(x, axis=1))
    np.testing.assert_array_equal(s.entry_rows(), np.nonzero(x)[0])


@pytest.fixture(params=["sparse-route", "dense-route"])
def route(request, monkeypatch):
    """Products through gathered terms, or through dense row blocks of 5 rows (and BLAS)."""
    monkeypatch.setattr(sparse, "DENSE_ROUTE", float("inf") if request.param == "sparse-route" else 0.0)
    monkeypatch.setattr(sparse, "DENSE_BLOCK_ELEMENTS", 37 * 5)
    return request.param


@pytest.mark.parametrize("k", [1, 16])
def test_products_equal_dense(chunk, route, k):
    x = sparse_matrix()
    s = SparseRows.from_dense(x)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((x.shape[1], k)).astype(np.float32)
    g = rng.standard_normal((x.shape[0], k)).astype(np.float32)
    got, got_t = s @ w, s.T @ g
    assert got.dtype == got_t.dtype == np.float32
    assert got.shape == (x.shape[0], k) and got_t.shape == (x.shape[1], k)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_t, x.T @ g, rtol=1e-5, atol=1e-5)
    assert not got[0].any() and not got[-2:].any()  # empty rows are zeros, not a neighbour's sum


@pytest.mark.parametrize("a, b", [(0, 120), (1, 60), (59, 64), (118, 120), (30, 30)])
def test_slices_are_views_and_multiply_like_dense(chunk, route, a, b):
    x = sparse_matrix()
    s = SparseRows.from_dense(x)
    part = s[a:b]
    assert part.shape == (b - a, x.shape[1]) and part.indptr[0] == 0
    np.testing.assert_array_equal(part.toarray(), x[a:b])
    if part.nnz:
        assert np.shares_memory(part.data, s.data) and np.shares_memory(part.indices, s.indices)
    w = np.random.default_rng(2).standard_normal((x.shape[1], 4)).astype(np.float32)
    g = np.random.default_rng(3).standard_normal((b - a, 4)).astype(np.float32)
    np.testing.assert_allclose(part @ w, x[a:b] @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(part.T @ g, x[a:b].T @ g, rtol=1e-5, atol=1e-5)
    assert s[a:b] is part  # a graph server's intervals: the cached orders are computed once


def test_with_data_shares_the_structure():
    x = sparse_matrix()
    s = SparseRows.from_dense(x)
    doubled = s.with_data(s.data * np.float32(2))
    assert doubled.indices is s.indices and doubled.indptr is s.indptr
    np.testing.assert_array_equal(doubled.toarray(), 2 * x)
    g = np.ones((x.shape[0], 2), np.float32)
    np.testing.assert_allclose(doubled.T @ g, 2 * (x.T @ g), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        s.with_data(s.data.astype(np.float64))


def test_row_normalization_equals_dense_bitwise():
    rng = np.random.default_rng(4)
    counts = np.where(rng.random((200, 50)) < 0.05, rng.integers(1, 4, (200, 50)), 0).astype(np.float32)
    weights = np.abs(sparse_matrix(200, 50, 0.05, seed=5))
    for x in (counts, weights):  # bag-of-words counts (exact sums) and arbitrary positive values
        got = row_normalize(SparseRows.from_dense(x))
        assert isinstance(got, SparseRows)
        np.testing.assert_array_equal(got.toarray(), row_normalize(x))


def test_layout_choice():
    x = sparse_matrix(density=0.05)
    assert np.mean(x != 0) < AUTO_MAX_DENSITY
    dense_x = np.random.default_rng(6).standard_normal((20, 10)).astype(np.float32)
    assert isinstance(in_layout(x, "auto"), SparseRows) and isinstance(in_layout(x, "on"), SparseRows)
    assert isinstance(in_layout(x, "off"), np.ndarray)
    assert isinstance(in_layout(dense_x, "auto"), np.ndarray)
    assert isinstance(in_layout(dense_x, "on"), SparseRows)
    s = SparseRows.from_dense(x)
    assert in_layout(s, "auto") is s
    np.testing.assert_array_equal(in_layout(s, "off"), x)
    np.testing.assert_array_equal(to_dense(s), x)
    assert use_sparse("auto", AUTO_MAX_DENSITY - 1e-9) and not use_sparse("auto", AUTO_MAX_DENSITY)
    with pytest.raises(ValueError, match="sparse_features must be one of auto, on, off"):
        use_sparse("sometimes", 0.0)


@pytest.mark.parametrize("build, message", [
    (lambda s: SparseRows(s.data.astype(np.float64), s.indices, s.indptr, s.shape), "data must be 1-D float32"),
    (lambda s: SparseRows(s.data, s.indices[:-1], s.indptr, s.shape), "indices must be int32 or int64"),
    (lambda s: SparseRows(s.data, s.indices.astype(np.int16), s.indptr, s.shape), "indices must be int32 or int64"),
    (lambda s: SparseRows(s.data, s.indices, s.indptr[:-1], s.shape), r"indptr must be int64 \[121\]"),
    (lambda s: SparseRows(s.data, s.indices, s.indptr - 1, s.shape), "indptr must rise from 0"),
    (lambda s: SparseRows(s.data, s.indices, s.indptr[::-1].copy(), s.shape), "indptr must rise from 0"),
    (lambda s: SparseRows(s.data, s.indices, s.indptr, (120, 10)), r"column indices must be in \[0, 10\)"),
    (lambda s: SparseRows(s.data, s.indices[::-1].copy(), s.indptr, s.shape), "ascend strictly within each row"),
    (lambda s: s[::2], "row slices"),
    (lambda s: s[3], "row slices"),
    (lambda s: s @ np.ones((36, 2), np.float32), r"w must be \[37, k\]"),
    (lambda s: s.T @ np.ones((119, 2), np.float32), r"grad must be \[120, k\]"),
])
def test_malformed_input_is_refused(build, message):
    s = SparseRows.from_dense(sparse_matrix())
    with pytest.raises((ValueError, TypeError), match=message):
        build(s)


def test_numpy_never_densifies_it_silently():
    s = SparseRows.from_dense(sparse_matrix())
    with pytest.raises(TypeError):
        np.ones((2, 120), np.float32) @ s
    with pytest.raises(TypeError):
        np.add(s, 1)


# ----------------------------------------------------------------------------- layer 0 through ops


@pytest.mark.parametrize("p", [0.0, 0.5, 0.9])
def test_prepare_drops_the_non_zeros_as_the_dense_mask_does(p):
    x = sparse_matrix()
    ids = np.arange(x.shape[0]) * 3 + 1000  # global ids, not row numbers
    s = SparseRows.from_dense(x)
    got = ops.prepare(s, ids, (SEED, EPOCH, LAYER), p, None, True)
    assert isinstance(got, SparseRows) and got.indices is s.indices  # dropped entries stay, as zeros
    want = ops.prepare(x, ids, (SEED, EPOCH, LAYER), p, None, True)
    np.testing.assert_array_equal(got.toarray(), want)
    if p > 0:
        keep = keep_mask(SEED, EPOCH, LAYER, ids, x.shape[1], p)
        assert np.array_equal(got.data != 0, keep[s.entry_rows(), s.indices])
        assert 0 < np.mean(got.data != 0) < 1
    assert ops.prepare(s, ids, (SEED, EPOCH, LAYER), p, None, False) is s  # evaluation: no dropout


def test_prepare_backward_with_sparse_src_equals_dense():
    x = sparse_matrix()
    ids = np.arange(x.shape[0])
    grad = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
    got = ops.prepare_backward(grad, SparseRows.from_dense(x), ids, (SEED, EPOCH, LAYER), 0.5, None)
    np.testing.assert_array_equal(got, ops.prepare_backward(grad, x, ids, (SEED, EPOCH, LAYER), 0.5, None))


def test_sparse_rows_have_no_activation():
    s = SparseRows.from_dense(sparse_matrix())
    ids = np.arange(s.shape[0])
    with pytest.raises(ValueError, match="only layer 0's input features are sparse"):
        ops.prepare(s, ids, (SEED, EPOCH, 1), 0.5, "relu", True)
    with pytest.raises(ValueError, match="only layer 0's input features are sparse"):
        ops.prepare_backward(np.zeros(s.shape, np.float32), s, ids, (SEED, EPOCH, 1), 0.5, "elu")
    with pytest.raises(ValueError, match="one id per row"):
        ops.prepare(s, ids[1:], (SEED, EPOCH, 0), 0.5, None, True)


def test_module_imports_without_torch_or_scipy():
    """It ships in the Lambda bundle: numpy only."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['scipy'] = None\n"
            "import numpy as np\n"
            "from dorylus.models.sparse import SparseRows\n"
            "s = SparseRows.from_dense(np.eye(3, dtype=np.float32))\n"
            "assert (s @ np.ones((3, 2), np.float32)).shape == (3, 2)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
