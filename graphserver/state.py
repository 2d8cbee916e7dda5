"""A graph server's partition state: local adjacency, intervals, and the model's row buffers.

Local rows are ``[owned; ghosts]`` (see :mod:`dorylus.partition.store`). The model's plan
(:mod:`dorylus.models.base`) names the buffers; each is float32 ``[n_owned, width]``, or
``[n_local, width]`` when Gather reads it (its ghost rows come from the peers), a backward
Gather that runs as one (:meth:`PartitionState.pulls`) included. The static
inputs ``X``, ``ids``, ``labels`` and ``split`` hold the owned rows only; ``X`` is
:class:`~dorylus.models.sparse.SparseRows` when the features are kept sparse
(``sparse_features``, :func:`dorylus.models.sparse.in_layout`), whatever layout the store has.

The state also runs what reads and writes its rows in the graph server: the model's graph
stages (``GATHER``, ``GATHER_BACKWARD``), its ``VERTEX`` stages and, for the in-process backends,
its ``FUNCTION`` stages (:meth:`compute`), and it moves rows in and out for the ghost exchange,
which always carries numpy rows. Here every row is a numpy array on the host; the ``gpu``
backend's :class:`graphserver.backends.gpu_device.DeviceState` keeps them on a torch device and runs
the same stages with the models' torch twins, behind the same methods.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dorylus.data.loaders import file_backed, read_row_range, row_blocks
from dorylus.models.base import STATIC, Plan, Result, Stage
from dorylus.models.graph import CsrGraph
from dorylus.models.kernels import aligned_zeros
from dorylus.models.ops import encode_split
from dorylus.models.sparse import SparseRows, in_layout, use_sparse
from dorylus.normalize import row_normalize
from dorylus.partition import Partition


def split_intervals(num_rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous, near-equal ``[start, stop)`` ranges covering ``num_rows`` rows
    (fewer when there are fewer rows than intervals; at least one)."""
    count = max(1, min(count, num_rows))
    bounds = np.linspace(0, num_rows, count + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class StoredRows:
    """Dense feature rows left in the partition store, ``float32 [n_owned, F]``: ``rows[a:b]``
    reads them with one plain read (row-normalized when asked, per row as
    :func:`~dorylus.normalize.row_normalize` does the whole matrix), and nothing stays resident
    between reads. For a backend whose functions cache their interval's static rows (``lambda``):
    the graph server reads an interval only when a function's cache misses, instead of holding
    every row (400 B per owned vertex at 100 features) for the whole run."""

    def __init__(self, matrix: np.ndarray, normalize: bool):
        if not file_backed(matrix):
            raise ValueError("StoredRows needs a C-contiguous memory-mapped matrix (the store's features)")
        self.matrix, self.normalize = matrix, normalize
        self.shape = tuple(matrix.shape)
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"StoredRows reads contiguous row ranges, not {key!r}")
        start, stop, _ = key.indices(self.shape[0])
        rows = read_row_range(self.matrix, start, stop).astype(np.float32, copy=False)
        return row_normalize(rows, out=rows) if self.normalize else rows


# A function pulls an interval's dense static rows (a cache miss) in pulls of about this many
# bytes: the graph server then holds one pull's rows at a time, not the interval's (240 MB of
# features per interval of an ogbn-products part at 2 intervals).
STATIC_PULL_BYTES = 32 << 20


def stored_density(matrix: np.ndarray) -> float:
    """Non-zeros / size of a memory-mapped matrix, by plain reads (no page stays resident)."""
    size = int(np.prod(matrix.shape))
    return sum(int(np.count_nonzero(block)) for _, block in row_blocks(matrix)) / size if size else 0.0


