"""The single-process PyTorch reference: the oracle the distributed engine is checked against.

It runs the model of :mod:`dorylus.models.spec` on the whole graph in one process, in the same
order as the distributed system (:mod:`dorylus.models.gcn`: ``A_hat · (H W)`` for a layer whose
input is wider than its output, ``(A_hat · H) · W`` otherwise), with dropout masks from
:mod:`dorylus.masks` and torch autograd for gradients.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from dorylus.masks import keep_mask
from dorylus.models.gcn import projects_first
from dorylus.models.spec import ModelSpec
from dorylus.normalize import NormalizedAdjacency


class SparseAdjacency:
    """``A_hat`` and its precomputed transpose as torch CSR tensors (``[N, N]``)."""

    def __init__(self, adj: NormalizedAdjacency):
        n = adj.num_nodes
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.forward = torch.sparse_csr_tensor(
                torch.from_numpy(adj.indptr), torch.from_numpy(adj.indices), torch.from_numpy(adj.weights),
                size=(n, n), check_invariants=False,
            )
            self.transpose = self.forward.to_sparse_coo().t().to_sparse_csr()


class _Gather(torch.autograd.Function):
    """``Z = A_hat · H``; backward ``dH = A_hat^T · dZ`` with the stored transpose."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, adj: SparseAdjacency) -> torch.Tensor:
        ctx.adj = adj
        return adj.forward @ h

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        return ctx.adj.transpose @ grad_z, None


def gather(adj: SparseAdjacency, h: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(h, adj)


class ReferenceGCN(torch.nn.Module):
    """Weights ``W_l`` as parameters; ``forward`` returns logits ``float32 [N, C]``."""

    def __init__(self, spec: ModelSpec, seed: int):
        super().__init__()
        self.spec = spec
        self.seed = seed
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(w)) for w in spec.init_weights(seed)
        )

    def forward(self, adj: SparseAdjacency, features: torch.Tensor, epoch: int, training: bool) -> torch.Tensor:
        h = features
        vertex_ids = np.arange(features.shape[0])
        for layer, weight in zip(self.spec.layers, self.weights):
            if training and layer.dropout > 0:
                keep = keep_mask(self.seed, epoch, layer.index, vertex_ids, h.shape[1], layer.dropout)
                h = h * torch.from_numpy(keep) * (1.0 / (1.0 - layer.dropout))
            h = gather(adj, h @ weight) if projects_first(layer) else gather(adj, h) @ weight
            if layer.activation == "relu":
                h = torch.relu(h)
        return h


def masked_loss(logits: torch.Tensor, labels: torch.Tensor, train_mask: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy summed over training vertices, divided by the global train count."""
    return F.cross_entropy(logits[train_mask], labels[train_mask], reduction="sum") / int(train_mask.sum())


def accuracy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    count = int(mask.sum())
    if count == 0:
        return float("nan")
    return int((logits[mask].argmax(dim=1) == labels[mask]).sum()) / count
