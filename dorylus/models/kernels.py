r"""Gather kernels on the CPU: sparse CSR times dense rows at the memory bound.

The product, for a CSR structure ``(indptr, indices)`` of shape ``[R, C]`` with ``nnz`` entries and a
dense ``x`` ``[C, F]``:

.. math::  \mathrm{out}_r = s^{row}_r \sum_{k = p_r}^{p_{r+1} - 1} v_k \, s^{col}_{c_k} \, x_{c_k}

with ``p = indptr``, ``c = indices``, optional per-entry values ``v`` and per-vertex scales
``s^row`` ``[R]``, ``s^col`` ``[C]`` (each 1 when absent). ``A_hat = D^-1/2 (A + I) D^-1/2`` is then
the unweighted structure of ``A + I`` with ``s^row = s^col = deg^-1/2``: no per-edge weight stored.

Why a hand-written kernel: with ``x`` larger than the last-level cache every stored entry is a
random row read, so the kernel's speed is the number of row reads it keeps in flight. Each
thread walks a contiguous slice of rows (split by equal ``nnz``), keeps the row's sum for 16
features at a time in registers, and prefetches the rows of the entry ``PREFETCH_DISTANCE``
entries ahead (the out-of-order window alone holds only a few misses). Sums run in ``float32``
in CSR order within a row, so results are deterministic for a given thread count and do not
depend on it (a row is never split between threads).

The backward product ``A^T g`` (:func:`gather_transpose`) runs on ``A``'s own CSR, pushing each
row's scaled ``g[r]`` into the output rows of its entries: a graph server then holds no CSR of
``A^T`` (4 bytes per entry and a row pointer per column). A graph server usually has one thread
(cores // parts); on more, each takes a range of output rows and reads all of ``indices`` (see
the function). The push is numba's only: small products gather over a transpose on torch.

numba is imported lazily (on the first call), so modules that import this one but never call it
(the Lambda bundle ships numpy and pyzmq only) do not need it. Importing numba and loading the
cached parallel kernels costs a process 2-4 s, more than a whole small graph's training, so
products of fewer than :data:`SMALL_WORK` entries x width run on torch's CSR kernel and small
transposes on a numpy sort (the ``auto`` choice of ``DORYLUS_GATHER_KERNEL``; ``numba`` or
``torch`` force one). Both follow the same formula; they differ in float32 rounding only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import numpy as np

# Entries ahead whose rows are prefetched; 8-24 measured best on a 2-core EPYC (bench_gather.py).
PREFETCH_DISTANCE = 16
# Chunks per thread: rows are split by equal nnz into this many pieces per thread, taken
# dynamically, so that a thread slowed by another process's job does not hold up the call for long.
_CHUNKS_PER_THREAD = 16

# Label-propagation rounds of community_order: after five, fewer than 0.3% of the labels of an
# ogbn-products-sized part still change (1.18M, 379K, 33K, 7.6K, 2.6K changes of 1.2M).
COMMUNITY_ROUNDS = 5

# Gather skips the all-zero rows of its operand when more than this share of an even sample of
# ZERO_ROWS_SAMPLE rows is zero (:func:`_live_rows`), prefetching at most this many entries ahead.
SKIP_ZERO_ROWS = 0.75
ZERO_ROWS_SAMPLE = 1024
MAX_SPARSE_DISTANCE = 1024

# Below this many stored entries x width a product runs on torch (see the module docstring):
# synthetic-small's intervals (300K entries x 16) are below it, synthetic-1m's whole parts above.
SMALL_WORK = 1 << 23
KERNEL_CHOICES = ("auto", "numba", "torch")

_lock = threading.Lock()
_numba_kernels: Any = None


def _kernels() -> Any:
    """The compiled kernels (``dorylus.models._kernels_numba``), imported on first use."""
    global _numba_kernels
    if _numba_kernels is None:
        from dorylus.models import _kernels_numba
        _numba_kernels = _kernels_numba
    return _numba_kernels


def uses_numba(work: int) -> bool:
    """Whether a product of ``work`` entries x width (or a transpose of ``work`` entries) runs on
    numba: ``DORYLUS_GATHER_KERNEL`` (:data:`KERNEL_CHOICES`, default ``auto``) decides."""
    choice = os.environ.get("DORYLUS_GATHER_KERNEL", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"DORYLUS_GATHER_KERNEL must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    return choice == "numba" or (choice == "auto" and work >= SMALL_WORK)


def _gather_torch(indptr: np.ndarray, indices: np.ndarray, x: np.ndarray, values: np.ndarray | None,
                  row_scale: np.ndarray | None, col_scale: np.ndarray | None, out: np.ndarray) -> None:
    """``gather`` through torch's CSR product: ``diag(row_scale) (V (diag(col_scale) x))``."""
    import warnings

    import torch

    nnz = int(indptr[-1])
    rows, cols = indptr.shape[0] - 1, x.shape[0]
    scaled = x if col_scale is None else x * col_scale[:, None]
    v = np.ones(nnz, np.float32) if values is None else values[:nnz]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        matrix = torch.sparse_csr_tensor(torch.from_numpy(indptr.astype(np.int64)),
                                         torch.from_numpy(indices[:nnz].astype(np.int64)), torch.from_numpy(v),
                                         size=(rows, cols), check_invariants=False)
    product = (matrix @ torch.from_numpy(scaled)).numpy()
    if row_scale is not None:
        np.multiply(product, row_scale[:, None], out=out)
    else:
        out[:] = product


