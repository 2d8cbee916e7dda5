"""Throughput of the graph server's Gather kernels on one partition of a real graph, and a roofline.

The graph is partitioned with METIS (``assign_parts``) and part ``--part``'s local GCN matrix is
built here as a graph server holds it: rows = the part's vertices, columns = those vertices then
their ghost in-neighbours, ``A_hat = D^-1/2 (A + I) D^-1/2`` (``D`` the in-degree + 1). Its
kernels, for each width ``d`` in ``--widths``:

* forward  ``Z = A_local · H``,   ``A_local`` CSR ``[n_owned, n_local]``, ``H`` ``[n_local, d]``;
* backward ``A_local^T · G``, the precomputed transpose ``[n_local, n_owned]``, ``G`` ``[n_owned, d]``;

each with ``dorylus.models.graph.spmm`` (torch CSR, int64 indices, float32 values: what the graph
server ran before ``kernels``), ``dorylus.models.kernels.gather`` on the unweighted int32 structure
with the two degree scales (the transpose from ``kernels.transpose_csr``), ``torch.sparse.mm``
with the same CSR tensor (no numpy round trip), ``torch.sparse.mm`` with it as a coalesced COO
tensor, and ``scipy.sparse.csr_matrix @ dense`` (scipy's kernel is single-threaded). Every kernel's result is checked against a float64 scipy
product before timing (max abs error <= 1e-5 * max |result|).

Timing: ``--warmup`` untimed calls, then ``--repeats`` rounds in which every kernel is called
once in turn (so that load from other jobs falls on all alike); ms per call is the median over
rounds. Each call allocates its output, as the graph server's does.

Throughput counts dense float32 data only: ``GB/s = (nnz * d * 4 + n_rows * d * 4) / seconds /
1e9``, one row of the dense input read per stored entry plus the output written; the CSR
structure itself (``indices`` int64 + ``values`` float32 per entry) is not counted. Ratio =
kernel ms / ``torch.sparse.mm`` CSR ms (> 1: slower).

    python benchmarks/bench_gather.py
    python benchmarks/bench_gather.py --widths 16,64,128,602 --threads 1
    python benchmarks/bench_gather.py --dataset ../shared/data/cora.npz --parts 4 --part 3

Roofline (``--roofline``, default ``2400000x16,300000x128``: ``x`` of 154 MB each, far above the
32 MB L3 here): a synthetic graph of ``N`` vertices and about ``--roofline-degree`` in-edges each,
90% to vertices within +-1000 positions of a ring and 10% uniform (a graph with locality that a
random vertex order hides), symmetric, with self loops, ``A_hat`` as above. It is timed in each of
``--orders`` (default ``random,bfs,rcm,community``): a random vertex order (what the store's ``none``
keeps of randomly numbered vertices), and the store's ``bfs``, ``rcm`` (reverse Cuthill-McKee) and
``community`` (label-propagation communities, each in reverse Cuthill-McKee order) orders of it,
each computed by ``dorylus.partition.store.locality_order`` on the loop-free structure as the
store computes a part's (its compute time is printed), against the probe
``kernels.row_read_probe``: ``nnz`` reads of uniformly random rows of the same ``x`` ``[N, d]``
in groups of the mean degree, with the same threads, prefetching and register blocking and
nothing else, timed in the same rounds. Rates count reads only, in the same units for all:
``entries x width / s`` = ``nnz * d / seconds`` and ``GB/s = nnz * d * 4 / seconds / 1e9``; fraction
= kernel rate / probe rate (the acceptance line of issue 19 asks >= 0.5 at widths 16 and 128);
``mean|i-j|`` = mean distance between an entry's row and column, the order's bandwidth.

    python benchmarks/bench_gather.py --roofline-only --roofline 2400000x16 --repeats 5
    python benchmarks/bench_gather.py --roofline-only --orders random,bfs --repeats 3

Backward (``--backward``, default ``2400000x16``): the graph server's backward Gather
``A_local^T · G`` on part 0 of ``--backward-parts`` (default 2) of the same ring graph in RCM
order, cut into contiguous ranges (``[n_owned, n_local]``, ghosts included): a gather over the
transpose from ``kernels.transpose_csr`` (what a graph server built once before; its bytes and
build time are printed) against ``kernels.gather_transpose``, the push over the forward block
that holds nothing, and on more than one thread a push with a private output per thread summed at
the end (the alternative ``gather_transpose`` does not take), on each of ``--backward-threads``
(default 1,2). Each is checked against float64 ``A^T G`` first; wall and process CPU time per call
(CPU time is less blurred by other jobs on shared cores).

    python benchmarks/bench_gather.py --backward-only --backward 2400000x16,2400000x128 --repeats 5

Prints tables and writes ``benchmarks/results/gather.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import scipy
import scipy.sparse
import torch

from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.models import kernels as gather_kernels
from dorylus.models.graph import spmm
from dorylus.partition import assign_parts
from dorylus.partition.store import locality_order as store_locality_order
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "torch.sparse.mm CSR"
RELATIVE_TOLERANCE = 1e-5  # float32 sums of a few hundred terms, in different orders
# Vertex orders of the roofline graphs: "random" is the graph as generated (randomly numbered,
# what the store's "none" keeps); "bfs", "rcm" and "community" are the store's orders of it.
ROOFLINE_ORDERS = ("random", "bfs", "rcm", "community")


def kernels(csr: torch.Tensor, lean: "LeanCsr", push: "LeanCsr | None" = None) -> dict[str, Callable[[np.ndarray], Any]]:
    """The kernels compared for one sparse matrix; each takes a float32 numpy ``[cols, d]``.
    ``push``: the forward block whose transpose ``csr`` is, for ``kernels.gather_transpose``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        coo = csr.to_sparse_coo().coalesce()
    host = scipy.sparse.csr_matrix((csr.values().numpy(), csr.col_indices().numpy(), csr.crow_indices().numpy()),
                                   shape=tuple(csr.shape))
    extra = {}
    if push is not None:
        extra["kernels.gather_transpose"] = lambda dense: gather_kernels.gather_transpose(
            push.indptr, push.indices, dense, csr.shape[0], row_scale=push.row_scale, col_scale=push.col_scale)
    return extra | {
        "graph.spmm (torch)": lambda dense: spmm(csr, dense),
        "kernels.gather": lambda dense: gather_kernels.gather(lean.indptr, lean.indices, dense,
                                                              row_scale=lean.row_scale, col_scale=lean.col_scale),
        BASELINE: lambda dense: torch.sparse.mm(csr, torch.from_numpy(dense)),
        "torch.sparse.mm COO": lambda dense: torch.sparse.mm(coo, torch.from_numpy(dense)),
        "scipy csr @ dense": lambda dense: host @ dense,
    }


