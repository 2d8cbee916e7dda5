"""dorylus.models.kernels against float64 oracles (numpy / scipy), never bit equality with a library."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch

from dorylus.models import kernels


@pytest.fixture(autouse=True, params=["numba", "torch"])
def kernel(request, monkeypatch):
    """Every test on both implementations: numba (large products) and torch/numpy (small ones,
    which never pay numba's start-up); ``auto`` picks by size."""
    monkeypatch.setenv("DORYLUS_GATHER_KERNEL", request.param)
    return request.param


def random_csr(rows: int, cols: int, nnz: int, rng: np.random.Generator, *, empty_rows: float = 0.2,
               self_loops: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A CSR structure with some empty rows, duplicate-free and sorted within each row."""
    keys = np.unique(rng.integers(0, rows * cols, nnz)) if rows and cols else np.empty(0, np.int64)
    r, c = keys // max(cols, 1), keys % max(cols, 1)
    keep = rng.random(rows) >= empty_rows
    sel = keep[r]
    r, c = r[sel], c[sel]
    if self_loops:
        d = np.arange(min(rows, cols))
        both = np.unique(np.concatenate([r * cols + c, d * cols + d]))
        r, c = both // cols, both % cols
    indptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=rows), out=indptr[1:])
    return indptr, c.astype(np.int32)


def oracle(indptr, indices, x, values=None, row_scale=None, col_scale=None) -> np.ndarray:
    rows, cols = len(indptr) - 1, x.shape[0]
    nnz = int(indptr[-1])
    v = np.ones(nnz) if values is None else np.asarray(values[:nnz], np.float64)
    a = scipy.sparse.csr_matrix((v, np.asarray(indices[:nnz], np.int64), np.asarray(indptr, np.int64)),
                                shape=(rows, cols))
    if col_scale is not None:
        a = a @ scipy.sparse.diags(np.asarray(col_scale, np.float64))
    if row_scale is not None:
        a = scipy.sparse.diags(np.asarray(row_scale, np.float64)) @ a
    return np.asarray(a @ x.astype(np.float64)).reshape(rows, x.shape[1])


def abs_oracle(indptr, indices, x, values, row_scale, col_scale) -> np.ndarray:
    return oracle(indptr, indices, np.abs(x), None if values is None else np.abs(values),
                  None if row_scale is None else np.abs(row_scale), None if col_scale is None else np.abs(col_scale))


def check(indptr, indices, x, values=None, row_scale=None, col_scale=None, **kw):
    got = kernels.gather(indptr, indices, x, values=values, row_scale=row_scale, col_scale=col_scale, **kw)
    want = oracle(indptr, indices, x, values, row_scale, col_scale)
    assert got.dtype == np.float32 and got.shape == want.shape
    lengths = np.diff(np.asarray(indptr, np.int64))[:, None]
    # float32 rounding of a sequential sum of L terms: at most ~ (L + 3) eps sum |term|, eps = 6e-8;
    # rtol 1e-5 per term-length unit leaves a wide margin and still catches any wrong term.
    bound = 1e-5 * (lengths + 3) / 8 * abs_oracle(indptr, indices, x, values, row_scale, col_scale) + 1e-37
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"max error {err.max():.3e}, bound there {bound.flat[np.argmax(err - bound)]:.3e}"
    return got


@pytest.mark.parametrize("shape", [(0, 16), (1, 1), (7, 3), (1000, 16), (300_000, 16)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_aligned_zeros(shape, dtype):
    """Zeros of the shape and type, C-contiguous, writable, starting on a cache line (numpy's own
    large arrays usually start 16 bytes past one)."""
    a = kernels.aligned_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    if a.size == 0:
        return
    assert a.ctypes.data % kernels.CACHE_LINE == 0
    a[...] = 1  # the whole view is backed (it owns no memory of its own, its base does)
    assert a.sum() == a.size
    assert kernels.aligned_zeros(shape, dtype, align=4096).ctypes.data % 4096 == 0


def test_hand_built_graph():
    # rows: 0 -> {1, 2}, 1 -> {} (empty), 2 -> {0, 2} (a self loop), 3 -> {1, 3}
    indptr = np.array([0, 2, 2, 4, 6], np.int64)
    indices = np.array([1, 2, 0, 2, 1, 3], np.int32)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    got = kernels.gather(indptr, indices, x)
    np.testing.assert_array_equal(got, [[6, 8], [0, 0], [4, 6], [8, 10]])
    values = np.array([1, 2, 3, 4, 5, 6], np.float32)
    row_scale = np.array([1, 9, 0.5, 2], np.float32)
    col_scale = np.array([1, 10, 100, 1000], np.float32)
    got = kernels.gather(indptr, indices, x, values=values, row_scale=row_scale, col_scale=col_scale)
    want = oracle(indptr, indices, x, values, row_scale, col_scale)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[1].tolist() == [0, 0]


@pytest.mark.parametrize("width", [1, 3, 16, 17, 40, 128])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("indptr_type", [np.int32, np.int64])
def test_random_graphs(width, weighted, indptr_type):
    rng = np.random.default_rng(width * 7 + weighted)
    indptr, indices = random_csr(300, 250, 3000, rng, self_loops=True)
    x = rng.standard_normal((250, width), dtype=np.float32)
    kw = {}
    if weighted:
        kw = dict(values=rng.standard_normal(len(indices), dtype=np.float32),
                  row_scale=rng.random(300, dtype=np.float32) + 0.1,
                  col_scale=rng.random(250, dtype=np.float32) + 0.1)
    check(indptr.astype(indptr_type), indices, x, **kw)


@pytest.fixture
def live_masks(monkeypatch) -> list[np.ndarray]:
    """The ``live`` mask of every call of the zero-row-skipping kernel, in order."""
    masks: list[np.ndarray] = []
    live_kernel = kernels._kernels().gather_live_kernel
    monkeypatch.setattr(kernels._kernels(), "gather_live_kernel", lambda *a: masks.append(a[3]) or live_kernel(*a))
    return masks


@pytest.mark.parametrize("width", [1, 16, 17, 40])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("col_limit", [None, 180])
def test_mostly_zero_operands_skip_their_zero_rows_for_the_same_bits(monkeypatch, kernel, live_masks, width, threads,
                                                                    col_limit):
    """An operand whose rows are mostly all-zero (a loss gradient: non-zero on train rows only) is
    gathered over its live rows alone; the result is bit for bit the dense kernel's, signs of
    zero included, and within rounding of float64. Rows longer than a segment, empty rows, a
    -0.0 row, negative weights and scales are all in the graph."""
    if kernel != "numba":
        pytest.skip("the numba kernel skips zero rows; torch runs small products whole")
    rng = np.random.default_rng(width * 31 + threads)
    indptr, indices = random_csr(300, 250, 9000, rng, self_loops=True)
    long_row = np.sort(rng.choice(250, 200, replace=False)).astype(np.int32)  # > SEGMENT entries
    indptr = np.concatenate([indptr, [indptr[-1] + len(long_row)]])
    indices = np.concatenate([indices, long_row])
    x = rng.standard_normal((250, width), dtype=np.float32)
    x[rng.random(250) >= 0.1] = 0.0
    x[np.flatnonzero(~x.any(axis=1))[:5]] = -0.0
    kw = dict(values=rng.standard_normal(len(indices), dtype=np.float32),
              row_scale=rng.standard_normal(len(indptr) - 1, dtype=np.float32),
              col_scale=rng.standard_normal(250, dtype=np.float32), col_limit=col_limit)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    skipped = kernels.gather(indptr, indices, x, **kw)
    assert len(live_masks) == 1 and live_masks[0].tolist() == x.any(axis=1).tolist()  # -0.0 rows are dead too
    monkeypatch.setattr(kernels, "SKIP_ZERO_ROWS", 1.0)  # never skip
    whole = kernels.gather(indptr, indices, x, **kw)
    assert len(live_masks) == 1
    np.testing.assert_array_equal(skipped, whole)
    assert np.array_equal(np.signbit(skipped), np.signbit(whole))
    if col_limit is None:
        check(indptr, indices, x, **{k: v for k, v in kw.items() if k != "col_limit"})


def test_dense_operands_and_nan_rows_are_gathered_whole(kernel, live_masks):
    """Operands that the sample finds mostly live take the dense kernel; a NaN row is live."""
    if kernel != "numba":
        pytest.skip("numba only")
    rng = np.random.default_rng(5)
    indptr, indices = random_csr(200, 200, 3000, rng)
    x = rng.standard_normal((200, 16), dtype=np.float32)
    x[::2] = 0.0
    check(indptr, indices, x)
    assert live_masks == []  # half the rows live: the dense kernel is as fast
    x[rng.random(200) >= 0.05] = 0.0
    x[7] = np.nan
    got = kernels.gather(indptr, indices, x)
    assert len(live_masks) == 1 and live_masks[0][7] == 1
    rows_reading_7 = np.repeat(np.arange(200), np.diff(indptr))[indices == 7]
    assert rows_reading_7.size and np.isnan(got[rows_reading_7]).all()


@pytest.mark.parametrize("which", ["values", "row_scale", "col_scale"])
def test_each_option_alone(which):
    rng = np.random.default_rng(3)
    indptr, indices = random_csr(120, 90, 900, rng)
    x = rng.standard_normal((90, 24), dtype=np.float32)
    arg = {"values": len(indices), "row_scale": 120, "col_scale": 90}[which]
    check(indptr, indices, x, **{which: rng.standard_normal(arg, dtype=np.float32)})


def test_long_rows_cross_segments():
    # rows longer than the kernel's segment (128 entries) keep summing in CSR order
    rng = np.random.default_rng(4)
    indptr = np.array([0, 1000, 1000, 1300], np.int64)
    indices = rng.integers(0, 500, 1300).astype(np.int32)  # duplicates within a row are allowed
    x = rng.standard_normal((500, 40), dtype=np.float32)
    check(indptr, indices, x, values=rng.standard_normal(1300, dtype=np.float32))
    check(indptr, indices, x[:, :5])


def test_a_hat_from_degrees():
    # A_hat = D^-1/2 (A + I) D^-1/2 as unweighted structure + two per-vertex scales
    rng = np.random.default_rng(5)
    indptr, indices = random_csr(200, 200, 1500, rng, self_loops=True)
    deg = np.diff(indptr).astype(np.float32)
    s = np.where(deg > 0, 1 / np.sqrt(np.maximum(deg, 1)), 0).astype(np.float32)
    x = rng.standard_normal((200, 16), dtype=np.float32)
    got = check(indptr, indices, x, row_scale=s, col_scale=s)
    weighted = check(indptr, indices, x, values=(s[np.repeat(np.arange(200), np.diff(indptr))] * s[indices]))
    np.testing.assert_allclose(got, weighted, rtol=1e-5, atol=1e-6)


def test_edge_cases():
    x = np.ones((4, 3), np.float32)
    assert kernels.gather(np.zeros(1, np.int64), np.empty(0, np.int32), x).shape == (0, 3)  # R = 0
    out = np.full((5, 3), 7, np.float32)
    got = kernels.gather(np.zeros(6, np.int32), np.empty(0, np.int32), x, out=out)  # nnz = 0
    assert got is out and not out.any()
    # empty x (C = 0) with no entries
    assert not kernels.gather(np.zeros(3, np.int64), np.empty(0, np.int32), np.empty((0, 2), np.float32)).any()
    # non-contiguous and float64 x, int64 indices, list inputs
    rng = np.random.default_rng(6)
    indptr, indices = random_csr(50, 40, 300, rng)
    big = rng.standard_normal((40, 64))
    xs = big[:, ::4]
    check(indptr, indices.astype(np.int64), xs)
    check(list(indptr), list(indices), np.asfortranarray(xs.astype(np.float32)))
    # out given: written in place, shape checked
    o = np.empty((50, 16), np.float32)
    assert kernels.gather(indptr, indices, xs, out=o) is o
    with pytest.raises(ValueError):
        kernels.gather(indptr, indices, xs, out=np.empty((50, 15), np.float32))
    with pytest.raises(ValueError):
        kernels.gather(indptr, indices, xs, row_scale=np.ones(49, np.float32))


def test_uses_torch_threads_and_is_thread_count_invariant():
    rng = np.random.default_rng(7)
    indptr, indices = random_csr(2000, 1500, 30000, rng)
    x = rng.standard_normal((1500, 20), dtype=np.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.gather(indptr, indices, x)
        torch.set_num_threads(max(2, before))
        many = kernels.gather(indptr, indices, x)
    finally:
        torch.set_num_threads(before)
    # a row is never split between threads: the same float32 sums in the same order
    np.testing.assert_array_equal(one, many)


def test_int64_indptr_and_a_longer_indices_array():
    # nnz >= 2^31 needs int64 indptr (not testable here at that size); int64 offsets are honoured,
    # and entries of indices past indptr[-1] (a slice of a bigger buffer) are never read
    indices = np.array([0, 1, 1, 0, 99, 99], np.int32)
    indptr = np.array([0, 2, 4], np.int64)
    x = np.array([[1, 2], [3, 4]], np.float32)
    np.testing.assert_array_equal(kernels.gather(indptr, indices, x), [[4, 6], [4, 6]])
    np.testing.assert_array_equal(kernels.gather(indptr.astype(np.int32), indices.astype(np.int64), x),
                                  [[4, 6], [4, 6]])


@pytest.mark.parametrize("indptr_type", [np.int32, np.int64])
def test_transpose_csr_is_the_transpose(indptr_type):
    rng = np.random.default_rng(8)
    indptr, indices = random_csr(130, 170, 2000, rng, self_loops=True)
    values = rng.standard_normal(len(indices), dtype=np.float32)
    indptr_t, indices_t, perm = kernels.transpose_csr(indptr.astype(indptr_type), indices, 170)
    assert indptr_t.dtype == np.int64 and indices_t.dtype == np.int32 and perm.dtype in (np.int32, np.int64)
    want = scipy.sparse.csr_matrix((values, indices, indptr), shape=(130, 170)).T.tocsr()
    want.sort_indices()
    np.testing.assert_array_equal(indptr_t, want.indptr)
    np.testing.assert_array_equal(indices_t, want.indices)
    np.testing.assert_array_equal(values[perm], want.data)  # exact: a permutation of the same floats
    assert np.array_equal(np.sort(perm), np.arange(len(indices)))
    # the transposed product with the original's scales
    g = rng.standard_normal((130, 9), dtype=np.float32)
    rs, cs = rng.random(130, dtype=np.float32), rng.random(170, dtype=np.float32)
    got = kernels.gather(indptr_t, indices_t, g, values=values[perm], row_scale=cs, col_scale=rs)
    a = scipy.sparse.diags(rs.astype(np.float64)) @ scipy.sparse.csr_matrix(
        (values.astype(np.float64), indices, indptr), shape=(130, 170)) @ scipy.sparse.diags(cs.astype(np.float64))
    np.testing.assert_allclose(got, a.T @ g.astype(np.float64), rtol=1e-4, atol=1e-5)


def test_transpose_csr_empty():
    indptr_t, indices_t, perm = kernels.transpose_csr(np.zeros(4, np.int64), np.empty(0, np.int32), 5)
    assert indptr_t.tolist() == [0] * 6 and indices_t.size == 0 and perm.size == 0
    with pytest.raises(ValueError):
        kernels.transpose_csr(np.array([0, 1]), np.array([5], np.int32), 3)


def skewed_part(rows: int, cols: int, rng: np.random.Generator, *,
                self_loops: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A graph server's block ``[rows, cols]``: owned rows over ``[owned; ghost]`` columns
    (``cols > rows``), empty rows (or self loops), columns no entry hits, and a few rows of high
    degree (150 entries and more: past the gather kernel's 128-entry segments)."""
    # the last 7 columns: never hit
    indptr, indices = random_csr(rows, cols - 7, rows * 6, rng, self_loops=self_loops)
    r = np.repeat(np.arange(rows), np.diff(indptr))
    hubs = rng.choice(rows, 3, replace=False)
    extra_r = np.repeat(hubs, 150)
    extra_c = np.concatenate([rng.choice(cols - 7, 150, replace=False) for _ in hubs])
    keys = np.unique(np.concatenate([r * cols + indices, extra_r * cols + extra_c]))  # duplicate-free
    r, c = keys // cols, keys % cols
    indptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=rows), out=indptr[1:])
    assert np.diff(indptr).max() >= 150 and (self_loops or (np.diff(indptr) == 0).any())
    return indptr, c.astype(np.int32)