# Bytes of a cache line: row buffers that Gather reads start on one (:func:`aligned_zeros`).
CACHE_LINE = 64


def aligned_zeros(shape: tuple[int, ...], dtype: Any = np.float32, align: int = CACHE_LINE) -> np.ndarray:
    """Zeros, C-contiguous, whose first byte lies on an ``align``-byte boundary.

    numpy's large arrays start 16 bytes past a page (malloc's header), so every 64-byte row
    (16 float32) straddles two cache lines and each random row read of a Gather fetches two.
    Aligned, Gather on part 0 of synthetic-products (31M entries x 16, one thread) took
    0.20-0.21 s against 0.26-0.29 s, and 0.41-0.46 s against 0.44-0.59 s beside a second
    process gathering. Pages are zeroed lazily (``np.zeros``): untouched rows cost no memory.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:  # nothing to align (numpy gives an empty view its base's address)
        return np.zeros(shape, dtype)
    raw = np.zeros(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _threads() -> int:
    import numba
    import torch
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


@contextlib.contextmanager
def _numba_threads(threads: int) -> Iterator[None]:
    """numba's threads for one call: ``threads`` of them, taking chunks dynamically (one at a time),
    so that a thread descheduled by another process's job does not hold its static share."""
    import numba
    numba.set_num_threads(threads)
    previous = numba.set_parallel_chunksize(1)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(previous)


def _as(array: Any, dtype: Any, name: str, length: int | None = None) -> np.ndarray:
    a = np.ascontiguousarray(array, dtype=dtype)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {a.shape[0]}")
    return a


def _index_array(indices: Any) -> np.ndarray:
    a = np.asarray(indices)
    if a.dtype not in (np.int32, np.int64):
        a = a.astype(np.int64)
    return _as(a, a.dtype, "indices")


def _row_bounds(indptr: np.ndarray, threads: int) -> np.ndarray:
    """``int64 [n + 1]``: row boundaries of ``n`` chunks of about equal ``nnz`` (no ``[R]`` temporary)."""
    rows = indptr.shape[0] - 1
    chunks = max(1, min(rows, threads * _CHUNKS_PER_THREAD))
    bounds = np.searchsorted(indptr, np.linspace(0, int(indptr[-1]), chunks + 1)).astype(np.int64)
    bounds[0], bounds[-1] = 0, rows
    return np.unique(np.clip(bounds, 0, rows))


