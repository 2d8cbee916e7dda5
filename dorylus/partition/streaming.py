r"""Streaming partitioning: assign ``N`` vertices to ``P`` parts from passes over edge chunks,
then write the partition store part by part, never holding the edge set.

Assignment (:func:`stream_assign`), for each pass over the edges in chunks of at most
``chunk_edges``:

* Every edge ``{u, v}`` of the chunk is read both ways (an undirected neighbourhood). The
  chunk's vertices not yet decided in this pass are decided in ascending id, in vertex batches:
  for a batch, ``c[v, p]`` = number of ``v``'s neighbours in this chunk that are currently in
  part ``p`` (one ``np.bincount`` over the batch's edges).
* LDG (Stanton & Kliot, KDD 2012) puts ``v`` in :math:`\arg\max_p c[v,p] (1 - s_p / C)`;
  Fennel (Tsourakakis et al., WSDM 2014) in :math:`\arg\max_p c[v,p] - \alpha\gamma
  s_p^{\gamma-1}` with :math:`\gamma = 1.5`, :math:`\alpha = \sqrt{P}\, M / N^{1.5}` (``M``
  undirected edges). ``s_p`` is the part's current load and ``C = ceil((1 + imbalance) W / P)``
  (plus the heaviest vertex's weight, so that whole vertices always fit) a hard capacity: no
  part ever exceeds it (a batch that would overfill a part keeps its best-scoring vertices
  there and sends the rest to their next choice).
* Load is weighed, not counted: vertex ``v`` weighs ``w_v = dbar + d_v`` (``d_v`` its listed
  edges, either direction; ``dbar`` their mean, rounded, at least 1), ``W = sum w``. A part's
  load is thus the mean of its share of the vertices and its share of the edges: a graph
  server's memory is mostly per vertex (feature rows) and its Gather time per edge, and
  balancing vertices alone let power-law graphs pile their hubs into one part (an
  ogbn-products-sized graph, 2 parts: 48.0M against 14.4M in-edges, so one server did 3.3x
  the other's Gather). Fennel's penalty reads ``s_p`` in vertices (``load * N / W``), so
  ``alpha`` keeps its meaning. A first pass over the edges counts the degrees.
* A vertex with no decided neighbour in the chunk carries no information: in the first pass it
  goes to the emptiest parts in turn, in later passes it stays where it is.
* Later passes refine: one pass over the edges counts, for every vertex, its neighbours in each
  part (``int32 [N, P]``), then every vertex (in a seeded random order, in batches) is re-decided
  with the same score on its whole neighbourhood; it moves only for a strictly better score, and
  capacity still holds. Pass 1 decides a vertex on the neighbours of the chunk it first appears
  in, a few when chunks are small next to the graph; the refinement passes make up for that
  (on a planted 4-way partition read in chunks of 9% of the edges: Fennel's cut 0.67, 0.61,
  0.52, 0.26, 0.13 after 1, 2, 3, 5, 8 passes; random's 0.75).
  Vertices that appear in no edge are placed after pass 1, in the emptiest parts.

State: ``part_of`` (``int16`` when ``P <= 32767``), a weight (``int64``) and a decided flag
per vertex, so ``11 N`` bytes in pass 1 and ``4 P + 10`` bytes per vertex in a refinement pass, plus one chunk's edges (about ``40`` bytes per edge of the chunk for the sorted
both-ways copy and its batch temporaries).

Writing (:func:`write_streamed_store`): one pass over the edges appends each in-edge
``u -> v`` (and, for an undirected graph, ``v -> u``) to the temporary bucket file of ``v``'s
part, as ``int32`` pairs when ids fit; then, one part at a time, its bucket is read back,
deduplicated unless the input promises a simple symmetric edge list, and handed to the store
writer. Peak memory is one part's in-edges plus the per-vertex arrays.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from dorylus.data.graph import MASK_NAMES
from dorylus.data.loaders import take_rows
from dorylus.errors import ConfigError, DatasetError
from dorylus.normalize import sorted_unique

STREAMING_METHODS = ("ldg", "fennel")
DEFAULT_IMBALANCE = 0.05
DEFAULT_PASSES = 3
DEFAULT_CHUNK_EDGES = 1 << 23
FENNEL_GAMMA = 1.5

Chunks = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]
Progress = Callable[[str], None]


def _part_dtype(num_parts: int) -> np.dtype:
    return np.dtype(np.int16) if num_parts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def _batch_size(num_nodes: int, num_parts: int) -> int:
    """Vertices decided together: sizes are updated between batches only, so a batch must be
    small next to a part (1/64 of N/P) for the balance terms to stay current."""
    return int(min(1 << 15, max(64, num_nodes // (64 * num_parts))))


def check_streaming_args(num_nodes: int, num_parts: int, method: str, passes: int, imbalance: float,
                         chunk_edges: int) -> None:
    """One :class:`ConfigError` for the first bad argument of :func:`stream_assign`."""
    if method not in STREAMING_METHODS:
        raise ConfigError(f"unknown streaming partitioner {method!r}; valid: {', '.join(STREAMING_METHODS)}")
    if not 1 <= int(num_parts) <= int(num_nodes):
        raise ConfigError(f"number of parts must be between 1 and the number of vertices ({num_nodes}), got {num_parts}")
    if isinstance(passes, bool) or int(passes) < 1:
        raise ConfigError(f"passes must be an integer >= 1, got {passes!r}")
    if not (isinstance(imbalance, (int, float)) and math.isfinite(imbalance) and 0.0 <= imbalance <= 1.0):
        raise ConfigError(f"imbalance must be in [0, 1], got {imbalance!r}")
    if isinstance(chunk_edges, bool) or int(chunk_edges) < 1:
        raise ConfigError(f"chunk_edges must be an integer >= 1, got {chunk_edges!r}")


def stream_assign(
    num_nodes: int, chunks: Chunks, num_parts: int, method: str = "fennel", *, seed: int = 0,
    passes: int = DEFAULT_PASSES, imbalance: float = DEFAULT_IMBALANCE, num_edges: int | None = None,
    progress: Progress | None = None,
) -> np.ndarray:
    """Assign every vertex to one of ``num_parts`` parts from passes over edge chunks.

    Args:
        num_nodes: ``N``.
        chunks: called once per pass; yields ``(src, dst)`` integer arrays (the caller bounds
            their size). Direction is ignored.
        num_parts: ``P``, ``1 <= P <= N``.
        method: ``"ldg"`` or ``"fennel"`` (module docstring).
        seed: rotates the order in which uninformed vertices fill the parts (equal seeds, equal
            parts; the decisions themselves are deterministic).
        passes: ``>= 1``; every pass after the first re-decides each vertex (restreaming).
        imbalance: ``eps`` of the hard capacity ``ceil((1 + eps) N / P)``.
        num_edges: undirected edge count for Fennel's ``alpha`` (``E / 2`` of a list holding both
            directions); ``None`` counts the first pass' edges first (one extra pass).

    Returns:
        ``int64 [N]`` part per vertex; every part non-empty and its load (module docstring) at
        most the capacity.
    """
    n, p = int(num_nodes), int(num_parts)
    if p == 1:
        return np.zeros(n, dtype=np.int64)
    report = progress or (lambda message: None)
    start = time.perf_counter()
    weight, listed = vertex_weights(n, chunks)
    if num_edges is None:
        num_edges = listed
    capacity = load_capacity(weight, p, imbalance)
    load = _Load(weight, n, capacity, method,
                 math.sqrt(p) * max(int(num_edges or 0), 1) / n ** 1.5 if method == "fennel" else 0.0)
    report(f"{method}: degrees of {listed:,} edges ({time.perf_counter() - start:.1f} s)")
    part_of = np.full(n, -1, dtype=_part_dtype(p))
    sizes = np.zeros(p, dtype=np.int64)
    rotation = int(np.random.default_rng(seed).integers(p))
    batch = _batch_size(n, p)
    start = time.perf_counter()
    decided = np.zeros(n, dtype=np.bool_)
    seen_edges = 0
    for src, dst in chunks():
        seen_edges += int(src.shape[0])
        _assign_chunk(np.asarray(src), np.asarray(dst), part_of, sizes, decided, load, batch, rotation)
    del decided
    # Vertices in no edge: the first pass left them undecided; place them in the emptiest parts.
    loose = np.flatnonzero(part_of < 0)
    if loose.size:
        part_of[loose] = _fill(weight[loose], sizes, load, rotation)
    report(f"{method} pass 1/{passes}: {seen_edges:,} edges ({time.perf_counter() - start:.1f} s), "
           f"part loads {sizes.min():,}..{sizes.max():,} (capacity {capacity:,})")
    order = np.random.default_rng(seed).permutation(n) if passes > 1 else None
    for pass_no in range(1, passes):
        start = time.perf_counter()
        counts = _neighbour_parts(n, chunks, part_of, p)
        moved = _refine(counts, order, part_of, sizes, load, batch)
        del counts
        report(f"{method} pass {pass_no + 1}/{passes}: {moved:,} vertices moved ({time.perf_counter() - start:.1f} s), "
               f"part loads {sizes.min():,}..{sizes.max():,}")
    parts = part_of.astype(np.int64)
    _ensure_nonempty(parts, sizes, weight)
    return parts


def vertex_weights(num_nodes: int, chunks: Chunks) -> tuple[np.ndarray, int]:
    """``(w, edges)``: ``int64 [N]`` weights ``dbar + d_v`` (module docstring) from one pass,
    and the number of listed edges."""
    n = int(num_nodes)
    degree = np.zeros(n, dtype=np.int64)
    edges = 0
    for src, dst in chunks():
        src, dst = np.asarray(src), np.asarray(dst)
        edges += int(src.shape[0])
        keep = src != dst
        degree += np.bincount(src[keep], minlength=n)
        degree += np.bincount(dst[keep], minlength=n)
    degree += max(1, round(int(degree.sum()) / max(n, 1)))
    return degree, edges


def load_capacity(weight: np.ndarray, num_parts: int, imbalance: float) -> int:
    """The hard cap on a part's load: ``ceil((1 + imbalance) W / P)`` plus the heaviest weight."""
    return int(math.ceil((1.0 + imbalance) * int(weight.sum()) / num_parts)) + int(weight.max(initial=0))