def check_transpose(indptr, indices, g, num_cols, values=None, row_scale=None, col_scale=None):
    """``gather_transpose`` against the float64 ``A^T g`` (scipy), with :func:`check`'s bound per
    output row (its terms: the column's entries)."""
    got = kernels.gather_transpose(indptr, indices, g, num_cols, values=values, row_scale=row_scale,
                                   col_scale=col_scale)
    rows = len(indptr) - 1
    nnz = int(indptr[-1])

    def a_t(v, rs, cs):
        a = scipy.sparse.csr_matrix((np.ones(nnz) if v is None else np.asarray(v[:nnz], np.float64),
                                     np.asarray(indices[:nnz], np.int64), np.asarray(indptr, np.int64)),
                                    shape=(rows, num_cols))
        if rs is not None:
            a = scipy.sparse.diags(np.asarray(rs, np.float64)) @ a
        if cs is not None:
            a = a @ scipy.sparse.diags(np.asarray(cs, np.float64))
        return a.T.tocsr()

    want = a_t(values, row_scale, col_scale) @ g.astype(np.float64)
    magnitude = a_t(*(None if a is None else np.abs(a) for a in (values, row_scale, col_scale))) @ np.abs(g).astype(
        np.float64)
    lengths = np.bincount(np.asarray(indices[:nnz]), minlength=num_cols)[:, None]
    bound = 1e-5 * (lengths + 3) / 8 * magnitude + 1e-37
    assert got.dtype == np.float32 and got.shape == (num_cols, g.shape[1])
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"max error {err.max():.3e}, bound there {bound.flat[np.argmax(err - bound)]:.3e}"
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [1, 16, 17, 128])
@pytest.mark.parametrize("weights", ["none", "gcn", "all"])
def test_gather_transpose_is_the_transpose_product(kernel, threads, width, weights):
    if kernel == "torch":
        pytest.skip("gather_transpose runs on numba only")
    rng = np.random.default_rng(width * 3 + threads + len(weights))
    rows, cols = 240, 330
    indptr, indices = skewed_part(rows, cols, rng)
    g = rng.standard_normal((rows, width), dtype=np.float32)
    kw = {}
    if weights == "gcn":  # A_hat: the structure and the two degree scales, as aggregate_transpose("gcn") passes
        kw = dict(row_scale=rng.random(rows, dtype=np.float32) + 0.1, col_scale=rng.random(cols, dtype=np.float32) + 0.1)
    elif weights == "all":  # per-entry values too (signed)
        kw = dict(values=rng.standard_normal(len(indices), dtype=np.float32),
                  row_scale=rng.standard_normal(rows, dtype=np.float32), col_scale=rng.standard_normal(cols, dtype=np.float32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = check_transpose(indptr, indices, g, cols, **kw)
    finally:
        torch.set_num_threads(before)
    assert not got[cols - 7:].any()  # columns no entry hits


def test_gather_transpose_sums_as_the_transposed_gather_on_any_thread_count(kernel):
    """numba: each output row sums its terms in increasing row order on 1 or 2 threads, the order
    of a gather over ``transpose_csr``'s CSR (rows ascending in each column): the same float32 sums."""
    if kernel == "torch":
        pytest.skip("gather_transpose runs on numba only")
    rng = np.random.default_rng(11)
    indptr, indices = skewed_part(500, 640, rng)
    g = rng.standard_normal((500, 20), dtype=np.float32)
    values = rng.standard_normal(len(indices), dtype=np.float32)
    rs, cs = rng.random(500, dtype=np.float32), rng.random(640, dtype=np.float32)
    indptr_t, indices_t, perm = kernels.transpose_csr(indptr, indices, 640)
    pulled = kernels.gather(indptr_t, indices_t, g, values=values[perm], row_scale=cs, col_scale=rs)
    before = torch.get_num_threads()
    try:
        pushed = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pushed.append(kernels.gather_transpose(indptr, indices, g, 640, values=values, row_scale=rs, col_scale=cs))
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(pushed[0], pushed[1])
    np.testing.assert_array_equal(pushed[0], pulled)


def test_gather_transpose_edge_cases(kernel):
    if kernel == "torch":
        pytest.skip("gather_transpose runs on numba only")
    g = np.ones((3, 2), np.float32)
    out = np.full((4, 2), 7, np.float32)
    got = kernels.gather_transpose(np.zeros(4, np.int64), np.empty(0, np.int32), g, 4, out=out)  # nnz = 0
    assert got is out and not out.any()
    assert kernels.gather_transpose(np.array([0, 1, 1, 2]), np.array([0, 0], np.int32), g, 0 + 1).tolist() == [[2, 2]]
    assert kernels.gather_transpose(np.zeros(1, np.int64), np.empty(0, np.int32), np.ones((0, 5)), 3).shape == (3, 5)
    with pytest.raises(ValueError, match="g must be"):
        kernels.gather_transpose(np.array([0, 1, 1, 2]), np.array([0, 0], np.int32), np.ones((2, 2)), 1)
    with pytest.raises(ValueError, match="col_scale"):
        kernels.gather_transpose(np.array([0, 1, 1, 2]), np.array([0, 0], np.int32), g, 1, col_scale=np.ones(2))
    with pytest.raises(ValueError, match="out must be"):
        kernels.gather_transpose(np.array([0, 1, 1, 2]), np.array([0, 0], np.int32), g, 1, out=np.empty((1, 3), np.float32))


@pytest.mark.parametrize("kind", ["gcn", "mean", "sum"])
def test_graph_server_backward(monkeypatch, kernel, kind):
    """``CsrGraph.aggregate_transpose`` of a part (``[owned; ghost]`` columns) equals its dense
    matrix's transpose product in float64; on numba it never builds ``S^T``'s pattern, on torch
    it gathers over that pattern (made once)."""
    from dorylus.models.graph import CsrGraph

    rng = np.random.default_rng(12)
    owned, local = 200, 260
    indptr, indices = skewed_part(owned, local, rng, self_loops=True)
    norm = (1 / np.sqrt(1 + rng.integers(0, 30, local))).astype(np.float32)
    graph = CsrGraph(indptr, indices, norm[:owned], norm, local, np.arange(owned), np.arange(local))
    if kernel == "numba":
        monkeypatch.setattr(kernels, "transpose_csr", lambda *a, **k: pytest.fail("the transpose was built"))
    dense = np.zeros((owned, local))
    rows = np.repeat(np.arange(owned), np.diff(indptr))
    if kind == "gcn":
        dense[rows, indices] = norm[rows].astype(np.float64) * norm[indices]
    elif kind == "mean":
        degree = np.diff(indptr) - 1  # the self loop is not a neighbour
        dense[rows, indices] = np.where(degree[rows] > 0, 1 / np.maximum(degree[rows], 1), 0)
        dense[np.arange(owned), np.arange(owned)] = 0
    else:
        dense[rows, indices] = 1
    for width in (1, 16, 128):
        g = rng.standard_normal((owned, width), dtype=np.float32)
        want = dense.T @ g.astype(np.float64)
        # the longest column has a few dozen terms; float32 rounding stays far below 1e-5 of the sum of |terms|
        tolerance = 1e-5 * (np.abs(dense.T) @ np.abs(g)).max() + 1e-30
        np.testing.assert_allclose(graph.aggregate_transpose(kind, g), want, rtol=0, atol=tolerance)
    assert (graph.memory()["transpose"] == 0) == (kernel == "numba")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [1, 16, 17])
def test_gather_col_limit_and_transpose_first_col_split_the_columns(kernel, threads, width):
    """``gather(col_limit=L)`` counts only the entries of columns < L (the rest may lie past
    ``x``); ``gather_transpose(first_col=L)`` writes only output rows >= L and leaves the others
    alone. Both against the float64 oracle of the matching column block."""
    rng = np.random.default_rng(31 + width)
    rows, cols = 90, 200
    indptr, indices = skewed_part(rows, cols, rng, self_loops=True)
    rs, cs = (rng.random(rows) + 0.5).astype(np.float32), (rng.random(cols) + 0.5).astype(np.float32)
    x = rng.standard_normal((rows, width), dtype=np.float32)  # only `rows` rows: columns >= rows are skipped
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = kernels.gather(indptr, indices, x, row_scale=rs, col_scale=cs[:rows], col_limit=rows)
        r = np.repeat(np.arange(rows), np.diff(indptr))
        keep = indices < rows
        block = scipy.sparse.csr_matrix((np.ones(keep.sum()), (r[keep], indices[keep])), shape=(rows, rows))
        want = oracle(block.indptr, block.indices, x, None, rs, cs[:rows])
        magnitude = oracle(block.indptr, block.indices, np.abs(x), None, rs, cs[:rows])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * magnitude.max() + 1e-30)

        g = rng.standard_normal((rows, width), dtype=np.float32)
        out = np.full((cols, width), 7.0, np.float32)
        pushed = kernels.gather_transpose(indptr, indices, g, cols, row_scale=rs, col_scale=cs, out=out, first_col=rows)
        full = check_transpose(indptr, indices, g, cols, row_scale=rs, col_scale=cs)
    finally:
        torch.set_num_threads(before)
    assert pushed is out and np.all(out[:rows] == 7.0)
    np.testing.assert_array_equal(pushed[rows:], full[rows:])  # the same terms in the same order
    with pytest.raises(ValueError, match="col_limit"):
        kernels.gather(indptr, indices, x, col_limit=rows + 1)
    with pytest.raises(ValueError, match="first_col"):
        kernels.gather_transpose(indptr, indices, g, cols, first_col=cols + 1)