def memory_figures(part: Partition, features=None, buffers: dict[str, np.ndarray] | None = None) -> dict:
    """What a graph server holds for ``part``, per structure: bytes, bytes per stored entry
    (``nnz``: in-edges with self loops) and bytes per owned vertex.

    Structures: ``indices`` (the store's, memory-mapped), ``indptr``, ``norm`` (the backward
    Gather pushes from these: no pattern of ``S^T``, except that products small enough for torch,
    under ``kernels.SMALL_WORK`` entries x width, gather over one: at most 32 MB / width),
    ``global_ids``, ``features`` (``features``, default the part's; none for :class:`StoredRows`),
    ``labels_masks``, ``exchange`` (ghost ids and send lists), ``buffers`` (the plan's row buffers, if given;
    ``ghost_rows`` is the part of them that holds ghost rows). No per-entry float exists.
    """
    nnz, n_owned, n_local = part.nnz, part.n_owned, part.n_local
    x = part.features if features is None else features
    sizes = {
        "indices": part.indices.nbytes,
        "indptr": part.indptr.nbytes,
        "norm": part.norm.nbytes,
        "global_ids": n_local * 8,
        "features": 0 if isinstance(x, StoredRows) else x.nbytes,
        "labels_masks": part.labels.nbytes + sum(getattr(part, m).nbytes for m in ("train_mask", "val_mask", "test_mask")),
        "exchange": part.ghosts.nbytes + part.send_indices.nbytes + part.ghost_offsets.nbytes + part.send_offsets.nbytes,
    }
    if buffers is not None:
        sizes["buffers"] = sum(b.nbytes for b in buffers.values())
        sizes["ghost_rows"] = sum(b.nbytes // b.shape[0] * (b.shape[0] - n_owned) for b in buffers.values()
                                  if b.shape[0] > n_owned)
    total = sum(v for k, v in sizes.items() if k != "ghost_rows")
    return {"nnz": nnz, "n_owned": n_owned, "n_local": n_local, "bytes": sizes, "total_bytes": total,
            "per_edge": {k: v / max(nnz, 1) for k, v in sizes.items()},
            "per_vertex": {k: v / max(n_owned, 1) for k, v in sizes.items()},
            "total_per_edge": total / max(nnz, 1), "total_per_vertex": total / max(n_owned, 1)}


def format_memory(figures: dict) -> str:
    """One line: total bytes per entry, then each structure's bytes per entry / per owned vertex."""
    parts = ", ".join(f"{k} {figures['per_edge'][k]:.2f}/{figures['per_vertex'][k]:.1f}"
                      for k in figures["bytes"])
    return (f"{figures['total_bytes'] / 2**20:.1f} MiB, {figures['total_per_edge']:.2f} B per entry "
            f"({figures['nnz']:,} entries, {figures['n_owned']:,} owned, {figures['n_local']:,} local; "
            f"B per entry/per owned vertex: {parts})")