class _Load:
    """What the scores and the capacity read: the weights, ``N / W`` (Fennel's loads in vertex
    units), the capacity and the method's constants."""

    def __init__(self, weight: np.ndarray, num_nodes: int, capacity: int, method: str, alpha: float):
        self.weight, self.capacity, self.method, self.alpha = weight, int(capacity), method, float(alpha)
        self.per_vertex = num_nodes / max(int(weight.sum()), 1)

    @property
    def target(self) -> int:
        """The capacity less the heaviest weight: where fills aim, so whole vertices still fit."""
        return self.capacity - int(self.weight.max(initial=0))


def _water_level(sizes: np.ndarray, count: int, capacity: int, rotation: int) -> np.ndarray:
    """How much of ``count`` units of uninformed load each part takes (``int64 [P]``, summing
    to ``count``) so that the smallest parts rise to a common level, none beyond ``capacity``;
    the last units go to the parts at the level in part order rotated by ``rotation``."""
    p = sizes.size
    room = np.maximum(capacity - sizes, 0)
    if int(room.sum()) < count:
        raise ConfigError("partition capacity too small for the vertices (raise imbalance)")

    def filled(level: int) -> int:
        return int(np.minimum(np.maximum(level - sizes, 0), room).sum())

    lo, hi = int(sizes.min()), int(capacity)  # smallest level with filled(level) >= count
    while lo < hi:
        mid = (lo + hi) // 2
        if filled(mid) >= count:
            hi = mid
        else:
            lo = mid + 1
    want = np.minimum(np.maximum(lo - 1 - sizes, 0), room)
    short = count - int(want.sum())
    if short:
        open_parts = np.flatnonzero(want < np.minimum(np.maximum(lo - sizes, 0), room))
        open_parts = open_parts[np.argsort((open_parts - rotation) % p, kind="stable")]
        want[open_parts[:short]] += 1
    return want