def undirected_part(n: int, owned: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """Part 0 of an undirected graph on ``n`` vertices as the store writes it: the in-edges (and
    self loops) of vertices ``0 .. owned-1``, its ghosts (outside neighbours) numbered from
    ``owned`` on, each row ascending. Returns ``(indptr, indices, num_local)``."""
    a = scipy.sparse.random(n, n, density=8 / n, random_state=np.random.RandomState(rng.integers(1 << 31)))
    a = ((a + a.T + scipy.sparse.eye(n)) != 0).tocsr()
    part = a[:owned].tocoo()
    ghosts = np.unique(part.col[part.col >= owned])
    local = np.arange(n)
    local[ghosts] = owned + np.arange(ghosts.size)
    m = scipy.sparse.csr_matrix((np.ones(part.nnz), (part.row, local[part.col])), shape=(owned, owned + ghosts.size))
    m.sort_indices()
    return m.indptr.astype(np.int64), m.indices.astype(np.int32), owned + ghosts.size


@pytest.mark.parametrize("kind", ["gcn", "mean", "sum"])
def test_undirected_part_backward_pulls_its_owned_block(monkeypatch, kernel, kind):
    """A part of an undirected graph (``owned_symmetric``) computes ``M^T g`` as a pull over its
    own rows for the owned columns and a push for the ghosts: equal to the plain push term for
    term, and to the float64 oracle; no transpose is built on numba."""
    from dorylus.models.graph import CsrGraph

    rng = np.random.default_rng(5)
    indptr, indices, local = undirected_part(400, 150, rng)
    norm = (1 / np.sqrt(1 + rng.integers(0, 30, local))).astype(np.float32)
    ids = np.arange(local)
    split = CsrGraph(indptr, indices, norm[:150], norm, local, ids[:150], ids, owned_symmetric=True)
    plain = CsrGraph(indptr, indices, norm[:150], norm, local, ids[:150], ids)
    if kernel == "numba":
        monkeypatch.setattr(kernels, "transpose_csr", lambda *a, **k: pytest.fail("the transpose was built"))
    for width in (1, 16, 33):
        g = rng.standard_normal((150, width), dtype=np.float32)
        got = split.aggregate_transpose(kind, g)
        np.testing.assert_array_equal(got, plain.aggregate_transpose(kind, g))
        dense = np.zeros((150, local))
        rows = np.repeat(np.arange(150), np.diff(indptr))
        scale = {"gcn": norm[rows].astype(np.float64) * norm[indices], "sum": np.ones(len(rows)),
                 "mean": np.where(rows == indices, 0, 1 / np.maximum(np.diff(indptr)[rows] - 1, 1))}[kind]
        dense[rows, indices] = scale
        want = dense.T @ g.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * (np.abs(dense.T) @ np.abs(g)).max() + 1e-30)
    assert split.memory()["transpose"] == 0 or kernel == "torch"


