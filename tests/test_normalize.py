import numpy as np
import pytest

from dorylus.normalize import gcn_normalize, row_normalize


def dense_gcn(src, dst, n, symmetrize):
    """Independent dense oracle: A[v, u] = 1 for u -> v, self-loops replaced by I, D from row sums."""
    a = np.zeros((n, n))
    a[dst, src] = 1.0
    if symmetrize:
        a = np.maximum(a, a.T)
    np.fill_diagonal(a, 1.0)
    d = a.sum(axis=1)
    return a / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]


def to_dense(adj):
    out = np.zeros((adj.num_nodes, adj.num_nodes))
    out[adj.rows(), adj.indices] = adj.weights
    return out


@pytest.mark.parametrize("symmetrize", [True, False])
def test_matches_dense_with_duplicates_and_self_loops(symmetrize):
    rng = np.random.default_rng(1)
    n = 40
    src = np.concatenate([rng.integers(0, n, 200), [3, 3, 7]])
    dst = np.concatenate([rng.integers(0, n, 200), [5, 5, 7]])  # a duplicate edge and a self-loop
    adj = gcn_normalize(src, dst, n, symmetrize=symmetrize)
    np.testing.assert_allclose(to_dense(adj), dense_gcn(src, dst, n, symmetrize), rtol=1e-6, atol=0)
    assert adj.weights.dtype == np.float32 and adj.indices.dtype == np.int32  # 32-bit while N < 2^31
    for v in range(n):
        row = adj.indices[adj.indptr[v]:adj.indptr[v + 1]]
        assert np.all(np.diff(row) > 0) and v in row


def test_hand_computed_path():
    # 0 - 1 - 2 undirected: degrees with self loops are 2, 3, 2.
    adj = gcn_normalize(np.array([0, 1]), np.array([1, 2]), 3, symmetrize=True)
    expected = np.array([
        [1 / 2, 1 / np.sqrt(6), 0],
        [1 / np.sqrt(6), 1 / 3, 1 / np.sqrt(6)],
        [0, 1 / np.sqrt(6), 1 / 2],
    ])
    np.testing.assert_allclose(to_dense(adj), expected, rtol=1e-6)
    np.testing.assert_array_equal(adj.in_degree, [1, 2, 1])


def test_directed_uses_in_degree_and_isolated_vertices():
    adj = gcn_normalize(np.array([0, 0]), np.array([1, 2]), 4, symmetrize=False)
    dense = to_dense(adj)
    assert dense[0, 1] == 0 and dense[1, 0] == pytest.approx(1 / np.sqrt(2))
    assert dense[3, 3] == 1.0  # isolated vertex keeps only its self-loop


def test_row_normalize():
    x = np.array([[1, 3], [0, 0], [2, 2]], dtype=np.float32)
    np.testing.assert_allclose(row_normalize(x), [[0.25, 0.75], [0, 0], [0.5, 0.5]])


def test_row_normalize_in_blocks_equals_the_whole_matrix_quotient(monkeypatch):
    """Blocks of rows give the float64 quotient of the whole matrix, cast once, bit for bit
    (the same operations per element), including zero rows and a last partial block."""
    import dorylus.normalize as normalize

    rng = np.random.default_rng(3)
    x = rng.random((1001, 7), dtype=np.float32)
    x[[0, 500, 1000]] = 0
    sums = x.sum(axis=1, dtype=np.float64, keepdims=True)
    expected = (x / np.where(sums == 0, 1.0, sums)).astype(np.float32)
    monkeypatch.setattr(normalize, "ROW_BLOCK_ELEMENTS", 7 * 64)  # 64 rows per block
    got = normalize.row_normalize(x)
    assert got.dtype == np.float32 and np.array_equal(got, expected)
