"""A graph server's partition state: local adjacency, intervals, and the model's row buffers.

Local rows are ``[owned; ghosts]`` (see :mod:`dorylus.partition.store`). The model's plan
(:mod:`dorylus.models.base`) names the buffers; each is float32 ``[n_owned, width]``, or
``[n_local, width]`` when Gather reads it (its ghost rows come from the peers). The static
inputs ``X``, ``ids``, ``labels`` and ``split`` hold the owned rows only.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from dorylus.models.base import STATIC, Plan
from dorylus.models.gcn import encode_split
from dorylus.normalize import row_normalize
from dorylus.partition import Partition


def _csr(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # The arrays are read-only memory maps of the partition store; the matrix is never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.sparse_csr_tensor(torch.from_numpy(np.ascontiguousarray(indptr)),
                                       torch.from_numpy(np.ascontiguousarray(indices)),
                                       torch.from_numpy(np.ascontiguousarray(values)), size=shape,
                                       check_invariants=False)


def split_intervals(num_rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous, near-equal ``[start, stop)`` ranges covering ``num_rows`` rows
    (fewer when there are fewer rows than intervals; at least one)."""
    count = max(1, min(count, num_rows))
    bounds = np.linspace(0, num_rows, count + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class PartitionState:
    def __init__(self, part: Partition, plan: Plan, *, row_normalize_features: bool, num_intervals: int):
        self.part = part
        n_owned, n_local = part.n_owned, part.n_local
        self.global_ids = part.global_ids()
        self.intervals = split_intervals(n_owned, num_intervals)
        # Gather reads [owned; ghost] rows; its backward is the precomputed transpose.
        self.adj = _csr(part.indptr, part.indices, part.weights, (n_owned, n_local))
        self.adj_t = self.adj.to_sparse_coo().t().coalesce().to_sparse_csr()
        # Row blocks of A_hat, one per interval, so that each interval's Gather can run (and its
        # function start) without waiting for the others.
        self.adj_blocks = [
            _csr(part.indptr[a:b + 1] - part.indptr[a], part.indices[part.indptr[a]:part.indptr[b]],
                 part.weights[part.indptr[a]:part.indptr[b]], (b - a, n_local))
            for a, b in self.intervals
        ]
        features = np.asarray(part.features, dtype=np.float32)
        self.static = {
            "X": np.ascontiguousarray(row_normalize(features) if row_normalize_features else features),
            "ids": np.ascontiguousarray(self.global_ids[:n_owned]),
            "labels": np.ascontiguousarray(part.labels, dtype=np.int64),
            "split": encode_split(part.train_mask, part.val_mask, part.test_mask),
        }
        used = {name for stage in (*plan.train, *plan.evaluate) for name in (*stage.reads, *stage.writes)}
        self.buffers = {name: np.zeros((n_local if name in plan.ghosted else n_owned, plan.widths[name]), np.float32)
                        for name in sorted(used - set(STATIC))}

    @property
    def n_owned(self) -> int:
        return self.part.n_owned

    def rows(self, name: str) -> np.ndarray:
        """The buffer or static input ``name`` (KeyError if the model has none such)."""
        return self.static[name] if name in self.static else self.buffers[name]

    def gather(self, src: str, dst: str, interval: int) -> None:
        """GA of one interval: ``dst[rows] = A_hat[rows, :] · src`` (owned and ghost rows of src)."""
        a, b = self.intervals[interval]
        self.buffers[dst][a:b] = spmm(self.adj_blocks[interval], self.buffers[src])

    def gather_backward(self, src: str) -> np.ndarray:
        """``A_hat_local^T · src`` for all local rows, ``[n_local, width]``; the ghost rows are
        contributions that belong to other servers."""
        return spmm(self.adj_t, self.buffers[src][: self.n_owned])


def spmm(adj: torch.Tensor, dense: np.ndarray) -> np.ndarray:
    """Sparse (CSR) times dense on the CPU with torch's multi-threaded kernel, ``float32``."""
    return (adj @ torch.from_numpy(np.ascontiguousarray(dense))).numpy()
