r"""GCN normalization, computed once on the whole graph (never per partition).

For an adjacency ``A`` with ``A[v, u] = 1`` when there is an edge ``u -> v``:

.. math::

    \hat A = D^{-1/2} (A + I) D^{-1/2}, \qquad D_{vv} = 1 + \mathrm{indeg}(v)

so that Gather computes ``Z[v] = sum_u A_hat[v, u] H[u]`` over the in-neighbours of ``v`` and
``v`` itself. For an undirected (symmetrized) graph in- and out-degree agree and ``A_hat`` is
symmetric; for a directed graph this is the convention of PyG's ``gcn_norm`` (the in-degree of
each endpoint), and the backward pass uses ``A_hat^T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class NormalizedAdjacency:
    """``A_hat`` as the pattern of ``A + I`` in CSR (row ``v`` lists the sources ``u`` of edges
    ``u -> v`` and ``v`` itself) and one scale per vertex: ``A_hat[v, u] = norm[v] norm[u]``.

    No per-entry value is stored: ``norm`` carries all of ``A_hat``'s numbers in ``4 N`` bytes
    (a per-entry float32 would be ``4 nnz``).

    Attributes:
        indptr: ``int64 [N + 1]``.
        indices: ``int32 [nnz]`` (``int64`` when ``N >= 2^31``) source vertex of each entry,
            ascending within a row.
        norm: ``float32 [N]``, ``(1 + indeg(v))^-1/2``.
        in_degree: ``int64 [N]``, in-degree without the self-loop (``D - I``).
    """

    indptr: np.ndarray
    indices: np.ndarray
    norm: np.ndarray
    in_degree: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def rows(self) -> np.ndarray:
        """``int64 [nnz]``: the destination (row) vertex of each entry."""
        return np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))

    @property
    def weights(self) -> np.ndarray:
        """``float32 [nnz]``: the entries ``norm[v] norm[u]``, made on demand (tests and tools;
        training never materializes them)."""
        return self.norm[self.rows()] * self.norm[self.indices]


def vertex_dtype(count: int) -> np.dtype:
    """The index dtype for ids below ``count``: int32 when they fit (half the bytes), else int64."""
    return np.dtype(np.int32) if count <= np.iinfo(np.int32).max else np.dtype(np.int64)


def gcn_norm(in_degree: np.ndarray) -> np.ndarray:
    """``float32 [n]``: ``(1 + in_degree)^-1/2``, rounded once from float64."""
    return (1.0 / np.sqrt(np.asarray(in_degree, dtype=np.float64) + 1.0)).astype(np.float32)


def sorted_unique(keys: np.ndarray, in_place: bool = False) -> np.ndarray:
    """``np.unique(keys)`` for a 1-D integer array, by sorting.

    numpy >= 2.3 answers ``np.unique`` on integers through a hash table that is ~100x slower
    than sorting when most keys are distinct (40 s vs 0.4 s for 20M int64 keys).
    ``in_place=True`` sorts ``keys`` itself instead of a copy.
    """
    if in_place:
        keys.sort()
    else:
        keys = np.sort(keys)
    distinct = np.empty(keys.shape[0], dtype=bool)
    distinct[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=distinct[1:])
    return keys[distinct]


def edge_keys(src: np.ndarray, dst: np.ndarray, num_nodes: int, symmetrize: bool) -> np.ndarray:
    """Sorted unique ``dst * N + src`` keys of the edge set, self-loops dropped, optionally with
    every edge's reverse added. Sorting by this key yields CSR (row = destination) order."""
    n = np.int64(num_nodes)
    keys = dst.astype(np.int64) * n + src.astype(np.int64)
    if symmetrize:
        keys = np.concatenate([keys, src.astype(np.int64) * n + dst.astype(np.int64)])
    keys = sorted_unique(keys, in_place=True)
    return keys[keys // n != keys % n]


def gcn_normalize(src: np.ndarray, dst: np.ndarray, num_nodes: int, symmetrize: bool = True) -> NormalizedAdjacency:
    """Build ``A_hat`` from an edge list.

    Duplicate edges count once and input self-loops are replaced by the single added one, so the
    result depends only on the edge *set*. ``symmetrize=True`` adds the reverse of every edge
    (the reading of an undirected graph). Memory: the sorted edge keys (8 bytes per entry, 16
    while symmetrizing) while building; the result is ``4 nnz + 20 N`` bytes.

    Args:
        src, dst: ``int [E]`` edge endpoints in ``[0, num_nodes)``.
        num_nodes: ``N``.
        symmetrize: add reverse edges before normalizing.
    """
    n = int(num_nodes)
    keys = edge_keys(src, dst, n, symmetrize)
    bounds = np.arange(n + 1, dtype=np.int64) * n
    # keys are sorted by destination: row v's keys are [v N, (v + 1) N).
    in_degree = np.diff(np.searchsorted(keys, bounds)).astype(np.int64)
    # The self-loop of row v goes where key v*N+v would sort, keeping columns ascending per row.
    self_loop_pos = np.searchsorted(keys, bounds[:-1] + np.arange(n, dtype=np.int64))
    dtype = vertex_dtype(n)
    np.remainder(keys, n, out=keys)
    indices = np.insert(keys.astype(dtype), self_loop_pos, np.arange(n, dtype=dtype))
    del keys, self_loop_pos
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(in_degree + 1, out=indptr[1:])
    return NormalizedAdjacency(indptr=indptr, indices=indices, norm=gcn_norm(in_degree), in_degree=in_degree)


# Rows per block of row_normalize: about 4 MB of float64 quotients at a time.
ROW_BLOCK_ELEMENTS = 1 << 19


def row_normalize(features, out: np.ndarray | None = None):
    """Divide each row by its sum (rows summing to zero are left as zeros). ``float32 [N, F]``,
    or :class:`~dorylus.models.sparse.SparseRows` for sparse features (the same values). Dense
    rows go into ``out`` when given (``features`` itself normalizes in place)."""
    from dorylus.models.sparse import SparseRows

    if isinstance(features, SparseRows):
        return features.row_normalized()
    # A block of rows at a time: the float64 quotient of the whole matrix would be twice the
    # features' size on top of them (at ogbn-products' size, 1.9 GB of temporaries per part).
    if out is None:
        out = np.empty(features.shape, np.float32)
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, features.shape[1]))
    for a in range(0, features.shape[0], step):
        block = features[a:a + step]
        sums = block.sum(axis=1, dtype=np.float64, keepdims=True)
        sums[sums == 0] = 1.0
        np.divide(block, sums, out=out[a:a + step], casting="same_kind")
    return out
