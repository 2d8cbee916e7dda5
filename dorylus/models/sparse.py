r"""Sparse input features: rows of a ``float32 [n, F]`` matrix kept in CSR, in numpy alone.

Bag-of-words features are mostly zeros (Cora: 1.3% non-zero). A model reads its input features
``X`` only in layer 0, and only through

.. math::

    H_0 = \mathrm{dropout}_0(X), \qquad P = H_0 W \ \text{(forward)}, \qquad
    dW = H_0^\top G \ \text{(backward)}

with no activation on ``X`` and no gradient with respect to ``X``. Dropout scales or zeroes
elements, so ``H_0`` has the sparsity pattern of ``X``; both products then cost what the
non-zeros cost: ``O(nnz · k)`` for ``k`` output columns instead of ``O(n · F · k)``, and the
keyed dropout mask is drawn at the ``nnz`` stored positions only (:func:`dorylus.masks.keep_at`,
the same draws as the dense mask there). Dropped entries stay in the structure as zeros, so every
``H_0`` of an interval shares one structure and its cached transposition.

:class:`SparseRows` is that matrix. It ships in the Lambda bundle: numpy only, no scipy. The
products run over blocks of about :data:`CHUNK_NNZ` stored entries: one gather of ``W`` rows (or
``G`` rows) per block, scaled by the values, then summed per row (or per column) with
``np.add.reduceat``; a block's temporaries (``CHUNK_NNZ x k`` floats) stay in cache. On 20,000
rows x 4,096 columns at 1% density and ``k = 16`` this measured about 20 ms for ``H W`` and
25-40 ms for ``H^T G`` on one core, against 60-100 ms for each dense BLAS product on one or two
(a shared 2-core machine; whole-matrix temporaries instead of blocks: 90 ms; densifying row
blocks for BLAS: 340 ms; ``np.bincount`` per output column: 120 ms and 190 ms).

Which layout a run uses is the ``sparse_features`` option (:data:`SPARSE_MODES`): ``auto`` keeps
features sparse when their density (non-zeros / size) is below :data:`AUTO_MAX_DENSITY`,
``on`` always, ``off`` never.
"""

from __future__ import annotations

from typing import Union

import numpy as np

SPARSE_MODES = ("auto", "on", "off")
# Measured with benchmarks/bench_sparse.py's graph (20K rows, 4,096 columns, 2 threads): at 5% and
# 10% density a GCN reference epoch is 3x faster sparse and layer 0's function work 2.6-5.6x; at 20%
# both are within 25% of dense. On synthetic-small (128 columns, 7.5%) the reference epoch is even
# and the function work 2.8x faster. CSR (8 bytes per non-zero with int32 columns) is also smaller
# than dense rows (4 bytes per element) below 50%.
AUTO_MAX_DENSITY = 0.10
# A product with k columns goes through dense row blocks when density x k reaches this (see
# SparseRows.products_densely); blocks hold at most DENSE_BLOCK_ELEMENTS entries (16 MB).
DENSE_ROUTE = 0.25
DENSE_BLOCK_ELEMENTS = 1 << 22
# Stored entries per block of the products: 16K entries x 16 columns x 4 bytes = 1 MB of
# temporaries (blocks of 4K-64K measured within 30% of each other; whole-matrix 4x slower).
CHUNK_NNZ = 1 << 14
_MAX_CACHED_SLICES = 64