def _structure(indptr: Any, indices: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """``(indptr, indices, nnz)`` checked: ``indptr`` int32/int64 from 0, at most ``len(indices)``."""
    indptr = _as(indptr, np.asarray(indptr).dtype if np.asarray(indptr).dtype in (np.int32, np.int64)
                 else np.int64, "indptr")
    if indptr.shape[0] < 1:
        raise ValueError("indptr must have at least one element (R + 1)")
    indices = _index_array(indices)
    nnz = int(indptr[-1])
    if indices.shape[0] < nnz or int(indptr[0]) != 0:
        raise ValueError(f"indptr must start at 0 and end at most at len(indices) = {indices.shape[0]}, "
                         f"got {int(indptr[0])} .. {nnz}")
    return indptr, indices, nnz


def _values(values: Any, nnz: int) -> np.ndarray:
    if values is None:
        return np.empty(0, np.float32)
    v = _as(values, np.float32, "values")
    if v.shape[0] < nnz:
        raise ValueError(f"values must have at least nnz = {nnz} entries, got {v.shape[0]}")
    return v


def _output(out: np.ndarray | None, rows: int, width: int) -> np.ndarray:
    if out is None:
        return np.empty((rows, width), np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (rows, width)
            or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous float32 array of shape {(rows, width)}")
    return out


def _entry_operands(values: Any, row_scale: Any, col_scale: Any, nnz: int, rows: int,
                    num_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values, row_scale, col_scale)`` checked as float32 of ``nnz``, ``rows`` and ``num_cols``
    entries; an absent scale is an empty array (the kernels' "none")."""
    v = _values(values, nnz)
    empty = np.empty(0, np.float32)
    rs = empty if row_scale is None else _as(row_scale, np.float32, "row_scale", rows)
    cs = empty if col_scale is None else _as(col_scale, np.float32, "col_scale", num_cols)
    return v, rs, cs


def gather(indptr: Any, indices: Any, x: Any, *, values: Any = None, row_scale: Any = None,
           col_scale: Any = None, out: np.ndarray | None = None, col_limit: int | None = None) -> np.ndarray:
    r"""``out[r] = row_scale[r] * sum_{k in [indptr[r], indptr[r+1])} values[k] * col_scale[indices[k]] * x[indices[k]]``.

    indptr: int32 or int64 ``[R + 1]``; indices: int32 (or int64) ``[nnz]``, each in ``[0, C)``;
    x: float32 ``[C, F]`` (made C-contiguous float32 if it is not); values: float32 ``[nnz]`` or
    None (= 1); row_scale: float32 ``[R]`` or None; col_scale: float32 ``[C]`` or None; out: optional
    C-contiguous float32 ``[R, F]`` to write into. Returns float32 ``[R, F]`` (``out`` if given).

    Sums are float32 in CSR order within a row; the weight of an entry is
    ``values[k] * col_scale[c]`` rounded to float32, and ``row_scale`` multiplies the finished sum.
    Runs on ``torch.get_num_threads()`` threads; calls from several Python threads are serialised
    (each already uses every core). Indices are trusted to be in range (not checked per entry).

    On numba, an ``x`` whose rows are mostly all zeros (:func:`_live_rows` decides from a sample)
    is gathered over its other rows only, with the same bits as a whole gather.

    ``col_limit`` (numba only, whatever ``DORYLUS_GATHER_KERNEL`` says): only the entries with
    ``indices[k] < col_limit <= C`` count, found per row by bisection, so each row's indices must
    be ascending; the others may lie past ``x`` (a part's ghost columns: :meth:`CsrGraph.aggregate_transpose
    <dorylus.models.graph.CsrGraph.aggregate_transpose>`).
    """
    indptr, indices, nnz = _structure(indptr, indices)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [C, F], got shape {x.shape}")
    rows = indptr.shape[0] - 1
    num_cols, width = x.shape
    v, rs, cs = _entry_operands(values, row_scale, col_scale, nnz, rows, num_cols)
    out = _output(out, rows, width)
    if rows == 0 or width == 0:
        return out
    if col_limit is not None and not 0 <= col_limit <= num_cols:
        raise ValueError(f"col_limit must be in [0, C = {num_cols}], got {col_limit}")
    if nnz == 0:
        out.fill(0.0)
        return out
    if col_limit is None and not uses_numba(nnz * width):
        _gather_torch(indptr, indices, x, None if values is None else v, None if row_scale is None else rs,
                      None if col_scale is None else cs, out)
        return out
    k = _kernels()
    threads = _threads()
    bounds = _row_bounds(indptr, threads)
    operands = (v, values is not None, cs.reshape(-1, 1), col_scale is not None, rs, row_scale is not None, bounds, out)
    col_limit = -1 if col_limit is None else col_limit
    with _lock, _numba_threads(threads):
        live, live_count = _live_rows(x)
        if live is None:
            k.gather_kernel(indptr, indices, x, *operands, PREFETCH_DISTANCE, col_limit)
        else:  # the prefetch reaches as many live rows ahead as on a dense x
            distance = min(MAX_SPARSE_DISTANCE, PREFETCH_DISTANCE * num_cols // max(1, live_count))
            k.gather_live_kernel(indptr, indices, x, live, *operands, distance, col_limit)
    return out


def _live_rows(x: np.ndarray) -> tuple[np.ndarray | None, int]:
    """``(live, count)``: ``live`` ``uint8 [C]`` is 1 where a row of ``x`` is not all zeros, and
    ``count`` its sum, when an even sample of :data:`ZERO_ROWS_SAMPLE` rows finds more than
    :data:`SKIP_ZERO_ROWS` of them zero; else ``(None, C)``.

    The backward pass's first Gather reads the loss gradient, non-zero on the train rows only (8%
    of an ogbn-products part): skipping the other rows saves most of its random reads, for one
    sequential pass over ``x`` to find them. Other operands are dense, and the sample costs them
    ``ZERO_ROWS_SAMPLE`` row reads."""
    n = x.shape[0]
    sample = x[np.linspace(0, n - 1, min(n, ZERO_ROWS_SAMPLE)).astype(np.int64)]
    if np.count_nonzero(~sample.any(axis=1)) <= SKIP_ZERO_ROWS * sample.shape[0]:
        return None, n
    live = np.empty(n, np.uint8)
    return live, int(_kernels().live_rows(x, live))


def transpose_csr(indptr: Any, indices: Any, num_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The column-major structure of ``A`` (= the CSR of ``A^T``) by a counting sort, ``O(nnz + C)``.

    indptr ``[R + 1]``, indices ``[nnz]`` in ``[0, num_cols)``. Returns ``(indptr_T, indices_T, perm)``:
    ``indptr_T`` int64 ``[C + 1]``; ``indices_T`` int32 ``[nnz]`` (int64 if ``R >= 2^31``), the row ids
    of column ``c`` in ``indices_T[indptr_T[c]:indptr_T[c + 1]]`` in increasing order;
    ``perm`` int32 ``[nnz]`` (int64 if ``nnz >= 2^31``) with ``A^T`` entry ``t`` = ``A`` entry
    ``perm[t]``, so per-entry values of ``A^T`` are ``values[perm]``. No COO coalesce: the extra
    memory is one ``int64 [C]`` cursor array.
    """
    indptr = np.ascontiguousarray(indptr)
    if indptr.dtype not in (np.int32, np.int64):
        indptr = indptr.astype(np.int64)
    indices = _index_array(indices)
    num_cols = int(num_cols)
    rows = indptr.shape[0] - 1
    nnz = int(indptr[-1]) if rows >= 0 else 0
    row_type = np.int32 if rows < 2 ** 31 else np.int64
    perm_type = np.int32 if nnz < 2 ** 31 else np.int64
    indptr_t = np.zeros(num_cols + 1, np.int64)
    if nnz == 0:
        return indptr_t, np.empty(0, row_type), np.empty(0, perm_type)
    np.cumsum(np.bincount(indices[:nnz], minlength=num_cols), out=indptr_t[1:])
    if indptr_t.shape[0] != num_cols + 1 or indptr_t[-1] != nnz:
        raise ValueError(f"indices must lie in [0, {num_cols})")
    if not uses_numba(nnz):
        # A stable sort by column keeps rows ascending within a column, as the counting sort does.
        perm = np.argsort(indices[:nnz], kind="stable").astype(perm_type)
        rows_of = np.repeat(np.arange(rows, dtype=row_type), np.diff(indptr))
        return indptr_t, rows_of[perm], perm
    indices_t = np.empty(nnz, row_type)
    perm = np.empty(nnz, perm_type)
    _kernels().transpose_fill(indptr, indices, indptr_t, indices_t, perm)
    return indptr_t, indices_t, perm


def gather_transpose(indptr: Any, indices: Any, g: Any, num_cols: int, *, values: Any = None,
                     row_scale: Any = None, col_scale: Any = None, out: np.ndarray | None = None,
                     first_col: int = 0) -> np.ndarray:
    r"""``A^T g`` for ``A = diag(row_scale) V diag(col_scale)`` ``[R, C]`` from ``A``'s own CSR.

    ``(indptr, indices, values, row_scale, col_scale)`` as for :func:`gather` with ``C = num_cols``;
    ``g`` float32 ``[R, F]``. Returns float32 ``[C, F]`` (``out`` if given):
    ``out[c] = col_scale[c] * sum_{entries k = (r, c)} values[k] * row_scale[r] * g[r]``.

    On numba a push over ``A``'s rows: each entry ``(r, c)`` adds ``values[k] row_scale[r] g[r]``
    to ``out[c]``. With ``T`` threads each owns the output rows of one of ``T`` column ranges of
    about equal entries and walks every entry, keeping those in its range: no per-thread copy of
    ``out`` (``(T - 1) C F`` floats), at the price of every thread reading all of ``indices``
    (4 B per entry, in order) and an ``int64 [C]`` count per call to split the ranges (private
    copies ran faster on 2 shared cores, 0.81 s against 1.21 s CPU for 14.9M entries x 16, but
    took 139 MB a call, more than the 77 MB transpose the push replaces: bench_gather.py). Each
    ``out[c]`` sums its terms in increasing ``r`` whatever ``T``, as :func:`gather` over the CSR of
    ``A^T`` (:func:`transpose_csr`) would, term for term: results do not depend on the thread
    count. numba only, whatever ``DORYLUS_GATHER_KERNEL`` says: torch has no row scatter near a
    pull's speed (on a 310K-entry block at width 16, one thread: ``index_add_`` 32 ms,
    ``scatter_add_`` 22 ms, a CSC product 29 ms, the CSR pull over a transpose 3.5 ms), so :class:`~dorylus.models.graph.CsrGraph` gathers small products over
    a transpose on torch instead (:func:`uses_numba` says which).

    ``first_col`` > 0: only output rows ``[first_col, C)`` are computed (``out``'s others are left
    as they are) and each row of ``A`` must be ascending: its walk starts at its first column
    ``>= first_col`` (bisection), and the threads split that range evenly by columns (no count
    per column: the range is a part's ghosts, whose entries are few).
    """
    indptr, indices, nnz = _structure(indptr, indices)
    g = np.ascontiguousarray(g, dtype=np.float32)
    rows = indptr.shape[0] - 1
    num_cols = int(num_cols)
    if g.ndim != 2 or g.shape[0] != rows:
        raise ValueError(f"g must be 2-D [R = {rows}, F], got shape {g.shape}")
    width = g.shape[1]
    v, rs, cs = _entry_operands(values, row_scale, col_scale, nnz, rows, num_cols)
    out = _output(out, num_cols, width)
    first_col = int(first_col)
    if not 0 <= first_col <= num_cols:
        raise ValueError(f"first_col must be in [0, {num_cols}], got {first_col}")
    if num_cols == first_col or width == 0:
        return out
    if nnz == 0:
        out[first_col:].fill(0.0)
        return out
    k = _kernels()
    threads = _threads()
    if threads == 1 or first_col > 0:
        bounds = np.linspace(first_col, num_cols, min(threads, num_cols - first_col) + 1).astype(np.int64)
    else:
        per_col = np.cumsum(np.bincount(indices[:nnz], minlength=num_cols))
        if per_col.shape[0] != num_cols:
            raise ValueError(f"indices must lie in [0, {num_cols})")
        bounds = np.searchsorted(per_col, np.linspace(0, nnz, threads + 1)[1:-1])
        bounds = np.unique(np.concatenate([[0], np.clip(bounds, 0, num_cols), [num_cols]]).astype(np.int64))
    with _lock, _numba_threads(threads):
        k.scatter_kernel(indptr, indices, g, v, values is not None, rs, row_scale is not None, cs,
                         col_scale is not None, bounds, out, PREFETCH_DISTANCE, first_col > 0)
    return out


def locality_order(indptr: Any, indices: Any) -> np.ndarray:
    r"""A reverse Cuthill-McKee order of a square graph: ``perm`` int64 ``[N]``, a permutation.

    ``perm[i]`` is the old id of the vertex placed at new position ``i`` (relabel with
    ``new_id[perm] = arange(N)``). The graph ``(indptr, indices)`` ``[N, N]`` is read as undirected
    through its stored entries (pass a symmetric structure for the textbook order). Each connected
    component is walked breadth-first from a minimum-degree vertex, visiting a vertex's unvisited
    neighbours by increasing degree; the whole order is then reversed. Neighbours of a vertex thus
    land close together, which keeps the rows that one output row reads near each other in ``x``.
    Cost ``O(nnz log d_max + N)`` time and ``O(N)`` extra memory.
    """
    indptr, indices = _square_structure(indptr, indices)
    return _reverse_cuthill_mckee(indptr, indices)


def _square_structure(indptr: Any, indices: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, indices)`` of an ``[n, n]`` graph as the order kernels take them, checked: they
    index their ``[n]`` arrays by its entries unchecked."""
    indptr = np.ascontiguousarray(indptr)
    if indptr.dtype not in (np.int32, np.int64):
        indptr = indptr.astype(np.int64)
    indices = _index_array(indices)
    n = indptr.shape[0] - 1
    if n <= 0:
        return indptr, indices
    nnz = int(indptr[-1])
    if int(indptr[0]) != 0 or nnz > indices.shape[0] or bool(np.any(np.diff(indptr) < 0)):
        raise ValueError(f"indptr must rise from 0 to at most len(indices) = {indices.shape[0]}")
    if nnz and (int(indices[:nnz].min()) < 0 or int(indices[:nnz].max()) >= n):
        raise ValueError(f"indices must lie in [0, {n}) for a square graph of {n} rows")
    return indptr, indices


def _reverse_cuthill_mckee(indptr: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """:func:`locality_order` of a structure :func:`_square_structure` returned."""
    if indptr.shape[0] <= 1:
        return np.empty(0, np.int64)
    return _kernels().cuthill_mckee(indptr, indices)[::-1].copy()


def community_order(indptr: Any, indices: Any, *, seed: int = 0, rounds: int = COMMUNITY_ROUNDS) -> np.ndarray:
    r"""A community order of a square graph: ``perm`` int64 ``[N]`` as :func:`locality_order`'s,
    with each community's vertices together, in reverse Cuthill-McKee order inside it.

    Communities come from asynchronous label propagation (at most ``rounds`` rounds over the
    vertices in one random order drawn from ``seed``, ties to the smallest label), read through
    the stored entries as undirected; a community sits where its first member sits in the reverse
    Cuthill-McKee order. The same graph and seed give the same order. Rows that one output row
    reads then share cache lines more often than in a band order alone: on an ogbn-products-sized
    part (1.2M owned vertices, 31M entries, 2,889 communities) a Gather took 0.204 s against
    0.262 s in reverse Cuthill-McKee order and 0.328 s in a random one (one core). Visiting in
    the band order instead lets one label flood 88% of the vertices, and the Gather gains nothing.
    Cost: ``rounds`` passes of ``O(nnz log d_max)`` after the reverse Cuthill-McKee order (about
    4 s a round on that part), ``O(N)`` extra memory.
    """
    indptr, indices = _square_structure(indptr, indices)
    band = _reverse_cuthill_mckee(indptr, indices)
    n = band.shape[0]
    if n == 0:
        return band
    visit = np.random.default_rng(seed).permutation(n)
    labels = _kernels().label_propagation(indptr, indices, visit, int(rounds), n // 1000)
    position = np.empty(n, np.int64)
    position[band] = np.arange(n)
    first = np.full(n, n, np.int64)  # each community's first position in the band order
    np.minimum.at(first, labels, position)
    # stable: inside a community the band order stays
    return band[np.argsort(first[labels[band]], kind="stable")]


def row_read_probe(x: Any, idx: Any, group: int = 16) -> np.ndarray:
    r"""The roofline probe of :func:`gather`: ``sum_k x[idx[k]]`` as float32 ``[F]``.

    Reads ``len(idx)`` rows of ``x`` ``[C, F]`` at the given (random) positions on all threads, in
    groups of ``group`` consecutive positions (as a gather reads the entries of one output row), with
    the same prefetching and 16-feature register blocking as :func:`gather` but nothing else (no
    structure, no weights, no per-row output): what one random row read costs on this machine.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    idx = _index_array(idx)
    threads = _threads()
    chunks = max(1, threads * _CHUNKS_PER_THREAD)
    bounds = np.linspace(0, idx.shape[0], chunks + 1).astype(np.int64)
    partial = np.zeros((chunks, x.shape[1]), np.float32)
    if idx.shape[0]:
        with _lock, _numba_threads(threads):
            _kernels().probe_kernel(x, idx, bounds, partial, PREFETCH_DISTANCE, max(1, int(group)))
    return partial.sum(axis=0, dtype=np.float32)