class PartitionState:
    """``features_stored``: dense features stay in the store as :class:`StoredRows` (when the
    part's features are memory-mapped and ``sparse_features`` keeps them dense)."""

    def __init__(self, part: Partition, plan: Plan, *, row_normalize_features: bool, num_intervals: int,
                 sparse_features: str = "auto", features_stored: bool = False):
        self.part = part
        n_owned, n_local = part.n_owned, part.n_local
        self.global_ids = part.global_ids()
        self.intervals = split_intervals(n_owned, num_intervals)
        # Gather reads [owned; ghost] rows; each interval gathers its own rows (a row block), so
        # that its function can start without waiting for the other intervals.
        self.graph = CsrGraph(part.indptr, part.indices, part.norm[:n_owned], part.norm, n_local,
                              self.global_ids[:n_owned], self.global_ids, owned_symmetric=part.undirected)
        if features_stored and file_backed(part.features) and not use_sparse(
                sparse_features, 1.0 if sparse_features != "auto" else stored_density(part.features)):
            features = StoredRows(part.features, normalize=row_normalize_features)
        else:
            features = in_layout(part.features, sparse_features)
            if row_normalize_features:
                features = row_normalize(features)
        if features is not part.features:
            # One copy of the features per process: the store's memory map goes once the rows
            # the model reads (normalized, or in another layout) exist.
            self.part = part = dataclasses.replace(part, features=features)
        self.static = {
            "X": features if isinstance(features, (SparseRows, StoredRows)) else np.ascontiguousarray(features),
            "ids": np.ascontiguousarray(self.global_ids[:n_owned]),
            "labels": np.ascontiguousarray(part.labels, dtype=np.int64),
            "split": encode_split(part.train_mask, part.val_mask, part.test_mask),
        }
        # Rows per pull of the static inputs (all dense: X's width in float32, ids, labels, split);
        # None when X is sparse, whose rows vary in size (pulled whole).
        dense_row_bytes = sum(x[:1].nbytes for x in self.static.values() if not isinstance(x, SparseRows))
        self.static_rows_per_pull = (None if isinstance(features, SparseRows)
                                     else max(1, STATIC_PULL_BYTES // max(1, dense_row_bytes)))
        used = {name for stage in (*plan.train, *plan.evaluate) for name in (*stage.reads, *stage.writes)}
        ghosted = plan.ghosted_on(part.undirected)
        self.buffers = {name: aligned_zeros((n_local if name in ghosted else n_owned, plan.widths[name]))
                        for name in sorted(used - set(STATIC))}
        self.memory = memory_figures(part, self.static["X"], self.buffers)

    @property
    def n_owned(self) -> int:
        return self.part.n_owned

    def rows(self, name: str) -> np.ndarray:
        """The buffer or static input ``name`` (KeyError if the model has none such)."""
        return self.static[name] if name in self.static else self.buffers[name]

    def host_rows(self, name: str, start: int, stop: int):
        """Rows ``[start, stop)`` of ``name`` as the wire carries them (numpy, or ``SparseRows``)."""
        return self.rows(name)[start:stop]

    # ------------------------------------------------------------------ the model's stages

    def compute(self, model, task: str, layer: int, rows: list, params: dict[str, np.ndarray] | None,
                args: dict) -> Result:
        """``model.compute`` on rows of this state (see :meth:`interval_rows`); ``params`` (the
        layer's, by name) and the result's ``grads`` are numpy, as the parameter server has them."""
        return model.compute(task, layer, rows, params, args)

    def interval_rows(self, name: str, interval: int):
        a, b = self.intervals[interval]
        return self.rows(name)[a:b]

    def write(self, name: str, interval: int, values) -> None:
        a, b = self.intervals[interval]
        self.buffers[name][a:b] = values

    def vertex(self, model, stage: Stage, interval: int, args: dict) -> None:
        rows = [self.interval_rows(name, interval) for name in stage.reads]
        result = self.compute(model, stage.task, stage.layer, rows, None, args)
        for name, values in zip(stage.writes, result.rows):
            self.write(name, interval, values)

    def gather(self, model, stage: Stage, interval: int, args: dict) -> None:
        inputs = [self.buffers[name] for name in stage.reads]
        result = model.gather(stage.task, stage.layer, self.graph, self.intervals[interval], inputs, args)
        for name, values in zip(stage.writes, result):
            self.write(name, interval, values)

    def pulls(self, stage: Stage) -> bool:
        """``stage`` is a backward Gather that runs as a Gather here (a ``symmetric`` one on a part
        of an undirected graph, :mod:`dorylus.models.base`): Scatter of its input, then
        :meth:`gather` per interval, and no backward Scatter."""
        return stage.pulled_on(self.part.undirected)

    def gather_backward(self, model, stage: Stage, args: dict) -> list[np.ndarray]:
        """The stage's gradients for every local row (ghost rows: contributions to the peers)."""
        inputs = [self.buffers[name][: self.n_owned] if k == 0 else self.buffers[name]
                  for k, name in enumerate(stage.reads)]
        return model.gather_backward(stage.task, stage.layer, self.graph, inputs, args)

    # ------------------------------------------------------------------ ghost exchange (numpy rows)

    async def rows_for_peers(self, name: str, peers) -> dict[int, np.ndarray]:
        """Per peer, our owned rows of ``name`` that it holds as ghosts, in its order."""
        # take, not fancy indexing: 2.6x faster on 1M rows of 16 floats
        return {peer: np.take(self.buffers[name], self.part.send_rows(peer), axis=0) for peer in peers}

    def set_ghost_rows(self, name: str, peer: int, rows: np.ndarray) -> None:
        """``peer``'s rows of ``name`` into our ghost rows of it."""
        self.buffers[name][self.part.ghost_rows(peer)] = rows

    async def contributions_for_peers(self, contribution, peers) -> dict[int, np.ndarray]:
        """Per peer, the rows of a :meth:`gather_backward` result that belong to its vertices."""
        return {peer: contribution[self.part.ghost_rows(peer)] for peer in peers}

    def set_owned_rows(self, name: str, contribution) -> None:
        """Buffer ``name`` := the owned rows of a :meth:`gather_backward` result."""
        self.buffers[name][:] = contribution[: self.n_owned]

    def add_peer_contribution(self, name: str, peer: int, rows: np.ndarray) -> None:
        """``peer``'s contribution to our rows it holds as ghosts, added to ``name``."""
        self.buffers[name][self.part.send_rows(peer)] += rows