def _fill(weights: np.ndarray, sizes: np.ndarray, load: _Load, rotation: int) -> np.ndarray:
    """Parts for vertices of ``weights`` (no information, in order) so that part loads even out
    (:func:`_water_level` towards the target): consecutive runs, one per part; each vertex goes
    where the middle of its weight falls, so a part overshoots its share by less than one
    vertex, within the capacity's allowance. Adds the loads to ``sizes``."""
    want = _water_level(sizes, int(weights.sum()), load.target, rotation)
    ends = np.cumsum(weights)
    choice = np.searchsorted(np.cumsum(want), ends - weights / 2.0, side="right")
    choice = np.minimum(choice, sizes.size - 1)
    sizes += np.bincount(choice, weights=weights, minlength=sizes.size).astype(np.int64)
    return choice


def _scores(counts: np.ndarray, sizes: np.ndarray, load: _Load) -> np.ndarray:
    """LDG or Fennel score of every (vertex, part), ``float64 [rows, P]``; full parts ``-inf``;
    ties to the emptier part."""
    if load.method == "ldg":
        score = counts * (1.0 - sizes / load.capacity)
    else:
        score = counts - load.alpha * FENNEL_GAMMA * np.power(sizes * load.per_vertex, FENNEL_GAMMA - 1.0)
    score -= 1e-9 * sizes * load.per_vertex
    score[:, sizes >= load.capacity] = -np.inf
    return score


