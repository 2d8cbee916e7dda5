"""Vertex partitioners: assign each of ``N`` vertices to one of ``P`` parts.

* ``metis``: k-way METIS on the symmetrized graph (minimizes the edge cut, so ghosts and
  Scatter traffic are few). Balanced to METIS' default tolerance (3% imbalance).
* ``random``: a seeded permutation split into ``P`` near-equal parts (sizes differ by at most
  one). The baseline with the worst cut.
* ``contiguous``: equal ranges of vertex ids (the layout of many datasets clusters related ids).
* ``ldg``, ``fennel``: the streaming partitioners of :mod:`dorylus.partition.streaming`, here
  over the in-memory edge list (``dorylus partition`` streams them from disk instead).

:func:`choose_method` is ``dorylus partition --method auto``: METIS where its estimated memory
(:func:`metis_memory_estimate`) fits the budget, else Fennel over edge chunks.

Every method returns parts that are all non-empty: a graph server with no vertices is useless.
"""

from __future__ import annotations

import os

import numpy as np

from dorylus.errors import ConfigError, DatasetError
from dorylus.normalize import sorted_unique

METHODS = ("metis", "ldg", "fennel", "random", "contiguous")

# The METIS path's peak above the loaded edge list, per adjacency entry (both directions of each
# distinct pair): 1.09 GB for synthetic-10m (400K vertices, 10.0M entries, 2 parts) but 9.3 GB for
# an ogbn-products-sized graph (2.4M vertices, 60M entries: `dorylus train --partition-method
# metis`, the coordinator's peak 9,967 MiB; pymetis 2025.2 with 64-bit idx_t), i.e. 110 to 155
# bytes: the larger, with a margin. The in-memory edge list itself is int64 src + dst, 16 bytes
# per listed edge; features stay memory-mapped where the format allows and are not counted.
METIS_BYTES_PER_ENTRY = 160
EDGE_LIST_BYTES_PER_EDGE = 16
METIS_BYTES_PER_VERTEX = 64
# --method auto's default budget: this share of MemAvailable. A quarter, because partitioning
# should not be what sizes the machine: in local mode the graph servers start right after it on
# the same box, and past this size Fennel partitions in bounded memory (an ogbn-products-sized
# graph: METIS ~10 GB, Fennel ~3 GB, on a 24 GB machine).
AUTO_MEMORY_SHARE = 0.25


def csr_index_dtype(num_nodes: int) -> np.dtype:
    """``int32`` where every vertex id fits (``N <= 2^31 - 1``), else ``int64``."""
    return np.dtype(np.int32) if int(num_nodes) <= np.iinfo(np.int32).max else np.dtype(np.int64)


# Entries sorted at a time by symmetric_csr: 16M int64 keys, a 128 MB temporary.
CSR_BLOCK_ENTRIES = 1 << 24


