"""The graph that a model's GATHER stages run on: in-edges of some destination rows as CSR.

A graph server holds its owned rows' in-edges (columns are its local rows, ``[owned; ghosts]``);
the reference holds the whole graph. Every row lists its sources with the self loop included
(the pattern of ``A + I``, :mod:`dorylus.normalize`), so one structure serves every model:

==========  =========================================================================
kind        entry ``(v, u)``
==========  =========================================================================
``gcn``     ``A_hat[v, u] = 1 / sqrt(deg(v) deg(u))`` (degrees with the self loop)
``mean``    ``1 / indeg(v)`` for ``u != v``, 0 for the self loop (GraphSAGE's mean)
==========  =========================================================================

Row ``v``'s in-degree is its row length minus the self loop: a graph server owns all in-edges of
its rows, so means are over the whole graph's neighbourhoods, never a partition's. Uses torch's
CSR kernels; not part of the Lambda bundle.

The structure itself is numpy (host); the torch matrices and edge index tensors built from it
are cached on the graph's ``device`` (the CPU by default; the ``gpu`` backend's device), once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("gcn", "mean")


def csr_tensor(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A ``shape`` torch CSR on the CPU over (views of) the numpy arrays."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # The arrays may be read-only memory maps of the partition store; the matrix is never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.sparse_csr_tensor(torch.from_numpy(np.ascontiguousarray(indptr)),
                                       torch.from_numpy(np.ascontiguousarray(indices)),
                                       torch.from_numpy(np.ascontiguousarray(values)), size=shape,
                                       check_invariants=False)


def csr_of_tensors(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A ``shape`` torch CSR over tensors of one device (no copy)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=shape, check_invariants=False)


@dataclass(frozen=True)
class Edges:
    """The in-edges of rows ``[start, stop)``, one entry per edge ``u -> v`` (self loops included).

    Attributes:
        indptr: ``int64 [rows + 1]``, from 0.
        dst: ``int64 [nnz]``, the destination's row in the block (``0 .. rows-1``).
        src: ``int64 [nnz]``, the source's column.
        dst_ids, src_ids: ``int64 [nnz]`` global vertex ids of both ends (keys of edge dropout).
    """

    indptr: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    dst_ids: np.ndarray
    src_ids: np.ndarray


class CsrGraph:
    """In-edges of ``num_rows`` destination rows over ``num_cols`` columns.

    Args:
        indptr, indices: ``int64 [num_rows + 1]``, ``int64 [nnz]``: CSR of in-edges, self loops included.
        gcn_weights: ``float32 [nnz]``, the ``A_hat`` entries.
        num_cols: columns (source rows); ``row_ids``/``col_ids``: their global vertex ids.
        device: where :meth:`matrix`, :meth:`transpose` and :meth:`tensor` put their tensors
            (default: the CPU, where they share memory with the numpy arrays).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, gcn_weights: np.ndarray, num_cols: int,
                 row_ids: np.ndarray, col_ids: np.ndarray, device: torch.device | str | None = None):
        self.device = torch.device(device or "cpu")
        self.indptr, self.indices = np.asarray(indptr, np.int64), np.asarray(indices, np.int64)
        self.num_rows, self.num_cols = len(self.indptr) - 1, int(num_cols)
        self.row_ids, self.col_ids = np.asarray(row_ids, np.int64), np.asarray(col_ids, np.int64)
        self._values: dict[str, np.ndarray] = {"gcn": np.asarray(gcn_weights, np.float32)}
        self._matrices: dict[tuple, torch.Tensor] = {}
        self._edges: dict[tuple[int, int], Edges] = {}
        self._row_of: np.ndarray | None = None
        self._source_order: tuple[np.ndarray, np.ndarray] | None = None
        self._tensors: dict[tuple, torch.Tensor] = {}

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def row_of(self) -> np.ndarray:
        """``int64 [nnz]``: the row of each entry."""
        if self._row_of is None:
            self._row_of = np.repeat(np.arange(self.num_rows, dtype=np.int64), np.diff(self.indptr))
        return self._row_of

    def values(self, kind: str) -> np.ndarray:
        """``float32 [nnz]``: the entries of the aggregation matrix ``kind`` (see the module docstring)."""
        if kind not in self._values:
            if kind != "mean":
                raise ValueError(f"unknown aggregation {kind!r}; known: {', '.join(KINDS)}")
            self_loop = self.col_ids[self.indices] == self.row_ids[self.row_of()]
            in_degree = np.diff(self.indptr) - np.bincount(self.row_of()[self_loop], minlength=self.num_rows)
            inv = np.zeros(self.num_rows, np.float64)
            np.divide(1.0, in_degree, out=inv, where=in_degree > 0)
            self._values[kind] = np.where(self_loop, 0.0, inv[self.row_of()]).astype(np.float32)
        return self._values[kind]

    def matrix(self, kind: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[rows, num_cols]`` torch CSR of ``kind`` restricted to rows ``[a, b)`` (all by default)."""
        a, b = rows if rows is not None else (0, self.num_rows)
        key = (kind, a, b)
        if key not in self._matrices:
            lo, hi = self.indptr[a], self.indptr[b]
            self._matrices[key] = self._placed(csr_tensor(self.indptr[a:b + 1] - lo, self.indices[lo:hi],
                                                          self.values(kind)[lo:hi], (b - a, self.num_cols)))
        return self._matrices[key]

    def transpose(self, kind: str) -> torch.Tensor:
        """``[num_cols, num_rows]`` torch CSR of the transpose of ``kind``."""
        key = (kind, "T")
        if key not in self._matrices:
            coo = torch.sparse_coo_tensor(torch.from_numpy(np.stack([self.indices, self.row_of()])),
                                          torch.from_numpy(self.values(kind)), (self.num_cols, self.num_rows),
                                          check_invariants=False)
            self._matrices[key] = self._placed(coo.coalesce().to_sparse_csr())
        return self._matrices[key]

    def tensor(self, key: tuple, array: np.ndarray) -> torch.Tensor:
        """``array`` (derived from the structure, named by ``key``) as a tensor on the graph's
        device, made once: index tensors of the edge work."""
        if key not in self._tensors:
            self._tensors[key] = self._placed(torch.from_numpy(np.ascontiguousarray(array)))
        return self._tensors[key]

    def _placed(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def aggregate(self, kind: str, x: np.ndarray, rows: tuple[int, int] | None = None) -> np.ndarray:
        """``M[rows, :] · x`` for ``x`` ``[num_cols, width]``: ``float32 [rows, width]``."""
        return spmm(self.matrix(kind, rows), x)

    def aggregate_transpose(self, kind: str, grad: np.ndarray) -> np.ndarray:
        """``M^T · grad`` for ``grad`` ``[num_rows, width]``: ``float32 [num_cols, width]``."""
        return spmm(self.transpose(kind), grad)

    def edges(self, rows: tuple[int, int] | None = None) -> Edges:
        a, b = rows if rows is not None else (0, self.num_rows)
        if (a, b) not in self._edges:
            lo, hi = self.indptr[a], self.indptr[b]
            src = self.indices[lo:hi]
            dst = self.row_of()[lo:hi] - a
            self._edges[(a, b)] = Edges(indptr=self.indptr[a:b + 1] - lo, dst=dst, src=src,
                                        dst_ids=self.row_ids[dst + a], src_ids=self.col_ids[src])
        return self._edges[(a, b)]

    def source_order(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, order)``: the entries grouped by column, for products with the transpose of a
        matrix whose values change every call (attention): ``int64 [num_cols + 1]`` and the
        permutation ``int64 [nnz]`` that sorts the entries by column (stably)."""
        if self._source_order is None:
            order = np.argsort(self.indices, kind="stable")
            indptr = np.zeros(self.num_cols + 1, np.int64)
            np.cumsum(np.bincount(self.indices, minlength=self.num_cols), out=indptr[1:])
            self._source_order = (indptr, order)
        return self._source_order


def spmm(matrix: torch.Tensor, dense: np.ndarray) -> np.ndarray:
    """Sparse (CSR) times dense on the CPU with torch's multi-threaded kernel, ``float32``."""
    return (matrix @ torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))).numpy()
