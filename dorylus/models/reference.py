"""The single-process PyTorch reference: the oracle the distributed engine is checked against.

It runs a model (:mod:`dorylus.models`) on the whole graph in one process with torch autograd
for the gradients: each layer is the model module's ``reference_layer``, its torch twin, in the
same order as the distributed stages (e.g. GCN's ``A_hat · (H W)`` for a layer whose input is
wider than its output), with the same keyed dropout masks (:mod:`dorylus.masks`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dorylus.masks import keep_mask
from dorylus.models import get_model
from dorylus.models.graph import CsrGraph
from dorylus.models.spec import ModelSpec
from dorylus.normalize import NormalizedAdjacency


def whole_graph(adj: NormalizedAdjacency) -> CsrGraph:
    """Every vertex's in-edges (self loops included) as one :class:`CsrGraph`."""
    ids = np.arange(adj.num_nodes, dtype=np.int64)
    return CsrGraph(adj.indptr, adj.indices, adj.weights, adj.num_nodes, ids, ids)


class _Aggregate(torch.autograd.Function):
    """``Z = M · H``; backward ``dH = M^T · dZ`` with the graph's transpose."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, graph: CsrGraph, kind: str) -> torch.Tensor:
        ctx.graph, ctx.kind = graph, kind
        return graph.matrix(kind) @ h

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        return ctx.graph.transpose(ctx.kind) @ grad_z, None, None


def aggregate(graph: CsrGraph, h: torch.Tensor, kind: str = "gcn") -> torch.Tensor:
    """``M_kind · h`` with autograd (``kind``: see :mod:`dorylus.models.graph`)."""
    return _Aggregate.apply(h, graph, kind)


_ACTIVATIONS = {"relu": torch.relu, "elu": F.elu}


class ReferenceModel(torch.nn.Module):
    """Each layer's weights as parameters; ``forward`` returns logits ``float32 [N, C]``."""

    def __init__(self, spec: ModelSpec, seed: int):
        super().__init__()
        self.spec = spec
        self.seed = seed
        self.model = get_model(spec.arch)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(w)) for w in spec.init_weights(seed)
        )

    def forward(self, graph: CsrGraph, features: torch.Tensor, epoch: int, training: bool) -> torch.Tensor:
        h = features
        vertex_ids = np.arange(features.shape[0])
        for layer, weight in zip(self.spec.layers, self.weights):
            if training and layer.dropout > 0:
                keep = keep_mask(self.seed, epoch, layer.index, vertex_ids, h.shape[1], layer.dropout)
                h = h * torch.from_numpy(keep) * (1.0 / (1.0 - layer.dropout))
            h = self.model.reference_layer(layer, graph, h, weight, (self.seed, epoch, layer.index), training)
            if layer.activation is not None:
                h = _ACTIVATIONS[layer.activation](h)
        return h


def masked_loss(logits: torch.Tensor, labels: torch.Tensor, train_mask: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy summed over training vertices, divided by the global train count."""
    return F.cross_entropy(logits[train_mask], labels[train_mask], reduction="sum") / int(train_mask.sum())


def accuracy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    count = int(mask.sum())
    if count == 0:
        return float("nan")
    return int((logits[mask].argmax(dim=1) == labels[mask]).sum()) / count