def symmetric_csr(
    num_nodes: int, src: np.ndarray, dst: np.ndarray, *, dtype: np.dtype | type | None = None,
    block_entries: int = CSR_BLOCK_ENTRIES,
) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the undirected simple graph underlying the edge list, as METIS wants it.

    Vertex ``v``'s neighbours are ``adjncy[xadj[v]:xadj[v+1]]`` (ascending): every ``u`` with an
    edge ``u -> v`` or ``v -> u``, each once, never ``v`` itself.

    Built one block of rows at a time: rows ``[r0, r1)`` holding about ``block_entries`` raw
    entries (both directions, duplicates included) are keyed ``(row - r0) * N + column``
    (``int64``), sorted, deduplicated and appended. Memory: the output (``4`` bytes per entry
    with ``int32``), one block's keys (``8 * block_entries`` bytes, plus a copy while
    deduplicating), one boolean pass over the edges per block, and two ``int64 [N]`` counters.
    The previous whole-graph version held ``int64 [2E]`` keys and their unique copy, about
    ``17`` bytes per entry (2.9 GB at Reddit's 114.6M edges, now 0.9 GB plus 0.3 GB of block).

    Args:
        num_nodes: ``N``.
        src, dst: integer ``[E]`` endpoints in ``[0, N)``.
        dtype: index dtype of both outputs; default :func:`csr_index_dtype` (``int32`` where
            ``N`` and the entry count fit).
        block_entries: raw entries per sorted block (``>= 1``).

    Returns:
        xadj ``[N + 1]``, adjncy ``[nnz]``, both of ``dtype`` (``xadj`` is ``int64`` if ``nnz``
        does not fit ``dtype``).
    """
    n = int(num_nodes)
    index = np.dtype(dtype) if dtype is not None else csr_index_dtype(n)
    src, dst = np.asarray(src), np.asarray(dst)
    raw = np.bincount(src, minlength=n) + np.bincount(dst, minlength=n)
    loops = np.bincount(src[src == dst], minlength=n)
    raw -= 2 * loops
    del loops
    ends = np.cumsum(raw)
    total = int(ends[-1]) if n else 0
    del raw
    # Row block boundaries: whole rows, about block_entries raw entries each.
    cuts = np.searchsorted(ends, np.arange(block_entries, total, max(1, int(block_entries))), side="right")
    bounds = np.unique(np.concatenate(([0], cuts, [n]))).astype(np.int64)
    del ends, cuts
    adjncy = np.empty(total, dtype=index)
    degree = np.zeros(n, dtype=np.int64)
    filled = 0
    big = np.int64(n)
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        keys = []
        for rows, cols in ((dst, src), (src, dst)):
            mask = (rows >= r0) & (rows < r1) & (rows != cols)
            block = rows[mask].astype(np.int64)
            block -= r0
            block *= big
            block += cols[mask]
            keys.append(block)
            del mask
        keys = sorted_unique(np.concatenate(keys), in_place=True)
        row = keys // big
        degree[r0:r1] = np.bincount(row, minlength=int(r1 - r0))
        del row
        np.remainder(keys, big, out=keys)
        adjncy[filled : filled + keys.size] = keys
        filled += keys.size
        del keys
    if filled < total:  # duplicates were dropped: give the slack back
        adjncy = adjncy[:filled].copy()
    xadj_dtype = index if filled <= np.iinfo(index).max else np.dtype(np.int64)
    xadj = np.zeros(n + 1, dtype=xadj_dtype)
    np.cumsum(degree, out=xadj[1:])
    return xadj, adjncy


def metis_memory_estimate(num_nodes: int, num_edges: int, symmetric: bool) -> int:
    """Bytes the METIS path needs: ``16 E`` for the in-memory edge list,
    :data:`METIS_BYTES_PER_ENTRY` per adjacency entry (``E`` entries when the list already holds both directions of each pair, else up to
    ``2E``) and ``64 N`` of per-vertex arrays."""
    entries = num_edges if symmetric else 2 * num_edges
    return (EDGE_LIST_BYTES_PER_EDGE * num_edges + METIS_BYTES_PER_ENTRY * entries
            + METIS_BYTES_PER_VERTEX * num_nodes)


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (total physical memory where absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_method(num_nodes: int, num_edges: int, symmetric: bool, budget_bytes: int | None = None) -> tuple[str, str]:
    """``--method auto``: ``("metis", why)`` if :func:`metis_memory_estimate` is within the
    budget (default :data:`AUTO_MEMORY_SHARE` of available memory), else ``("fennel", why)``."""
    budget = int(budget_bytes if budget_bytes is not None else AUTO_MEMORY_SHARE * available_memory())
    need = metis_memory_estimate(num_nodes, num_edges, symmetric)
    method = "metis" if need <= budget else "fennel"
    verdict = "fits" if method == "metis" else "exceeds"
    return method, (f"METIS would need about {need / 2**30:.1f} GiB ({num_nodes:,} vertices, {num_edges:,} edges), "
                    f"which {verdict} the budget of {budget / 2**30:.1f} GiB: {method}")


def _fill_empty_parts(parts: np.ndarray, num_parts: int, degree: np.ndarray) -> np.ndarray:
    """Give every empty part one vertex: the lowest-degree vertex of the currently largest part.

    METIS may leave parts empty on tiny or highly disconnected graphs (an empty part costs no
    cut). Moving a low-degree vertex adds the fewest cut edges.
    """
    sizes = np.bincount(parts, minlength=num_parts)
    for empty in np.flatnonzero(sizes == 0):
        largest = int(np.argmax(sizes))
        members = np.flatnonzero(parts == largest)
        mover = members[np.argmin(degree[members])]
        parts[mover] = empty
        sizes[largest] -= 1
        sizes[empty] += 1
    return parts


def _metis(num_nodes: int, src: np.ndarray, dst: np.ndarray, num_parts: int, seed: int) -> np.ndarray:
    import pymetis

    xadj, adjncy = symmetric_csr(num_nodes, src, dst)
    # pymetis hands arrays of its idx_t to METIS without a copy and converts anything else; with
    # a 64-bit METIS build (zero_copy_dtype() == int64) convert here, once, freeing the int32.
    idx = np.dtype(pymetis.zero_copy_dtype()) if hasattr(pymetis, "zero_copy_dtype") else np.dtype(np.int64)
    xadj, adjncy = xadj.astype(idx, copy=False), adjncy.astype(idx, copy=False)
    options = pymetis.Options(seed=int(seed))
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; xadj=/adjncy= is deprecated there
        graph = {"adjacency": pymetis.CSRAdjacency(xadj, adjncy)}
    else:
        graph = {"xadj": xadj, "adjncy": adjncy}
    del adjncy
    result = pymetis.part_graph(num_parts, **graph, recursive=False, options=options)
    parts = np.asarray(result.vertex_part, dtype=np.int64)
    return _fill_empty_parts(parts, num_parts, np.diff(xadj))


def assign_parts(
    num_nodes: int, src: np.ndarray, dst: np.ndarray, num_parts: int, method: str, seed: int = 0
) -> np.ndarray:
    """Assign every vertex to a part.

    Args:
        num_nodes: ``N``.
        src, dst: ``int [E]`` edge endpoints (direction is ignored by ``metis``; unused by the
            other methods).
        num_parts: ``P`` with ``1 <= P <= N``.
        method: one of :data:`METHODS`.
        seed: seeds ``random``, METIS' own randomization and the streaming methods' fill order
            (same seed, same parts).

    Returns:
        ``int64 [N]`` part id per vertex, in ``[0, P)``; every part is non-empty.

    Raises:
        ConfigError: unknown method or ``num_parts`` out of range.
        DatasetError: edge arrays of different lengths or with ids outside ``[0, N)``.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown partitioner {method!r}; valid: {', '.join(METHODS)}")
    n = int(num_nodes)
    if not 1 <= int(num_parts) <= n:
        raise ConfigError(f"number of parts must be between 1 and the number of vertices ({n}), got {num_parts}")
    num_parts = int(num_parts)
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise DatasetError(f"edge lists src {src.shape} and dst {dst.shape} must be 1-D of equal length")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
        raise DatasetError(f"edge list has vertex ids outside [0, {n})")

    if num_parts == 1:
        return np.zeros(n, dtype=np.int64)
    if method == "contiguous":
        return np.arange(n, dtype=np.int64) * num_parts // n
    if method == "random":
        parts = np.empty(n, dtype=np.int64)
        parts[np.random.default_rng(seed).permutation(n)] = np.arange(n, dtype=np.int64) * num_parts // n
        return parts
    if method in ("ldg", "fennel"):
        from dorylus.partition.streaming import DEFAULT_CHUNK_EDGES, array_chunks, stream_assign

        # An in-memory list may list a pair once or twice; Fennel's alpha only sets the scale.
        return stream_assign(n, array_chunks(src, dst, DEFAULT_CHUNK_EDGES), num_parts, method, seed=seed,
                             num_edges=max(1, src.size // 2))
    return _metis(n, src, dst, num_parts, seed)