def _neighbour_parts(n: int, chunks: Chunks, part_of: np.ndarray, p: int) -> np.ndarray:
    """``int32 [N, P]``: for every vertex, how many of its listed neighbours (either direction)
    lie in each part, accumulated over one pass."""
    counts = np.zeros(n * p, dtype=np.int32)
    for src, dst in chunks():
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        keep = src != dst
        src, dst = src[keep], dst[keep]
        for a, b in ((src, dst), (dst, src)):
            # one bincount over all N * P cells: cheaper than np.add.at on the chunk
            counts += np.bincount(a * p + part_of[b], minlength=n * p).astype(np.int32)
    return counts.reshape(n, p)


def _refine(counts: np.ndarray, order: np.ndarray, part_of: np.ndarray, sizes: np.ndarray, load: _Load,
            batch: int) -> int:
    """Re-decide every vertex with its whole neighbourhood's parts (``counts``), in ``order``,
    ``batch`` at a time; a vertex moves only for a strictly better score. Returns the moves."""
    p = sizes.size
    moved = 0
    for lo in range(0, order.size, batch):
        vs = order[lo : lo + batch]
        current = part_of[vs].astype(np.int64)
        w = load.weight[vs]
        sizes -= np.bincount(current, weights=w, minlength=p).astype(np.int64)
        rows = counts[vs].astype(np.float64)
        score = _scores(rows, sizes, load)
        score[np.arange(vs.size), current] += 1e-6  # stay unless another part is strictly better
        lonely = ~rows.any(axis=1)
        score[lonely] = -1.0
        score[lonely, current[lonely]] = 1.0
        choice = _enforce_capacity(score, np.argmax(score, axis=1), sizes, w, load.capacity)
        moved += int(np.count_nonzero(choice != current))
        part_of[vs] = choice
        sizes += np.bincount(choice, weights=w, minlength=p).astype(np.int64)
    return moved


