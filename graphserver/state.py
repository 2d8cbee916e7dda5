"""A graph server's partition state: the local adjacency, the per-layer buffers and intervals.

Local rows are ``[owned; ghosts]`` (see :mod:`dorylus.partition.store`). Buffers, for a model
with layers ``0 .. L-1`` and widths ``d_l`` (``d_0 = F``):

=============  ==========================  ===============================================
buffer         shape                       meaning
=============  ==========================  ===============================================
``X``          ``[n_local, F]``            input features (ghost rows filled at setup)
``H[l]``       ``[n_local, d_l]``, l >= 1  input of layer ``l`` after its dropout
``Z[l]``       ``[n_owned, d_l]``          Gather output ``A_hat · H_l`` of owned rows
``GZ[l]``      ``[n_owned, d_l]``          ``dL/dZ_l`` (pushed by the functions of layer l)
``GH[l]``      ``[n_owned, d_l]``, l >= 1  ``dL/dH_l`` of owned rows (after backward Scatter)
=============  ==========================  ===============================================
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from dorylus.masks import keep_mask
from dorylus.models.spec import ModelSpec
from dorylus.normalize import row_normalize
from dorylus.partition import Partition
from lambdas.compute import encode_split


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
    def __init__(self, part: Partition, spec: ModelSpec, *, seed: int, row_normalize_features: bool,
                 num_intervals: int):
        self.part = part
        self.spec = spec
        self.seed = seed
        n_owned, n_local = part.n_owned, part.n_local
        self.global_ids = part.global_ids()
        self.owned_ids = np.ascontiguousarray(self.global_ids[:n_owned])
        self.intervals = split_intervals(n_owned, num_intervals)
        # Gather reads [owned; ghost] rows; its backward is the precomputed transpose.
        adj = _csr(part.indptr, part.indices, part.weights, (n_owned, n_local))
        self.adj = adj
        self.adj_t = adj.to_sparse_coo().t().coalesce().to_sparse_csr()
        # Row blocks of A_hat, one per interval, so that each interval's Gather can run (and its
        # function start) without waiting for the others.
        self.adj_blocks = [
            _csr(part.indptr[a:b + 1] - part.indptr[a], part.indices[part.indptr[a]:part.indptr[b]],
                 part.weights[part.indptr[a]:part.indptr[b]], (b - a, n_local))
            for a, b in self.intervals
        ]

        features = np.asarray(part.features, dtype=np.float32)
        self.X = np.zeros((n_local, features.shape[1]), dtype=np.float32)
        self.X[:n_owned] = row_normalize(features) if row_normalize_features else features
        self.labels = np.ascontiguousarray(part.labels, dtype=np.int64)
        self.split = encode_split(part.train_mask, part.val_mask, part.test_mask)
        dims = [layer.in_dim for layer in spec.layers]
        self.H = {l: np.zeros((n_local, dims[l]), dtype=np.float32) for l in range(1, len(dims))}
        self.Z = {l: np.zeros((n_owned, dims[l]), dtype=np.float32) for l in range(len(dims))}
        self.GZ = {l: np.zeros((n_owned, dims[l]), dtype=np.float32) for l in range(len(dims))}
        self.GH = {l: np.zeros((n_owned, dims[l]), dtype=np.float32) for l in range(1, len(dims))}
        self._z0_no_dropout: dict[int, np.ndarray] = {}

    @property
    def n_owned(self) -> int:
        return self.part.n_owned

    def gather_input(self, layer: int, epoch: int, training: bool) -> np.ndarray | None:
        """The ``[n_local, d_l]`` rows Gather reads for layer ``l``, or ``None`` when layer 0 runs
        without dropout (its result is static and cached). Layer 0 applies the input dropout to
        ``[owned; ghost]`` feature rows, keyed by global id, so every server agrees."""
        if layer > 0:
            return self.H[layer]
        p = self.spec.layers[0].dropout
        if training and p > 0:
            keep = keep_mask(self.seed, epoch, 0, self.global_ids, self.X.shape[1], p)
            return self.X * keep * np.float32(1.0 / (1.0 - p))
        return None

    def gather(self, layer: int, interval: int, source: np.ndarray | None) -> None:
        """GA of one interval: ``Z_l[rows] = A_hat[rows, :] · source``, with ``source`` from
        :meth:`gather_input`."""
        a, b = self.intervals[interval]
        if source is not None:
            self.Z[layer][a:b] = spmm(self.adj_blocks[interval], source)
            return
        if interval not in self._z0_no_dropout:
            self._z0_no_dropout[interval] = spmm(self.adj_blocks[interval], self.X)
        self.Z[0][a:b] = self._z0_no_dropout[interval]

    def gather_backward(self, layer: int) -> np.ndarray:
        """GA_BWD: ``A_hat_local^T · dL/dZ_l`` for all local rows, ``[n_local, d_l]``; ghost
        rows are contributions that belong to other servers."""
        return spmm(self.adj_t, self.GZ[layer])


def spmm(adj: torch.Tensor, dense: np.ndarray) -> np.ndarray:
    """Sparse (CSR) times dense on the CPU with torch's multi-threaded kernel, ``float32``."""
    return (adj @ torch.from_numpy(np.ascontiguousarray(dense))).numpy()
