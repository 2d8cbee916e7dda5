"""The graph that a model's GATHER stages run on: in-edges of some destination rows as CSR.

A graph server holds its owned rows' in-edges (columns are its local rows, ``[owned; ghosts]``);
the reference holds the whole graph. Every row lists its sources with the self loop included
(the pattern ``S`` of ``A + I``, :mod:`dorylus.normalize`), row ``k``'s self loop being column
``k``, so one structure serves every model. No per-edge value is kept: each aggregation is ``S``
scaled by per-vertex vectors,

==========  ==========================================  ===============================================
kind        entry ``(v, u)``                            as ``S`` with scales
==========  ==========================================  ===============================================
``gcn``     ``A_hat[v, u] = norm[v] norm[u]``           ``diag(row_norm) S diag(col_norm)``
``mean``    ``1 / indeg(v)`` for ``u != v``, 0 at v     ``diag(1 / indeg) (S - [I 0])``
``sum``     1 for every in-edge and the self loop       ``S`` itself (``A + I``; a weight of the self
                                                        loop other than 1 is the model's to add)
==========  ==========================================  ===============================================

with ``norm = (1 + indeg)^-1/2`` of the whole graph and ``indeg(v)`` row ``v``'s length less
its self loop (a graph server owns all in-edges of its rows, so means are over the whole graph's
neighbourhoods, never a partition's). Memory: ``indices`` (4 bytes per entry as int32, left
memory-mapped from the store), ``indptr`` and the scales (per vertex); the backward pass needs
nothing more on the host at scale. :meth:`memory` says what each costs.

:meth:`aggregate` runs on the host with :func:`dorylus.models.kernels.gather` (every core, the
scales applied in the kernel, no per-entry array), :meth:`aggregate_transpose` with
:func:`~dorylus.models.kernels.gather_transpose` on ``S`` itself (a push from its rows: no
transposed pattern). A part of an undirected graph (``owned_symmetric=True``) pulls instead: its
owned columns ``S[:, :R]`` are a symmetric block, so ``S^T``'s owned rows are ``S``'s own rows
read up to their first ghost column, and only the ghost columns (the cut's entries) are pushed.
The pull is a Gather's speed (the push's scattered read-modify-writes took 1.7-2x as long on
ogbn-products-sized parts) at no memory. Products small enough for torch (fewer than
:data:`~dorylus.models.kernels.SMALL_WORK` entries x width), and a symmetric ``S``
(``symmetric=True``: the whole undirected graph, its own transpose), gather over ``S^T``'s
pattern instead (:func:`~dorylus.models.kernels.transpose_csr`, made once: 4 bytes per entry, and
only then). :meth:`matrix` and :meth:`transpose` build torch CSR matrices with the entries as
values on the graph's ``device`` (the ``gpu`` backend's twins): 4 bytes per entry more there. GAT's per-edge arrays
(:meth:`edges`, :meth:`source_order`) are made only when asked. Not part of the Lambda bundle.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dorylus.models import kernels

KINDS = ("gcn", "mean", "sum")


def csr_tensor(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A ``shape`` torch CSR on the CPU over (views of) the numpy arrays; ``indptr`` takes the
    dtype of ``indices`` (torch wants both alike)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # The arrays may be read-only memory maps of the partition store; the matrix is never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.sparse_csr_tensor(torch.from_numpy(np.ascontiguousarray(indptr, dtype=indices.dtype)),
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
        indptr: ``int64 [num_rows + 1]``.
        indices: ``int32 [nnz]`` (or int64): the pattern ``S`` of ``A + I``; kept as given (a
            memory map stays one, never copied).
        row_norm, col_norm: ``float32 [num_rows]``, ``[num_cols]``: ``A_hat = diag(row_norm) S
            diag(col_norm)`` (for a part, ``norm[:n_owned]`` and ``norm``).
        num_cols: columns (source rows); ``row_ids``/``col_ids``: their global vertex ids.
        symmetric: ``S`` is square and symmetric (the whole undirected graph): its own transpose.
        owned_symmetric: ``S[:, :num_rows]`` is symmetric and each row's columns ascend (a part
            of an undirected graph as the partition store writes it: columns ``[owned; ghosts]``).
        device: where :meth:`matrix`, :meth:`transpose` and :meth:`tensor` put their tensors
            (default: the CPU, where they share memory with the numpy arrays).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, row_norm: np.ndarray, col_norm: np.ndarray,
                 num_cols: int, row_ids: np.ndarray, col_ids: np.ndarray, *, symmetric: bool = False,
                 owned_symmetric: bool = False, device: torch.device | str | None = None):
        self.device = torch.device(device or "cpu")
        self.indptr = np.asarray(indptr, np.int64)
        self.indices = indices if indices.dtype in (np.int32, np.int64) else np.asarray(indices, np.int64)
        self.num_rows, self.num_cols = len(self.indptr) - 1, int(num_cols)
        self.row_norm, self.col_norm = np.asarray(row_norm, np.float32), np.asarray(col_norm, np.float32)
        if self.row_norm.shape != (self.num_rows,) or self.col_norm.shape != (self.num_cols,):
            raise ValueError(f"row_norm {self.row_norm.shape} and col_norm {self.col_norm.shape} must be "
                             f"({self.num_rows},) and ({self.num_cols},)")
        self.row_ids, self.col_ids = np.asarray(row_ids, np.int64), np.asarray(col_ids, np.int64)
        self.symmetric = bool(symmetric)
        self.owned_symmetric = bool(owned_symmetric) or self.symmetric
        self._inv_degree: np.ndarray | None = None
        self._transposed: tuple[np.ndarray, np.ndarray] | None = None
        self._blocks: dict[tuple, np.ndarray] = {}
        self._values: dict[str, np.ndarray] = {}
        self._matrices: dict[tuple, torch.Tensor] = {}
        self._edges: dict[tuple[int, int], Edges] = {}
        self._source_order: tuple[np.ndarray, np.ndarray] | None = None
        self._tensors: dict[tuple, torch.Tensor] = {}

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    # ------------------------------------------------------------------ the host's products

    def inv_degree(self) -> np.ndarray:
        """``float32 [num_rows]``: ``1 / indeg(v)`` (0 for a row with only its self loop)."""
        if self._inv_degree is None:
            degree = np.diff(self.indptr) - 1
            inv = np.zeros(self.num_rows, np.float64)
            np.divide(1.0, degree, out=inv, where=degree > 0)
            self._inv_degree = inv.astype(np.float32)
        return self._inv_degree

    def _rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[a, b)`` of ``S``: their ``indptr`` from 0 (the only copy, made once per
        interval) and a view of ``indices``."""
        key = ("S", a, b)
        if key not in self._blocks:
            self._blocks[key] = self.indptr[a:b + 1] - self.indptr[a]
        lo, hi = int(self.indptr[a]), int(self.indptr[b])
        return self._blocks[key], self.indices[lo:hi]

    def transposed_pattern(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr_T int64 [num_cols + 1], indices_T [nnz])`` of ``S^T`` (``[num_cols,
        num_rows]``, rows ascending in each of its rows; int32 indices), made once by a
        counting sort; ``S``'s own arrays when it is symmetric. For :meth:`transpose`'s torch
        matrices and the small products of :meth:`aggregate_transpose` that run on torch."""
        if self.symmetric:
            return self.indptr, self.indices
        if self._transposed is None:
            indptr_t, indices_t, _ = kernels.transpose_csr(self.indptr, self.indices, self.num_cols)
            self._transposed = (indptr_t, indices_t)
        return self._transposed

    def aggregate(self, kind: str, x: np.ndarray, rows: tuple[int, int] | None = None) -> np.ndarray:
        """``M[rows, :] · x`` for ``x`` ``float32 [num_cols, width]``: ``float32 [rows, width]``.

        gcn: ``row_norm[rows] * (S[rows] · (col_norm * x))``; mean:
        ``inv_degree[rows] * (S[rows] · x - x[rows])``."""
        a, b = rows if rows is not None else (0, self.num_rows)
        indptr, indices = self._rows(a, b)
        if kind == "gcn":
            return kernels.gather(indptr, indices, x, row_scale=self.row_norm[a:b], col_scale=self.col_norm)
        if kind == "mean":
            out = kernels.gather(indptr, indices, x)
            out -= x[a:b]
            out *= self.inv_degree()[a:b, None]
            return out
        if kind == "sum":
            return kernels.gather(indptr, indices, x)
        raise ValueError(f"unknown aggregation {kind!r}; known: {', '.join(KINDS)}")

    def aggregate_transpose(self, kind: str, grad: np.ndarray) -> np.ndarray:
        """``M^T · grad`` for ``grad`` ``float32 [num_rows, width]``: ``float32 [num_cols, width]``.

        gcn: ``col_norm * (S^T · (row_norm * grad))``; mean: ``S^T · g - [g; 0]`` with
        ``g = inv_degree * grad``."""
        if kind == "gcn":
            return self._product_t(grad, self.row_norm, self.col_norm)
        if kind == "mean":
            g = np.asarray(grad, dtype=np.float32) * self.inv_degree()[:, None]
            out = self._product_t(g)
            out[:self.num_rows] -= g
            return out
        if kind == "sum":
            return self._product_t(grad)
        raise ValueError(f"unknown aggregation {kind!r}; known: {', '.join(KINDS)}")

    def _product_t(self, g: np.ndarray, row_scale: np.ndarray | None = None,
                   col_scale: np.ndarray | None = None) -> np.ndarray:
        """``(diag(row_scale) S diag(col_scale))^T · g``: on numba a push over ``S``, no ``S^T``
        held, or with a symmetric owned block a pull for the owned columns and a push for the
        ghosts; a product small enough for torch (:func:`~dorylus.models.kernels.uses_numba`) a
        gather over ``S^T``'s pattern, made once (torch has no fast row scatter); a symmetric ``S``
        is its own transpose."""
        if not self.symmetric and kernels.uses_numba(self.nnz * g.shape[1]):
            if not self.owned_symmetric:
                return kernels.gather_transpose(self.indptr, self.indices, g, self.num_cols, row_scale=row_scale,
                                                col_scale=col_scale)
            r = self.num_rows
            out = np.empty((self.num_cols, g.shape[1]), np.float32)
            kernels.gather(self.indptr, self.indices, g, row_scale=None if col_scale is None else col_scale[:r],
                           col_scale=row_scale, col_limit=r, out=out[:r])
            return kernels.gather_transpose(self.indptr, self.indices, g, self.num_cols, row_scale=row_scale,
                                            col_scale=col_scale, out=out, first_col=r)
        indptr_t, indices_t = self.transposed_pattern()
        return kernels.gather(indptr_t, indices_t, g, row_scale=col_scale, col_scale=row_scale)

    # ------------------------------------------------------------------ torch matrices with values (devices)

    def row_of(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """``int64 [entries of rows a..b)]``: the row of each entry (made per call: 8 bytes each)."""
        b = self.num_rows if b is None else b
        return np.repeat(np.arange(a, b, dtype=np.int64), np.diff(self.indptr[a:b + 1]))

    def values(self, kind: str) -> np.ndarray:
        """``float32 [nnz]``: the entries of the aggregation matrix ``kind`` (see the module
        docstring), made once for the torch matrices of :meth:`matrix`."""
        if kind not in self._values:
            rows = self.row_of()
            if kind == "gcn":
                self._values[kind] = self.row_norm[rows] * self.col_norm[self.indices]
            elif kind == "mean":
                self._values[kind] = np.where(self.indices == rows, np.float32(0), self.inv_degree()[rows])
            elif kind == "sum":
                self._values[kind] = np.ones(self.nnz, np.float32)
            else:
                raise ValueError(f"unknown aggregation {kind!r}; known: {', '.join(KINDS)}")
        return self._values[kind]

    def matrix(self, kind: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[rows, num_cols]`` torch CSR of ``kind`` restricted to rows ``[a, b)`` (all by
        default), on the graph's device."""
        a, b = rows if rows is not None else (0, self.num_rows)
        key = (kind, a, b)
        if key not in self._matrices:
            lo, hi = self.indptr[a], self.indptr[b]
            self._matrices[key] = self._placed(csr_tensor(self.indptr[a:b + 1] - lo, self.indices[lo:hi],
                                                          self.values(kind)[lo:hi], (b - a, self.num_cols)))
        return self._matrices[key]

    def transpose(self, kind: str) -> torch.Tensor:
        """``[num_cols, num_rows]`` torch CSR of the transpose of ``kind``, on the graph's device."""
        key = (kind, "T")
        if key not in self._matrices:
            indptr_t, rows_t = self.transposed_pattern()
            cols_t = np.repeat(np.arange(self.num_cols, dtype=np.int64), np.diff(indptr_t))
            if kind == "gcn":
                values = self.col_norm[cols_t] * self.row_norm[rows_t]
            elif kind == "mean":
                values = np.where(cols_t == rows_t, np.float32(0), self.inv_degree()[rows_t])
            elif kind == "sum":
                values = np.ones(len(rows_t), np.float32)
            else:
                raise ValueError(f"unknown aggregation {kind!r}; known: {', '.join(KINDS)}")
            self._matrices[key] = self._placed(csr_tensor(indptr_t, rows_t, values, (self.num_cols, self.num_rows)))
        return self._matrices[key]

    def tensor(self, key: tuple, array: np.ndarray) -> torch.Tensor:
        """``array`` (derived from the structure, named by ``key``) as a tensor on the graph's
        device, made once: index tensors of the edge work."""
        if key not in self._tensors:
            self._tensors[key] = self._placed(torch.from_numpy(np.ascontiguousarray(array)))
        return self._tensors[key]

    def _placed(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    # ------------------------------------------------------------------ GAT's per-edge arrays (lazy)

    def edges(self, rows: tuple[int, int] | None = None) -> Edges:
        a, b = rows if rows is not None else (0, self.num_rows)
        if (a, b) not in self._edges:
            lo, hi = self.indptr[a], self.indptr[b]
            src = self.indices[lo:hi].astype(np.int64)
            dst = self.row_of(a, b) - a
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

    # ------------------------------------------------------------------ what it costs

    def memory(self) -> dict[str, int]:
        """Bytes held per structure now (made-on-demand ones once made): ``indices`` and
        ``indptr`` (the store's, memory-mapped when loaded so), ``norms``, ``transpose``
        (``S^T``'s pattern, made for :meth:`transpose` and products on torch only; 0 when symmetric), ``block_indptr`` (the intervals' row pointers),
        ``values`` (per-entry values of the device matrices), ``edges`` (GAT)."""
        transpose = 0 if self.symmetric or self._transposed is None else sum(a.nbytes for a in self._transposed)
        blocks = sum(a.nbytes for a in self._blocks.values())
        matrices = sum(m.values().numel() * 4 + m.crow_indices().numel() * m.crow_indices().element_size()
                       for m in self._matrices.values())
        edges = sum(e.dst.nbytes + e.src.nbytes + e.dst_ids.nbytes + e.src_ids.nbytes for e in self._edges.values())
        edges += sum(a.nbytes for a in self._source_order) if self._source_order is not None else 0
        return {"indices": self.indices.nbytes, "indptr": self.indptr.nbytes,
                "norms": self.row_norm.nbytes + self.col_norm.nbytes
                + (self._inv_degree.nbytes if self._inv_degree is not None else 0),
                "transpose": transpose, "block_indptr": blocks,
                "values": sum(v.nbytes for v in self._values.values()) + matrices, "edges": edges}


def spmm(matrix: torch.Tensor, dense: np.ndarray) -> np.ndarray:
    """Sparse (CSR) times dense on the CPU with torch's multi-threaded kernel, ``float32``."""
    return (matrix @ torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))).numpy()