def as_numpy(result: Any) -> np.ndarray:
    return result.numpy() if isinstance(result, torch.Tensor) else np.asarray(result)


def bench_direction(direction: str, csr: torch.Tensor, lean: "LeanCsr", width: int, warmup: int, repeats: int,
                    rng: np.random.Generator, push: "LeanCsr | None" = None) -> list[dict[str, Any]]:
    """Check, then time every kernel on ``csr @ dense`` with a random ``dense [cols, width]``."""
    n_rows, n_cols = csr.shape
    dense = rng.standard_normal((n_cols, width), dtype=np.float32)
    fns = kernels(csr, lean, push)
    oracle = scipy.sparse.csr_matrix(
        (csr.values().numpy().astype(np.float64), csr.col_indices().numpy(), csr.crow_indices().numpy()),
        shape=(n_rows, n_cols)) @ dense.astype(np.float64)
    scale = max(float(np.abs(oracle).max()), 1e-30)
    errors = {}
    for name, fn in fns.items():
        errors[name] = float(np.abs(as_numpy(fn(dense)) - oracle).max())
        if errors[name] > RELATIVE_TOLERANCE * scale:
            raise SystemExit(f"bench_gather: {name} ({direction}, d={width}) differs from the float64 product by "
                             f"{errors[name]:.3e} (max |result| {scale:.3e})")
    for _ in range(warmup):
        for fn in fns.values():
            fn(dense)
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(dense)
            seconds[name].append(time.perf_counter() - start)
    nnz = int(csr.values().numel())
    dense_bytes = (nnz * width + n_rows * width) * 4
    baseline = statistics.median(seconds[BASELINE])
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        rows.append({"direction": direction, "width": width, "kernel": name, "n_rows": n_rows, "n_cols": n_cols,
                     "nnz": nnz, "ms_median": 1e3 * median, "ms_min": 1e3 * min(times),
                     "gb_per_s": dense_bytes / median / 1e9, "ratio_vs_csr": median / baseline,
                     "max_abs_error_vs_float64": errors[name], "ms_per_call": [1e3 * t for t in times]})
    return rows


@dataclass
class LeanCsr:
    """The unweighted structure (int32 indices) and the two per-vertex scales of one ``A_hat`` block."""

    indptr: np.ndarray
    indices: np.ndarray
    row_scale: np.ndarray
    col_scale: np.ndarray