def _assign_chunk(src: np.ndarray, dst: np.ndarray, part_of: np.ndarray, sizes: np.ndarray, decided: np.ndarray,
                  load: _Load, batch: int, rotation: int) -> None:
    """First pass: decide the chunk's undecided vertices, ``batch`` at a time, from their
    neighbours in this chunk (module docstring)."""
    p = sizes.size
    keep = src != dst
    a = np.concatenate((src[keep], dst[keep])).astype(np.int64, copy=False)
    b = np.concatenate((dst[keep], src[keep])).astype(np.int64, copy=False)
    del keep
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    del order
    if not a.size:
        return
    first = np.empty(a.size, dtype=np.bool_)
    first[0] = True
    np.not_equal(a[1:], a[:-1], out=first[1:])
    vertices = a[first]
    del first
    vertices = vertices[~decided[vertices]]
    if not vertices.size:
        return
    for lo in range(0, vertices.size, batch):
        vs = vertices[lo : lo + batch]
        e0, e1 = np.searchsorted(a, vs[0], side="left"), np.searchsorted(a, vs[-1], side="right")
        row = np.searchsorted(vs, a[e0:e1])
        row_ok = vs[np.minimum(row, vs.size - 1)] == a[e0:e1]  # edges of decided vertices in between
        nb = part_of[b[e0:e1]].astype(np.int64)
        row_ok &= nb >= 0
        counts = np.bincount(row[row_ok] * p + nb[row_ok], minlength=vs.size * p).reshape(vs.size, p)
        del row, row_ok, nb
        informed = counts.any(axis=1)
        w = load.weight[vs]
        score = _scores(counts.astype(np.float64), sizes, load)
        choice = np.argmax(score, axis=1)
        if not informed.all():
            blind = np.flatnonzero(~informed)
            # The informed vertices' choices count against capacity before the blind fill.
            taken = sizes + np.bincount(choice[informed], weights=w[informed], minlength=p).astype(np.int64)
            taken = np.minimum(taken, load.target)
            choice[blind] = _fill(w[blind], taken, load, rotation)
            score[blind] = -1.0
            score[blind, choice[blind]] = 1.0
        choice = _enforce_capacity(score, choice, sizes, w, load.capacity)
        part_of[vs] = choice
        sizes += np.bincount(choice, weights=w, minlength=p).astype(np.int64)
        decided[vs] = True


def _enforce_capacity(score: np.ndarray, choice: np.ndarray, sizes: np.ndarray, weights: np.ndarray,
                      capacity: int) -> np.ndarray:
    """Keep each part's load within ``capacity``: where a batch's choices (of ``weights``)
    overfill a part, its best-scoring vertices stay while they fit and the others take their
    best part with room."""
    p = sizes.size
    while True:
        wanted = np.bincount(choice, weights=weights, minlength=p).astype(np.int64)
        over = np.flatnonzero(sizes + wanted > capacity)
        if not over.size:
            return choice
        for part in over:
            members = np.flatnonzero(choice == part)
            room = max(0, capacity - int(sizes[part]))
            rank = np.argsort(-score[members, part], kind="stable")
            stay = int(np.searchsorted(np.cumsum(weights[members[rank]]), room, side="right"))
            evicted = members[rank[stay:]]
            closed = np.ones(score.shape[0], dtype=np.bool_)
            closed[members[rank[:stay]]] = False
            score[closed, part] = -np.inf  # full now: nobody else in the batch may move in
            choice[evicted] = np.argmax(score[evicted], axis=1)
            if np.isinf(score[evicted, choice[evicted]]).any():
                raise ConfigError("partition capacity too small for the vertices (raise imbalance)")


def _ensure_nonempty(parts: np.ndarray, sizes: np.ndarray, weights: np.ndarray) -> None:
    """Move one vertex of the part with the most vertices into each empty part (only possible
    when N is barely above P)."""
    counts = np.bincount(parts, minlength=sizes.size)
    for empty in np.flatnonzero(counts == 0):
        largest = int(np.argmax(counts))
        v = np.flatnonzero(parts == largest)[0]
        parts[v] = empty
        counts[largest] -= 1
        counts[empty] += 1
        sizes[largest] -= weights[v]
        sizes[empty] += weights[v]


# --------------------------------------------------------------------------------------------
# quality