def banded(n: int, half_width: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric graph with edges only between |i - j| <= half_width (and not all of them)."""
    i = np.repeat(np.arange(n), 2 * half_width + 1)
    j = i + np.tile(np.arange(-half_width, half_width + 1), n)
    ok = (j >= 0) & (j < n) & (i < j) & (rng.random(i.size) < 0.6)
    i, j = i[ok], j[ok]
    src, dst = np.concatenate([i, j]), np.concatenate([j, i])
    m = scipy.sparse.csr_matrix((np.ones(src.size), (src, dst)), shape=(n, n))
    m.sort_indices()
    return m.indptr.astype(np.int64), m.indices.astype(np.int32)


def relabel(indptr, indices, perm):
    """The graph with vertex perm[i] renamed i."""
    n = len(indptr) - 1
    new = np.empty(n, np.int64)
    new[perm] = np.arange(n)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    m = scipy.sparse.csr_matrix((np.ones(len(indices)), (new[rows], new[indices])), shape=(n, n))
    m.sort_indices()
    return m.indptr.astype(np.int64), m.indices.astype(np.int32)


def bandwidth(indptr, indices):
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    d = np.abs(rows - indices)
    return int(d.max()), float(d.mean())


def test_locality_order_recovers_a_shuffled_band():
    rng = np.random.default_rng(9)
    indptr, indices = banded(3000, 5, rng)
    shuffle = rng.permutation(3000)
    s_indptr, s_indices = relabel(indptr, indices, shuffle)
    perm = kernels.locality_order(s_indptr, s_indices)
    assert perm.dtype == np.int64 and np.array_equal(np.sort(perm), np.arange(3000))
    o_indptr, o_indices = relabel(s_indptr, s_indices, perm)
    shuffled_max, shuffled_mean = bandwidth(s_indptr, s_indices)
    ordered_max, ordered_mean = bandwidth(o_indptr, o_indices)
    assert shuffled_mean > 500 and ordered_mean < 20 and ordered_max <= 4 * 5 * 2
    # the product is order-independent: gathering on the relabelled graph is a permutation of rows
    x = rng.standard_normal((3000, 8), dtype=np.float32)
    new = np.empty(3000, np.int64)
    new[perm] = np.arange(3000)
    a = kernels.gather(s_indptr, s_indices, x)
    b = kernels.gather(o_indptr, o_indices, x[perm])
    np.testing.assert_allclose(b, a[perm], rtol=1e-5, atol=1e-5)


def test_locality_order_components_and_edge_cases():
    assert kernels.locality_order(np.zeros(1, np.int64), np.empty(0, np.int32)).size == 0
    # isolated vertices, two components, a self loop
    indptr = np.array([0, 1, 2, 2, 4, 5, 6], np.int64)
    indices = np.array([1, 0, 4, 5, 3, 3], np.int32)
    perm = kernels.locality_order(indptr, indices)
    assert sorted(perm.tolist()) == list(range(6))


def planted_communities(sizes: list[int], p_in: float, p_out: float, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A symmetric random graph (no self loops) of communities of ``sizes``, edge probability
    ``p_in`` inside one and ``p_out`` across, vertices numbered at random; -> (indptr, indices,
    community of each vertex)."""
    n = sum(sizes)
    truth = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    upper = np.triu(rng.random((n, n)) < np.where(truth[:, None] == truth[None, :], p_in, p_out), 1)
    rows, cols = np.nonzero(upper | upper.T)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return indptr, cols.astype(np.int32), truth


def test_community_order_keeps_each_planted_community_together_where_a_band_order_does_not():
    rng = np.random.default_rng(11)
    indptr, indices, truth = planted_communities([60, 50, 40, 30], 0.3, 0.02, rng)
    switches = lambda perm: int(np.count_nonzero(truth[perm][1:] != truth[perm][:-1]))  # noqa: E731
    perm = kernels.community_order(indptr, indices, seed=0)
    assert perm.dtype == np.int64 and np.array_equal(np.sort(perm), np.arange(180))
    assert switches(perm) <= 3 + 4  # one block per community, a few stray vertices at most
    assert switches(kernels.locality_order(indptr, indices)) > 30  # breadth-first runs across communities
    assert np.array_equal(kernels.community_order(indptr, indices, seed=0), perm)  # deterministic per seed


def test_community_order_edge_cases():
    assert kernels.community_order(np.zeros(1, np.int64), np.empty(0, np.int32)).size == 0
    for order in (kernels.community_order, kernels.locality_order):  # unchecked kernels behind them
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 2\)"):
            order(np.array([0, 1, 2], np.int64), np.array([1, 5], np.int32))
    indptr = np.array([0, 1, 2, 2, 4, 5, 6], np.int64)  # isolated vertices, two components, a self loop
    indices = np.array([1, 0, 4, 5, 3, 3], np.int32)
    assert sorted(kernels.community_order(indptr, indices, seed=3).tolist()) == list(range(6))