def csr_from_pairs(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr int64 [n_rows + 1], indices int32 [nnz])`` of the pairs, sorted by row then column."""
    order = np.argsort(rows.astype(np.int64) * n_cols + cols, kind="stable")
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    return indptr, cols[order].astype(np.int32)


def local_part(src: np.ndarray, dst: np.ndarray, num_nodes: int, parts: np.ndarray,
               part: int) -> tuple[LeanCsr, torch.Tensor, LeanCsr, torch.Tensor]:
    """Part ``part``'s ``A_hat`` block ``[n_owned, n_local]`` and its transpose, lean and as torch CSR."""
    fwd = local_block(src, dst, num_nodes, parts, part)
    n_owned, n_local = fwd.indptr.size - 1, fwd.col_scale.size
    indptr_t, indices_t, _ = gather_kernels.transpose_csr(fwd.indptr, fwd.indices, n_local)
    bwd = LeanCsr(indptr_t, indices_t, fwd.col_scale, fwd.row_scale)
    return fwd, torch_csr(fwd, (n_owned, n_local)), bwd, torch_csr(bwd, (n_local, n_owned))


def local_block(src: np.ndarray, dst: np.ndarray, num_nodes: int, parts: np.ndarray, part: int) -> LeanCsr:
    """Part ``part``'s ``A_hat`` block ``[n_owned, n_local]`` as a graph server holds it.

    Local ids: the part's vertices in global order, then ghost in-neighbours in global order.
    ``A_hat[v, u] = s_v s_u`` for each edge ``u -> v`` and ``u = v``, ``s = (in-degree + 1)^-1/2``.
    """
    scale = (1.0 / np.sqrt(np.bincount(dst, minlength=num_nodes) + 1.0)).astype(np.float32)
    owned = np.flatnonzero(parts == part)
    mine = parts[dst] == part
    e_src, e_dst = src[mine], dst[mine]
    ghosts = np.setdiff1d(np.unique(e_src), owned)
    local_ids = np.full(num_nodes, -1, np.int64)
    local_ids[owned] = np.arange(owned.size)
    local_ids[ghosts] = owned.size + np.arange(ghosts.size)
    global_ids = np.concatenate([owned, ghosts])
    rows = np.concatenate([local_ids[e_dst], np.arange(owned.size)])
    cols = np.concatenate([local_ids[e_src], np.arange(owned.size)])
    n_owned, n_local = owned.size, global_ids.size
    indptr, indices = csr_from_pairs(rows, cols, n_owned, n_local)
    return LeanCsr(indptr, indices, scale[owned], scale[global_ids])


def torch_csr(lean: LeanCsr, shape: tuple[int, int], index_type: torch.dtype = torch.int64) -> torch.Tensor:
    """The weighted torch CSR tensor (float32 values ``row_scale[r] * col_scale[c]``) of ``lean``."""
    rows = np.repeat(np.arange(shape[0]), np.diff(lean.indptr))
    values = lean.row_scale[rows] * lean.col_scale[lean.indices]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        return torch.sparse_csr_tensor(torch.from_numpy(lean.indptr).to(index_type),
                                       torch.from_numpy(lean.indices).to(index_type),
                                       torch.from_numpy(values.astype(np.float32)), shape)


# ---------------------------------------------------------------------------------- roofline