@dataclass
class CutStats:
    """Quality of an assignment: ``edge_cut`` = fraction of (listed, non-loop) edges whose
    endpoints lie in different parts; ``replication_factor`` = ``(N + sum_p ghosts_p) / N``,
    the average number of parts holding a copy of a vertex (its owner plus every part with an
    in-edge from it; for an undirected graph, any edge); ``balance`` = largest part over
    ``N / P``; ``edge_balance`` = the most in-edges of a part (its graph server's Gather work;
    an undirected edge is an in-edge of both ends) over the mean."""

    edge_cut: float
    cut_edges: int
    edges: int
    replication_factor: float
    ghosts: int
    balance: float
    edge_balance: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cut_stats(num_nodes: int, chunks: Chunks, parts: np.ndarray, num_parts: int, *, directed: bool = False) -> CutStats:
    """:class:`CutStats` of ``parts`` in one pass over the edge chunks. Memory: ``N * P`` flags."""
    n, p = int(num_nodes), int(num_parts)
    parts = np.asarray(parts, dtype=np.int64)
    holds = np.zeros(n * p, dtype=np.bool_)  # holds[u * P + q]: part q keeps a ghost of u
    in_edges = np.zeros(p, dtype=np.int64)
    cut = total = 0
    for src, dst in chunks():
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        keep = src != dst
        src, dst = src[keep], dst[keep]
        ps, pd = parts[src], parts[dst]
        in_edges += np.bincount(pd, minlength=p)
        if not directed:
            in_edges += np.bincount(ps, minlength=p)
        crossing = ps != pd
        total += int(src.size)
        cut += int(crossing.sum())
        holds[src[crossing] * p + pd[crossing]] = True
        if not directed:
            holds[dst[crossing] * p + ps[crossing]] = True
    ghosts = int(holds.sum())
    sizes = np.bincount(parts, minlength=p)
    return CutStats(edge_cut=cut / max(total, 1), cut_edges=cut, edges=total,
                    replication_factor=(n + ghosts) / n, ghosts=ghosts, balance=float(sizes.max() * p / n),
                    edge_balance=float(in_edges.max() * p / max(int(in_edges.sum()), 1)))


def array_chunks(src: np.ndarray, dst: np.ndarray, chunk_edges: int) -> Chunks:
    """A :data:`Chunks` over in-memory arrays, ``chunk_edges`` at a time."""

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo in range(0, src.shape[0], chunk_edges):
            yield src[lo : lo + chunk_edges], dst[lo : lo + chunk_edges]

    return chunks


# --------------------------------------------------------------------------------------------
# writing the store part by part


def _bucket_edges(stream, parts: np.ndarray, num_parts: int, tmp: Path, chunk_edges: int,
                  report: Progress) -> tuple[list[Path], np.ndarray | None, np.dtype]:
    """One pass over the edges: append in-edge ``(dst, src)`` pairs to ``tmp/part-<i>.bin``
    by the part of ``dst`` (both ways for an undirected graph unless the stream lists both
    already). Returns the bucket paths, the in-degree when the stream promises a simple
    symmetric list (else ``None``: buckets must be deduplicated first) and the pair dtype."""
    n, p = stream.num_nodes, num_parts
    ids = np.dtype(np.int32) if n <= np.iinfo(np.int32).max else np.dtype(np.int64)
    paths = [tmp / f"part-{i}.bin" for i in range(p)]
    files = [open(path, "wb") for path in paths]
    degree = np.zeros(n, dtype=np.int64) if stream.symmetric else None
    both_ways = not stream.directed and not stream.symmetric
    start, edges = time.perf_counter(), 0
    try:
        for src, dst in stream.chunks(chunk_edges):
            keep = src != dst
            src, dst = src[keep], dst[keep]
            if both_ways:
                src, dst = np.concatenate((src, dst)), np.concatenate((dst, src))
            owner = parts[dst]
            order = np.argsort(owner, kind="stable")
            pairs = np.empty((src.size, 2), dtype=ids)
            pairs[:, 0] = dst[order]
            pairs[:, 1] = src[order]
            bounds = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=p))))
            for i in range(p):
                pairs[bounds[i] : bounds[i + 1]].tofile(files[i])
            if degree is not None:
                degree += np.bincount(dst, minlength=n)
            edges += int(keep.size)
            del keep, owner, order, pairs
        report(f"bucketed {edges:,} edges into {p} parts ({time.perf_counter() - start:.1f} s)")
    finally:
        for f in files:
            f.close()
    return paths, degree, ids