class _Structure:
    """The pattern shared by a matrix and every copy with other values (dropout): row pointers,
    columns and, computed on first use, each entry's row, the row blocks of the forward product
    and the column-major order of the transpose product."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]):
        self.indptr, self.indices, self.shape = indptr, indices, shape
        self._rows: np.ndarray | None = None
        self._row_blocks: list[tuple[int, int]] | None = None
        self._by_column: tuple[np.ndarray, np.ndarray, list[tuple[int, int, np.ndarray, np.ndarray]]] | None = None

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def rows(self) -> np.ndarray:
        """``intp [nnz]``: the row of each stored entry."""
        if self._rows is None:
            self._rows = np.repeat(np.arange(self.shape[0], dtype=np.intp), np.diff(self.indptr))
        return self._rows

    def row_blocks(self) -> list[tuple[int, int]]:
        """``[start, stop)`` row ranges of about ``CHUNK_NNZ`` entries each (a longer row: alone)."""
        if self._row_blocks is None:
            n = self.shape[0]
            cuts = np.searchsorted(self.indptr, np.arange(CHUNK_NNZ, self.nnz, CHUNK_NNZ), side="left")
            bounds = np.unique(np.concatenate([[0], cuts, [n]]))
            self._row_blocks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        return self._row_blocks

    def by_column(self):
        """``(order, rows, blocks)``: the entries in column-major order (``order``, a stable
        permutation of the CSR order, and their ``rows``), cut into blocks of ``CHUNK_NNZ``; each
        block is ``(start, stop, firsts, columns)``: where each column's run starts in the
        block, and which column it is."""
        if self._by_column is None:
            # numpy's stable sort is a radix sort for 16-bit keys: 12 ms instead of 90 for 800K entries.
            keys = self.indices.astype(np.uint16) if self.shape[1] <= 1 << 16 else self.indices
            order = np.argsort(keys, kind="stable")
            columns = self.indices[order]
            blocks = []
            for start in range(0, self.nnz, CHUNK_NNZ):
                stop = min(self.nnz, start + CHUNK_NNZ)
                block = columns[start:stop]
                firsts = np.flatnonzero(np.concatenate([[True], block[1:] != block[:-1]]))
                blocks.append((start, stop, firsts, block[firsts]))
            self._by_column = (order, self.rows()[order], blocks)
        return self._by_column


class SparseRows:
    """A ``float32 [n, F]`` matrix in CSR: row ``i``'s non-zeros are ``data[indptr[i]:indptr[i+1]]``
    at columns ``indices[indptr[i]:indptr[i+1]]`` (strictly ascending within a row).

    Attributes:
        data: ``float32 [nnz]``.
        indices: ``int32 [nnz]`` or ``int64 [nnz]``, in ``[0, F)``.
        indptr: ``int64 [n + 1]``, rising from 0 to ``nnz``.
        shape: ``(n, F)``.

    Supports what layer 0 needs and nothing that would silently densify: ``rows[a:b]`` (views
    of the arrays, no copy of the entries), ``rows @ W`` (``float32 [n, k]``), ``rows.T @ G``
    (``float32 [F, k]``), :meth:`with_data` (same structure, other values), :meth:`toarray`.
    numpy functions refuse it rather than turn it into an object array.
    """

    __slots__ = ("data", "_structure", "_slices")
    __array_ufunc__ = None  # ndarray @ SparseRows and ufuncs raise TypeError instead of guessing

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, shape: tuple[int, int], *,
                 check: bool = True):
        shape = (int(shape[0]), int(shape[1]))
        if check:
            data, indices, indptr = _checked(data, indices, indptr, shape)
        self.data = data
        self._structure = _Structure(indptr, indices, shape)
        self._slices: dict[tuple[int, int], SparseRows] = {}

    @classmethod
    def _with_structure(cls, data: np.ndarray, structure: _Structure) -> "SparseRows":
        rows = cls.__new__(cls)
        rows.data, rows._structure, rows._slices = data, structure, {}
        return rows

    @classmethod
    def from_dense(cls, x: np.ndarray) -> "SparseRows":
        """The non-zeros of ``x`` (``[n, F]``, cast to float32), row by row."""
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"features must be a 2-D matrix, got shape {x.shape}")
        x = x.astype(np.float32, copy=False)
        rows, cols = np.nonzero(x)
        indptr = np.zeros(x.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=x.shape[0]), out=indptr[1:])
        return cls(x[rows, cols], cols.astype(index_dtype(x.shape[1])), indptr, x.shape, check=False)

    # ------------------------------------------------------------------ the arrays

    @property
    def indices(self) -> np.ndarray:
        return self._structure.indices

    @property
    def indptr(self) -> np.ndarray:
        return self._structure.indptr

    @property
    def shape(self) -> tuple[int, int]:
        return self._structure.shape

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nnz(self) -> int:
        return self._structure.nnz

    @property
    def density(self) -> float:
        """Stored entries / ``n F`` (0 for an empty matrix)."""
        size = self.shape[0] * self.shape[1]
        return self.nnz / size if size else 0.0

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.indices.nbytes + self.indptr.nbytes

    def entry_rows(self) -> np.ndarray:
        """``intp [nnz]``: the row of each stored entry (cached with the structure)."""
        return self._structure.rows()

    def column_order(self) -> np.ndarray:
        """``intp [nnz]``: the entries in column-major order (stable: rows ascend within a
        column), i.e. the CSR order of ``X^T`` (cached with the structure)."""
        return self._structure.by_column()[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"SparseRows(shape={self.shape}, nnz={self.nnz}, density={self.density:.4f})"

    # ------------------------------------------------------------------ derived matrices

    def with_data(self, data: np.ndarray) -> "SparseRows":
        """The same structure with other values ``float32 [nnz]`` (shares the cached orders)."""
        data = np.asarray(data)
        if data.shape != self.data.shape or data.dtype != np.float32:
            raise ValueError(f"data must be float32 [{self.nnz}], got {data.dtype} {list(data.shape)}")
        return SparseRows._with_structure(data, self._structure)

    def __getitem__(self, key) -> "SparseRows":
        """Rows ``[a:b]`` (a slice with step 1): views of ``data`` and ``indices``, ``indptr``
        rebased to 0. Repeated slices (a graph server's intervals) return the same object, whose
        cached orders are then computed once."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"SparseRows supports row slices [a:b] only, got {key!r}")
        a, b, _ = key.indices(self.shape[0])
        b = max(a, b)
        cached = self._slices.get((a, b))
        if cached is not None:
            return cached
        indptr = self.indptr
        lo, hi = int(indptr[a]), int(indptr[b])
        rows = SparseRows(self.data[lo:hi], self.indices[lo:hi], indptr[a:b + 1] - lo,
                          (b - a, self.shape[1]), check=False)
        if len(self._slices) >= _MAX_CACHED_SLICES:
            self._slices.clear()
        self._slices[(a, b)] = rows
        return rows

    def toarray(self) -> np.ndarray:
        """The dense ``float32 [n, F]`` matrix."""
        out = np.zeros(self.shape, dtype=np.float32)
        out[self.entry_rows(), self.indices] = self.data
        return out

    def row_normalized(self) -> "SparseRows":
        """Each row divided by its sum, rows summing to zero left as zeros: the values of
        :func:`dorylus.normalize.row_normalize` on the dense rows (sums in float64, the quotient
        rounded once to float32)."""
        rows = self.entry_rows()
        sums = np.bincount(rows, weights=self.data.astype(np.float64), minlength=self.shape[0])
        sums[sums == 0] = 1.0
        return self.with_data((self.data / sums[rows]).astype(np.float32))

    # ------------------------------------------------------------------ products

    def dense_blocks(self):
        """``(start, stop, rows)``: the matrix as dense ``float32`` row blocks of at most
        :data:`DENSE_BLOCK_ELEMENTS` entries each."""
        step = max(1, DENSE_BLOCK_ELEMENTS // max(1, self.shape[1]))
        for a in range(0, self.shape[0], step):
            b = min(a + step, self.shape[0])
            lo, hi = int(self.indptr[a]), int(self.indptr[b])
            block = np.zeros((b - a, self.shape[1]), dtype=np.float32)
            block[self.entry_rows()[lo:hi] - a, self.indices[lo:hi]] = self.data[lo:hi]
            yield a, b, block

    def products_densely(self, k: int) -> bool:
        """Whether a product with ``k`` columns is cheaper through dense row blocks and BLAS:
        gathering ``nnz x k`` terms costs more than filling ``n x F`` entries once the density
        times ``k`` reaches :data:`DENSE_ROUTE`. Measured, ``X W`` on one thread: 16K rows of 128
        columns at 7.5%, k = 16: 2.0 ms dense route, 6.6 ms sparse; 602 columns at 5%, k = 128:
        54 ms against 309 ms; but 4,096 columns at 1%, k = 16: 67 ms against 11 ms."""
        n, f = self.shape
        return n * f > 0 and len(self.data) * k >= DENSE_ROUTE * n * f

    def __matmul__(self, w: np.ndarray) -> np.ndarray:
        """``X W``: ``float32 [n, k]`` for ``w [F, k]``; row ``i`` sums its entries in CSR order
        (or, on the dense route, as BLAS does)."""
        w = _operand(w, self.shape[1], "w", "columns")
        if self.products_densely(w.shape[1]):
            out = np.empty((self.shape[0], w.shape[1]), dtype=np.float32)
            for a, b, block in self.dense_blocks():
                np.matmul(block, w, out=out[a:b])
            return out
        data, indices, indptr = self.data, self.indices, self.indptr
        out = np.zeros((self.shape[0], w.shape[1]), dtype=np.float32)
        for a, b in self._structure.row_blocks():
            lo, hi = int(indptr[a]), int(indptr[b])
            if lo == hi:
                continue
            terms = np.take(w, indices[lo:hi], axis=0)
            terms *= data[lo:hi, None]
            starts = indptr[a:b] - lo
            filled = np.flatnonzero(indptr[a + 1:b + 1] - lo > starts)  # reduceat would copy, not zero, empty rows
            out[a + filled] = np.add.reduceat(terms, starts[filled], axis=0)
        return out

    @property
    def T(self) -> "TransposedRows":
        """``X^T``, for the product ``X^T G`` only."""
        return TransposedRows(self)


class TransposedRows:
    """``X^T`` of a :class:`SparseRows` ``X``: supports ``@ G`` and nothing else."""

    __slots__ = ("rows",)
    __array_ufunc__ = None

    def __init__(self, rows: SparseRows):
        self.rows = rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.shape[1], self.rows.shape[0])

    def __matmul__(self, g: np.ndarray) -> np.ndarray:
        """``X^T G``: ``float32 [F, k]`` for ``g [n, k]``; column ``j`` sums its entries in row order."""
        x = self.rows
        g = _operand(g, x.shape[0], "grad", "rows")
        if x.products_densely(g.shape[1]):
            out = np.zeros((x.shape[1], g.shape[1]), dtype=np.float32)
            for a, b, block in x.dense_blocks():
                out += block.T @ g[a:b]
            return out
        order, rows, blocks = x._structure.by_column()
        data = x.data[order]
        out = np.zeros((x.shape[1], g.shape[1]), dtype=np.float32)
        for start, stop, firsts, columns in blocks:
            terms = np.take(g, rows[start:stop], axis=0)
            terms *= data[start:stop, None]
            # A column's run may continue into the next block: add, do not assign.
            out[columns] += np.add.reduceat(terms, firsts, axis=0)
        return out


def _operand(x: np.ndarray, rows: int, name: str, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, k] (one row per {what[:-1]} of the sparse matrix), "
                         f"got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _checked(data, indices, indptr, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three arrays after checking that they form a canonical CSR matrix of ``shape``."""
    data, indices, indptr = np.asarray(data), np.asarray(indices), np.asarray(indptr)
    n, width = shape
    if n < 0 or width < 0:
        raise ValueError(f"shape must be non-negative, got {shape}")
    if data.ndim != 1 or data.dtype != np.float32:
        raise ValueError(f"data must be 1-D float32, got {data.dtype} {list(data.shape)}")
    if indices.shape != data.shape or indices.dtype not in (np.int32, np.int64):
        raise ValueError(f"indices must be int32 or int64 of data's length {data.shape[0]}, "
                         f"got {indices.dtype} {list(indices.shape)}")
    if indptr.shape != (n + 1,) or indptr.dtype != np.int64:
        raise ValueError(f"indptr must be int64 [{n + 1}] (rows + 1), got {indptr.dtype} {list(indptr.shape)}")
    steps = np.diff(indptr)
    if indptr[0] != 0 or indptr[-1] != data.shape[0] or (steps < 0).any():
        raise ValueError(f"indptr must rise from 0 to nnz = {data.shape[0]}, got {indptr[0]} .. {indptr[-1]}"
                         + (" (falling somewhere)" if (steps < 0).any() else ""))
    if indices.size:
        if indices.min() < 0 or indices.max() >= width:
            raise ValueError(f"column indices must be in [0, {width}), got [{indices.min()}, {indices.max()}]")
        # Within a row columns ascend strictly: no duplicate entries, so every product and the
        # dense matrix agree. Only positions where a new row starts may step down.
        down = np.flatnonzero(np.diff(indices.astype(np.int64)) <= 0) + 1
        inside = ~np.isin(down, indptr[1:-1])
        if inside.any():
            where = int(down[inside][0])
            raise ValueError(f"column indices must ascend strictly within each row (entry {where} does not)")
    return data, indices, indptr


def index_dtype(width: int) -> np.dtype:
    """Column index dtype for ``width`` columns: int32 when it fits (half the bytes), else int64."""
    return np.dtype(np.int32) if width <= np.iinfo(np.int32).max else np.dtype(np.int64)


Features = Union[np.ndarray, SparseRows]


def density(x: Features) -> float:
    """Non-zeros / size of dense or sparse features (0 for an empty matrix)."""
    if isinstance(x, SparseRows):
        return x.density
    x = np.asarray(x)
    return np.count_nonzero(x) / x.size if x.size else 0.0


def use_sparse(mode: str, x_density: float) -> bool:
    """Whether features of density ``x_density`` are kept sparse under ``mode`` (:data:`SPARSE_MODES`)."""
    if mode not in SPARSE_MODES:
        raise ValueError(f"sparse_features must be one of {', '.join(SPARSE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and x_density < AUTO_MAX_DENSITY)


def in_layout(x: Features, mode: str) -> Features:
    """``x`` as :class:`SparseRows` or as a dense ``float32`` array, as ``mode`` chooses."""
    sparse = use_sparse(mode, density(x))
    if sparse:
        return x if isinstance(x, SparseRows) else SparseRows.from_dense(x)
    return to_dense(x)


def to_dense(x: Features) -> np.ndarray:
    """Dense ``float32`` rows of either layout."""
    return x.toarray() if isinstance(x, SparseRows) else np.asarray(x, dtype=np.float32)