def ring_graph(n: int, degree: int, rng: np.random.Generator, window: int = 1000,
               far: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``(src, dst)`` with about ``degree`` in-edges per vertex: a ``1 - far`` share to a
    vertex within ``+-window`` ring positions, the rest uniform; no self loops (added later)."""
    half = n * degree // 2
    u = rng.integers(0, n, half)
    near = rng.random(half) >= far
    offset = rng.integers(1, window + 1, half) * rng.choice(np.array([-1, 1]), half)
    v = np.where(near, (u + offset) % n, rng.integers(0, n, half))
    keep = u != v
    key = np.unique(np.minimum(u[keep], v[keep]) * n + np.maximum(u[keep], v[keep]))
    a, b = key // n, key % n
    return np.concatenate([a, b]), np.concatenate([b, a])


def ahat_lean(src: np.ndarray, dst: np.ndarray, n: int) -> LeanCsr:
    """``A_hat`` of a symmetric graph ``[n, n]`` (with self loops) as structure + scales."""
    loops = np.arange(n)
    indptr, indices = csr_from_pairs(np.concatenate([dst, loops]), np.concatenate([src, loops]), n, n)
    scale = (1.0 / np.sqrt(np.diff(indptr).astype(np.float64))).astype(np.float32)
    return LeanCsr(indptr, indices, scale, scale)


def relabelled(src: np.ndarray, dst: np.ndarray, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The edges with vertex ``perm[i]`` renamed ``i``."""
    new = np.empty(perm.size, np.int64)
    new[perm] = np.arange(perm.size)
    return new[src], new[dst]


def roofline_size(text: str) -> tuple[int, int]:
    n, _, d = text.lower().partition("x")
    return int(n), int(d)


def roofline_list(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [roofline_size(t) for t in text.split(",") if t.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(min(s) for s in sizes) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated NxD sizes, got {text!r}")
    return sizes


def ordered_graphs(src: np.ndarray, dst: np.ndarray, n: int,
                   orders: tuple[str, ...] = ROOFLINE_ORDERS) -> tuple[dict[str, LeanCsr], dict[str, float | None]]:
    """``A_hat`` of the symmetric graph ``(src, dst)`` in each of ``orders``, and the seconds each
    order took to compute (``None`` for ``random``, the graph as given). The others come
    from the store's :func:`dorylus.partition.store.locality_order`, on the structure without self
    loops, as the store orders a part's internal edges."""
    graphs: dict[str, LeanCsr] = {}
    seconds: dict[str, float | None] = {}
    structure = None
    for name in orders:
        if name not in ROOFLINE_ORDERS:
            raise ValueError(f"unknown order {name!r}, not one of {', '.join(ROOFLINE_ORDERS)}")
        if name == "random":
            graphs[name], seconds[name] = ahat_lean(src, dst, n), None
            continue
        if structure is None:
            structure = csr_from_pairs(dst, src, n, n)
        start = time.perf_counter()
        perm = store_locality_order(structure[0], structure[1], name)
        seconds[name] = time.perf_counter() - start
        graphs[name] = ahat_lean(*relabelled(src, dst, perm), n)
        del perm
    return graphs, seconds


def bench_roofline(n: int, width: int, degree: int, warmup: int, repeats: int, rng: np.random.Generator,
                   orders: tuple[str, ...] = ROOFLINE_ORDERS) -> list[dict[str, Any]]:
    """Gather on a graph of ``n`` vertices at ``width`` in each of ``orders``, against the probe."""
    src, dst = ring_graph(n, degree, rng)
    src, dst = relabelled(src, dst, rng.permutation(n))
    graphs, order_seconds = ordered_graphs(src, dst, n, orders)
    del src, dst
    x = gather_kernels.aligned_zeros((n, width))  # rows laid out as a graph server's buffers
    x[:] = rng.standard_normal((n, width), dtype=np.float32)
    nnz = int(next(iter(graphs.values())).indptr[-1])
    probe_idx = rng.integers(0, n, nnz).astype(np.int32)
    group = max(1, round(nnz / n))
    fns: dict[str, Callable[[], Any]] = {"probe: random row reads": lambda: gather_kernels.row_read_probe(x, probe_idx, group)}
    for name, g in graphs.items():
        out = np.empty((n, width), np.float32)
        fns[f"{name}: kernels.gather"] = (lambda g=g, out=out: gather_kernels.gather(
            g.indptr, g.indices, x, row_scale=g.row_scale, col_scale=g.col_scale, out=out))
        for label, index_type in (("int32", torch.int32), ("int64", torch.int64)):
            t = torch_csr(g, (n, n), index_type)
            fns[f"{name}: torch CSR {label}"] = lambda t=t: torch.sparse.mm(t, torch.from_numpy(x))
        # check the kernel on this graph against float64 before timing
        got = gather_kernels.gather(g.indptr, g.indices, x, row_scale=g.row_scale, col_scale=g.col_scale)
        a = scipy.sparse.csr_matrix((np.repeat(g.row_scale.astype(np.float64), np.diff(g.indptr))
                                     * g.col_scale.astype(np.float64)[g.indices], g.indices, g.indptr), shape=(n, n))
        want = a @ x.astype(np.float64)
        error = float(np.abs(got - want).max())
        if error > RELATIVE_TOLERANCE * max(float(np.abs(want).max()), 1e-30):
            raise SystemExit(f"bench_gather: kernels.gather on the {name}-order graph differs from float64 by {error:.3e}")
        del a, want, got
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    probe = statistics.median(seconds["probe: random row reads"])
    bandwidth = {name: float(np.abs(np.repeat(np.arange(n), np.diff(g.indptr)) - g.indices).mean())
                 for name, g in graphs.items()}
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        order_name = name.split(":")[0]
        rows.append({"n": n, "width": width, "nnz": nnz, "x_mb": n * width * 4 / 1e6, "kernel": name,
                     "order": order_name if order_name in graphs else None,
                     "mean_abs_i_minus_j": bandwidth.get(order_name), "ms_median": 1e3 * median,
                     "ms_min": 1e3 * min(times), "entries_width_per_s": nnz * width / median,
                     "gb_per_s": nnz * width * 4 / median / 1e9, "fraction_of_probe": probe / median,
                     "order_seconds": order_seconds.get(order_name), "rcm_seconds": order_seconds.get("rcm"),
                     "ms_per_call": [1e3 * t for t in times]})
    return rows


# ---------------------------------------------------------------------------------- backward: transpose or push

def private_push(lean: LeanCsr, n_cols: int, threads: int, pool: ThreadPoolExecutor) -> Callable[[np.ndarray, np.ndarray], None]:
    """The other way to push on ``threads`` threads: each fills its own copy of the output from a
    row range of equal entries (the serial push kernel), summed at the end: ``(threads - 1) x
    n_cols x d`` floats more per call, where ``gather_transpose`` gives each thread a range of
    output rows and every thread reads all of ``indices`` instead."""
    from numba import njit

    from dorylus.models import _kernels_numba

    serial = njit(nogil=True, boundscheck=False)(_kernels_numba.scatter_kernel.py_func)
    n_rows = lean.indptr.size - 1
    bounds = np.searchsorted(lean.indptr, np.linspace(0, int(lean.indptr[-1]), threads + 1))
    bounds[0], bounds[-1] = 0, n_rows
    pieces = [(a, b, lean.indptr[a:b + 1] - lean.indptr[a], lean.indices[lean.indptr[a]:lean.indptr[b]])
              for a, b in zip(bounds[:-1], bounds[1:])]
    everything = np.array([0, n_cols], np.int64)
    empty = np.empty(0, np.float32)

    def run(g: np.ndarray, out: np.ndarray) -> None:
        copies = [out] + [np.empty_like(out) for _ in range(threads - 1)]

        def one(t: int) -> None:
            a, b, indptr, indices = pieces[t]
            serial(indptr, indices, g[a:b], empty, False, lean.row_scale[a:b], True, empty, False, everything,
                   copies[t], gather_kernels.PREFETCH_DISTANCE, False)

        list(pool.map(one, range(threads)))
        for extra in copies[1:]:
            out += extra
        out *= lean.col_scale[:, None]

    return run


def bench_backward(n: int, width: int, degree: int, parts: int, threads_list: list[int], warmup: int, repeats: int,
                   rng: np.random.Generator) -> list[dict[str, Any]]:
    """The backward Gather ``A_local^T · G`` of part 0 of a ring graph of ``n`` vertices in RCM order
    cut into ``parts`` contiguous ranges: over the transpose (built once) against the push on the
    forward block, on each thread count, with wall and CPU seconds and the bytes each needs."""
    src, dst = ring_graph(n, degree, rng)
    src, dst = relabelled(src, dst, rng.permutation(n))
    whole = ahat_lean(src, dst, n)
    src, dst = relabelled(src, dst, gather_kernels.locality_order(whole.indptr, whole.indices))
    del whole
    fwd = local_block(src, dst, n, np.arange(n) * parts // n, 0)
    del src, dst
    n_owned, n_local, nnz = fwd.indptr.size - 1, fwd.col_scale.size, int(fwd.indptr[-1])
    wall, cpu = time.perf_counter(), time.process_time()
    indptr_t, indices_t, perm = gather_kernels.transpose_csr(fwd.indptr, fwd.indices, n_local)
    build = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
             "peak_extra_mb": (perm.nbytes + n_local * 8) / 1e6}
    del perm
    held_mb = (indptr_t.nbytes + indices_t.nbytes) / 1e6
    g = rng.standard_normal((n_owned, width), dtype=np.float32)
    out = np.empty((n_local, width), np.float32)
    a = scipy.sparse.csr_matrix((np.repeat(fwd.row_scale.astype(np.float64), np.diff(fwd.indptr))
                                 * fwd.col_scale.astype(np.float64)[fwd.indices], fwd.indices, fwd.indptr),
                                shape=(n_owned, n_local))
    want = a.T @ g.astype(np.float64)
    del a
    pool = ThreadPoolExecutor(max(threads_list))
    fns: dict[tuple[int, str], tuple[Callable[[], Any], float, float]] = {}  # fn, held MB, per-call extra MB
    for threads in threads_list:
        fns[(threads, "transpose + gather")] = (lambda: gather_kernels.gather(
            indptr_t, indices_t, g, row_scale=fwd.col_scale, col_scale=fwd.row_scale, out=out), held_mb, 0.0)
        fns[(threads, "gather_transpose (push)")] = (lambda: gather_kernels.gather_transpose(
            fwd.indptr, fwd.indices, g, n_local, row_scale=fwd.row_scale, col_scale=fwd.col_scale, out=out),
            0.0, 0.0 if threads == 1 else 2 * n_local * 8 / 1e6)
        if threads > 1:
            fns[(threads, "push, output per thread")] = (partial(private_push(fwd, n_local, threads, pool), g, out),
                                                         0.0, (threads - 1) * n_local * width * 4 / 1e6)
    before = torch.get_num_threads()
    try:
        for (threads, name), (fn, _, _) in fns.items():
            torch.set_num_threads(threads)
            fn()
            error = float(np.abs(out - want).max())
            if error > RELATIVE_TOLERANCE * max(float(np.abs(want).max()), 1e-30):
                raise SystemExit(f"bench_gather: {name} on {threads} threads differs from float64 A^T G by {error:.3e}")
            for _ in range(warmup):
                fn()
        seconds = {key: ([], []) for key in fns}
        for _ in range(repeats):
            for key, (fn, _, _) in fns.items():
                torch.set_num_threads(key[0])
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                seconds[key][0].append(time.perf_counter() - wall)
                seconds[key][1].append(time.process_time() - cpu)
    finally:
        torch.set_num_threads(before)
        pool.shutdown()
    rows = []
    for (threads, name), (walls, cpus) in seconds.items():
        _, held, extra = fns[(threads, name)]
        rows.append({"n": n, "parts": parts, "width": width, "n_owned": n_owned, "n_local": n_local, "nnz": nnz,
                     "threads": threads, "kernel": name, "ms_median": 1e3 * statistics.median(walls),
                     "cpu_ms_median": 1e3 * statistics.median(cpus), "ms_min": 1e3 * min(walls),
                     "held_mb": held, "held_b_per_entry": held * 1e6 / nnz, "per_call_extra_mb": extra,
                     "transpose_build": build if held else None, "ms_per_call": [1e3 * t for t in walls],
                     "cpu_ms_per_call": [1e3 * t for t in cpus]})
    return rows


def print_backward(rows: list[dict[str, Any]]) -> None:
    header = (f"{'N':>8} {'d':>4} {'nnz':>10} {'T':>2} {'kernel':<24} {'ms median':>9} {'CPU ms':>8} "
              f"{'held MB':>8} {'B/entry':>7} {'per call MB':>11} {'build s (CPU)':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        build = f"{r['transpose_build']['wall_s']:5.2f} ({r['transpose_build']['cpu_s']:.2f})" if r["transpose_build"] else ""
        print(f"{r['n']:>8} {r['width']:>4} {r['nnz']:>10} {r['threads']:>2} {r['kernel']:<24} {r['ms_median']:9.1f} "
              f"{r['cpu_ms_median']:8.1f} {r['held_mb']:8.1f} {r['held_b_per_entry']:7.2f} {r['per_call_extra_mb']:11.1f} "
              f"{build:>13}")


def print_roofline(rows: list[dict[str, Any]]) -> None:
    header = (f"{'N':>8} {'d':>4} {'x MB':>6} {'nnz':>10} {'kernel':<26} {'mean|i-j|':>10} {'order s':>7} "
              f"{'ms median':>9} {'1e9 ent*d/s':>11} {'GB/s':>6} {'of probe':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        bw = f"{r['mean_abs_i_minus_j']:10.0f}" if r["mean_abs_i_minus_j"] is not None else f"{'':>10}"
        took = f"{r['order_seconds']:7.2f}" if r.get("order_seconds") is not None else f"{'':>7}"
        print(f"{r['n']:>8} {r['width']:>4} {r['x_mb']:6.0f} {r['nnz']:>10} {r['kernel']:<26} {bw} {took} "
              f"{r['ms_median']:9.1f} {r['entries_width_per_s'] / 1e9:11.3f} {r['gb_per_s']:6.2f} "
              f"{r['fraction_of_probe']:7.2f}x")


def print_order_summary(rows: list[dict[str, Any]]) -> None:
    """One line per roofline graph: ``kernels.gather``'s fraction of the probe in each order."""
    sizes = dict.fromkeys((r["n"], r["width"]) for r in rows)
    for n, width in sizes:
        mine = [r for r in rows if (r["n"], r["width"]) == (n, width) and r["kernel"].endswith(": kernels.gather")]
        print(f"kernels.gather {n}x{width}, fraction of the probe: "
              + ", ".join(f"{r['order']} {r['fraction_of_probe']:.2f}" for r in mine))


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'direction':<9} {'d':>4} {'kernel':<22} {'rows':>7} {'cols':>7} {'nnz':>9} "
              f"{'ms median':>9} {'ms min':>8} {'GB/s':>6} {'vs CSR':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['direction']:<9} {r['width']:>4} {r['kernel']:<22} {r['n_rows']:>7} {r['n_cols']:>7} "
              f"{r['nnz']:>9} {r['ms_median']:9.3f} {r['ms_min']:8.3f} {r['gb_per_s']:6.2f} {r['ratio_vs_csr']:6.2f}x")


def width_list(text: str) -> list[int]:
    try:
        widths = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}")
    return widths


def order_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [name for name in names if name not in ROOFLINE_ORDERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"takes comma-separated orders from {', '.join(ROOFLINE_ORDERS)}, "
                                         f"got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-1m", help="dataset spec: a preset or a path (default: synthetic-1m)")
    parser.add_argument("--parts", type=positive_int, default=2, help="METIS parts (default: 2)")
    parser.add_argument("--part", type=int, default=0, help="the part whose kernels are timed (default: 0)")
    parser.add_argument("--widths", type=width_list, default=[16, 64, 128],
                        help="dense widths d, comma-separated (default: 16,64,128)")
    parser.add_argument("--roofline", type=roofline_list, default=[(2_400_000, 16), (300_000, 128)],
                        help="roofline graph sizes NxD, comma-separated (default: 2400000x16,300000x128)")
    parser.add_argument("--roofline-degree", type=positive_int, default=12,
                        help="mean in-degree of the roofline graphs, before self loops (default: 12)")
    parser.add_argument("--orders", type=order_list, default=ROOFLINE_ORDERS,
                        help=f"vertex orders of the roofline graphs, comma-separated, from "
                             f"{', '.join(ROOFLINE_ORDERS)} (random: as generated, the store's none; bfs, rcm: the "
                             f"store's orders) (default: {','.join(ROOFLINE_ORDERS)})")
    parser.add_argument("--roofline-only", action="store_true", help="skip the METIS partition kernels and the backward section")
    parser.add_argument("--no-roofline", action="store_true", help="skip the roofline")
    parser.add_argument("--backward", type=roofline_list, default=[(2_400_000, 16)],
                        help="backward-section graph sizes NxD, comma-separated (default: 2400000x16)")
    parser.add_argument("--backward-parts", type=positive_int, default=2,
                        help="parts the backward section's RCM-ordered graph is cut into (default: 2)")
    parser.add_argument("--backward-threads", type=width_list, default=[1, 2],
                        help="thread counts of the backward section, comma-separated (default: 1,2)")
    parser.add_argument("--backward-only", action="store_true", help="run the backward section alone")
    parser.add_argument("--no-backward", action="store_true", help="skip the backward section")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: all usable cores)")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed rounds (default: 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="partitioner and random dense data seed (default: 0)")
    parser.add_argument("--output", type=Path, default=RESULTS / "gather.json", help="JSON result path")
    args = parser.parse_args(argv)
    if not 0 <= args.part < args.parts:
        parser.error(f"--part must be in [0, {args.parts}), got {args.part}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.roofline_only and args.no_roofline:
        parser.error("--roofline-only and --no-roofline leave nothing to run")
    if args.backward_only and (args.no_backward or args.roofline_only):
        parser.error("--backward-only with --no-backward or --roofline-only leaves nothing to run")
    if args.backward_only:
        args.roofline_only, args.no_roofline = True, True
    run_backward = not args.no_backward and (args.backward_only or not args.roofline_only)

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"gather benchmark: {args.dataset}, part {args.part} of {args.parts} (METIS), widths {args.widths}, "
          f"{args.threads} torch threads; torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}), "
          f"scipy {scipy.__version__}, {os.cpu_count()} cpus, "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"benchmark": "gather", "dataset": args.dataset, "parts": args.parts, "part": args.part,
                              "method": "metis", "seed": args.seed, "widths": args.widths, "threads": args.threads,
                              "warmup": args.warmup, "repeats": args.repeats}
    if not args.roofline_only and not args.backward_only:
        dataset = load_dataset(args.dataset)
        parts = assign_parts(dataset.num_nodes, dataset.src, dataset.dst, args.parts, "metis", seed=args.seed)
        fwd, adj, bwd, adj_t = local_part(dataset.src, dataset.dst, dataset.num_nodes, parts, args.part)
        n_owned, n_local = adj.shape
        nnz = int(fwd.indptr[-1])
        print(f"  part {args.part}: {n_owned:,} owned + {n_local - n_owned:,} ghost rows, {nnz:,} A_hat entries",
              flush=True)
        for width in args.widths:
            rows += bench_direction("forward", adj, fwd, width, args.warmup, args.repeats, rng)
            rows += bench_direction("backward", adj_t, bwd, width, args.warmup, args.repeats, rng, push=fwd)
            print(f"  d={width}: done", flush=True)
        print()
        print(f"{dataset.name}, part {args.part} of {args.parts}; forward = A_local [n_owned, n_local] @ H, "
              f"backward = A_local^T [n_local, n_owned] @ G; median of {args.repeats} rounds after {args.warmup} warm-up.")
        print("GB/s = (nnz*d*4 bytes read + rows*d*4 bytes written) / time (dense float32 data only); "
              "vs CSR = ms / torch.sparse.mm CSR ms.")
        print(f"torch threads {args.threads}; scipy is single-threaded.")
        print_table(rows)
        result.update({"dataset_name": dataset.name, "n_owned": n_owned, "n_ghost": n_local - n_owned, "nnz": nnz})
    backward: list[dict[str, Any]] = []
    if run_backward:
        repeats = min(args.repeats, 7)
        for n, width in args.backward:
            backward += bench_backward(n, width, args.roofline_degree, args.backward_parts, args.backward_threads,
                                       min(args.warmup, 1), repeats, rng)
            print(f"  backward {n}x{width}: done", flush=True)
        print()
        print(f"Backward Gather A_local^T @ G of part 0 of {args.backward_parts} (contiguous ranges of the RCM order) of "
              f"ring graphs (mean in-degree {args.roofline_degree} + self loop): over the transpose (transpose_csr, built "
              f"once: held MB, build s) or pushed from the forward block (gather_transpose); median of {repeats} rounds, "
              f"wall and process CPU ms (all threads), output preallocated. per call MB: what a call allocates beyond "
              f"its output (the push's per-column counts on T > 1; a private output per extra thread).")
        print_backward(backward)
    roofline: list[dict[str, Any]] = []
    if not args.no_roofline:
        repeats = min(args.repeats, 7)
        for n, width in args.roofline:
            roofline += bench_roofline(n, width, args.roofline_degree, min(args.warmup, 1), repeats, rng, args.orders)
            print(f"  roofline {n}x{width}: done", flush=True)
        print()
        print(f"Roofline: ring graphs (90% of edges within +-1000 positions, 10% uniform), symmetric, self loops, "
              f"A_hat = structure + 2 scales; vertex orders {', '.join(args.orders)} (random: as generated; bfs, rcm: "
              f"dorylus.partition.store.locality_order of it, order s = its compute time); median of {repeats} rounds. "
              f"Rates count reads only: entries*d/s = nnz*d/s, GB/s = nnz*d*4/s; of probe = rate / the probe's rate "
              f"(nnz random rows of the same x, same threads); mean|i-j| = mean |row - column| of the entries.")
        print_roofline(roofline)
        print_order_summary(roofline)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus, shared: "
          f"timings are noisy)")

    result.update({
        "gb_per_s_formula": "(nnz * d * 4 + n_rows * d * 4) / median_seconds / 1e9 (dense float32 read per stored "
                            "entry + output written; CSR structure not counted)",
        "rows": rows,
        "roofline_formula": "entries_width_per_s = nnz * d / median_seconds; gb_per_s = nnz * d * 4 / median_seconds "
                            "/ 1e9; fraction_of_probe = probe median seconds / kernel median seconds",
        "roofline_degree": args.roofline_degree, "roofline_orders": list(args.orders), "roofline": roofline,
        "backward_formula": "ms/cpu_ms: median wall / process CPU time per call; held_mb: what the kernel keeps "
                            "between calls (the transpose's indptr_T + indices_T); per_call_extra_mb: allocated per "
                            "call beyond the preallocated output",
        "backward_parts": args.backward_parts, "backward": backward,
        "machine": {**machine_info(load_before, load_after), "scipy": scipy.__version__,
                    "mkl": torch.backends.mkl.is_available()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_gather: {e}")