def _read_bucket(path: Path, ids: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    pairs = np.fromfile(path, dtype=ids).reshape(-1, 2)
    return pairs[:, 1].astype(np.int64), pairs[:, 0].astype(np.int64)  # src, dst


def _check_finite(features: np.ndarray, owned: np.ndarray, where: str) -> None:
    """The check :meth:`GraphDataset.validate` makes, on one part's rows."""
    step = max(1, (64 << 20) // max(1, features.shape[1] * 4))
    for lo in range(0, features.shape[0], step):
        finite = np.isfinite(features[lo : lo + step])
        if not finite.all():
            row, col = np.argwhere(~finite)[0]
            raise DatasetError(f"{where}: features contain NaN or inf (first at vertex {int(owned[lo + row])}, "
                               f"column {col})")


def write_streamed_store(
    stream, parts: np.ndarray, out: Path, *, num_parts: int, method: str, seed: int, overwrite: bool = False,
    sparse_features: str = "auto", chunk_edges: int = DEFAULT_CHUNK_EDGES, tmp_dir: Path | None = None,
    progress: Progress | None = None,
) -> None:
    """Write the partition store of ``stream`` under ``parts`` without holding its edges.

    One pass buckets in-edges by owner part into temporary files (under ``tmp_dir``, default
    beside ``out``; removed at the end, also on failure); if the stream does not promise a simple
    symmetric list, each bucket is then deduplicated in place and the in-degrees counted from
    it; finally each part's bucket is read and handed to the store writer, one part at a time.
    """
    from dorylus.partition.store import StoreWriter

    report = progress or (lambda message: None)
    n, p = stream.num_nodes, int(num_parts)
    out = Path(out)
    base = Path(tmp_dir) if tmp_dir is not None else out.parent
    if not base.is_dir():
        raise ConfigError(f"temporary directory {base} does not exist")
    tmp = Path(tempfile.mkdtemp(prefix=".dorylus-buckets-", dir=base))
    try:
        paths, degree, ids = _bucket_edges(stream, parts, p, tmp, chunk_edges, report)
        if degree is None:
            start = time.perf_counter()
            degree = np.zeros(n, dtype=np.int64)
            nn = np.int64(n)
            for path in paths:
                src, dst = _read_bucket(path, ids)
                keys = sorted_unique(dst * nn + src, in_place=True)
                del src, dst
                pairs = np.empty((keys.size, 2), dtype=ids)
                pairs[:, 0], pairs[:, 1] = np.divmod(keys, nn)
                del keys
                degree += np.bincount(pairs[:, 0].astype(np.int64), minlength=n)
                pairs.tofile(path)
                del pairs
            report(f"deduplicated {p} buckets ({time.perf_counter() - start:.1f} s)")
        vertices = stream.vertex_data()
        with StoreWriter(out, num_parts=p, num_nodes=n, num_features=stream.num_features,
                         num_classes=stream.num_classes, dataset_name=stream.name, directed=stream.directed,
                         method=method, seed=seed, overwrite=overwrite, sparse_features=sparse_features,
                         num_edges=stream.num_edges if stream.num_edges >= 0 else None,
                         progress=progress) as writer:
            for i in range(p):
                start = time.perf_counter()
                owned = np.flatnonzero(parts == i).astype(np.int64)
                src, dst = _read_bucket(paths[i], ids)
                paths[i].unlink()
                # Rows of owned (ascending ids: a forward sweep over a memory-mapped matrix).
                rows = {key: take_rows(vertices[key], owned) for key in ("features", "labels", *MASK_NAMES)}
                _check_finite(rows["features"], owned, stream.where)
                writer.write_part(i, owned, src, dst, degree, parts, rows["features"], rows["labels"],
                                  rows["train_mask"], rows["val_mask"], rows["test_mask"])
                report(f"part {i}: {owned.size:,} vertices, {src.size:,} in-edges ({time.perf_counter() - start:.1f} s)")
                del owned, src, dst, rows
            writer.finish()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