def test_row_read_probe_sums_rows():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((100, 20), dtype=np.float32)
    idx = rng.integers(0, 100, 5000).astype(np.int32)
    np.testing.assert_allclose(kernels.row_read_probe(x, idx, group=12), x[idx].astype(np.float64).sum(0),
                               rtol=1e-4, atol=1e-3)


def test_import_does_not_load_numba():
    # the Lambda bundle (numpy + pyzmq) may import modules that import this one
    import subprocess
    import sys
    code = "import sys, dorylus.models.kernels; assert 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_runs_small_products_without_numba():
    """A graph server that only gathers small intervals never imports numba (2-4 s per process)."""
    import subprocess
    import sys
    code = ("import sys, numpy as np; from dorylus.models import kernels; "
            "ip = np.array([0, 2, 3]); ix = np.array([0, 1, 1], np.int32); x = np.ones((2, 4), np.float32); "
            "assert kernels.gather(ip, ix, x).tolist() == [[2.0] * 4, [1.0] * 4]; "
            "kernels.transpose_csr(ip, ix, 2); "
            "from dorylus.models.graph import CsrGraph; ones = np.ones(2, np.float32); "
            "graph = CsrGraph(ip, ix, ones, ones, 2, np.arange(2), np.arange(2)); "
            "assert graph.aggregate_transpose('sum', x).tolist() == [[1.0] * 4, [2.0] * 4]; "
            "assert 'numba' not in sys.modules")
    env = {k: v for k, v in __import__("os").environ.items() if k != "DORYLUS_GATHER_KERNEL"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_unknown_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("DORYLUS_GATHER_KERNEL", "fortran")
    with pytest.raises(ValueError, match="DORYLUS_GATHER_KERNEL"):
        kernels.gather(np.array([0, 1]), np.array([0], np.int32), np.ones((1, 2), np.float32))
