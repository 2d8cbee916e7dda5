"""Every aggregation kind of dorylus.models.graph: the host products (aggregate and its
transpose) and the torch matrices (the gpu backend's) against the dense matrix the kind defines."""

from __future__ import annotations

import numpy as np
import pytest

from dorylus.models.graph import KINDS
from dorylus.models.reference import whole_graph
from dorylus.normalize import gcn_normalize

# directed, with a vertex (4) without in-neighbours and a duplicate edge (0 -> 3 twice, one entry)
SRC = np.array([0, 1, 2, 3, 0, 5, 2, 0, 1])
DST = np.array([1, 2, 3, 5, 3, 0, 0, 3, 3])
N = 6


def _dense(kind: str) -> np.ndarray:
    """The definition of ``kind`` (module docstring of dorylus.models.graph), in float64."""
    a = np.zeros((N, N))
    a[DST, SRC] = 1.0  # row v, column u for an edge u -> v; the edge set
    indeg = a.sum(1)
    if kind == "gcn":
        norm = 1.0 / np.sqrt(1.0 + indeg)
        return norm[:, None] * (a + np.eye(N)) * norm[None, :]
    if kind == "mean":
        return np.divide(a, indeg[:, None], out=np.zeros_like(a), where=indeg[:, None] > 0)
    if kind == "sum":
        return a + np.eye(N)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_kind_equals_its_dense_definition(kind):
    graph = whole_graph(gcn_normalize(SRC, DST, N, symmetrize=False))
    dense = _dense(kind)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 3)).astype(np.float32)
    # float32 sums of at most 4 terms of O(1): a few ulp, so rtol 1e-5 with atol 1e-6 near 0
    np.testing.assert_allclose(graph.aggregate(kind, x), dense @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph.aggregate(kind, x, (2, 5)), (dense @ x)[2:5], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph.aggregate_transpose(kind, x), dense.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph.matrix(kind).to_dense().numpy(), dense, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(graph.transpose(kind).to_dense().numpy(), dense.T, rtol=1e-6, atol=1e-7)


def test_unknown_kind_is_named():
    graph = whole_graph(gcn_normalize(SRC, DST, N, symmetrize=False))
    with pytest.raises(ValueError, match="unknown aggregation 'max'"):
        graph.aggregate("max", np.ones((N, 2), np.float32))
