"""The single-process PyTorch reference: the oracle the distributed engine is checked against.

It runs a model (:mod:`dorylus.models`) on the whole graph in one process with torch autograd
for the gradients: each layer is the model module's ``reference_layer``, its torch twin, in the
same order as the distributed stages (e.g. GCN's ``A_hat · (H W)`` for a layer whose input is
wider than its output), with the same keyed dropout masks (:mod:`dorylus.masks`).

Sparse input features (:class:`~dorylus.models.sparse.SparseRows`) enter as a
:class:`SparseInput`: layer 0's dropout scales its stored non-zeros (the dense mask read at those
positions) and ``H_0 W`` is torch's CSR x dense product, whose backward ``dW = H_0^T G`` runs
on the transpose's CSR, built once (torch's own CSR backward was 10x slower than that here).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from dorylus.masks import keep_at
from dorylus.models import get_model, ops
from dorylus.models.graph import CsrGraph
from dorylus.models.sparse import SparseRows
from dorylus.models.spec import ModelSpec
from dorylus.normalize import NormalizedAdjacency


def whole_graph(adj: NormalizedAdjacency, symmetric: bool = False) -> CsrGraph:
    """Every vertex's in-edges (self loops included) as one :class:`CsrGraph`; ``symmetric``:
    the pattern is (an undirected graph's), so the backward pass needs no transpose."""
    ids = np.arange(adj.num_nodes, dtype=np.int64)
    return CsrGraph(adj.indptr, adj.indices, adj.norm, adj.norm, adj.num_nodes, ids, ids, symmetric=symmetric)


class _Aggregate(torch.autograd.Function):
    """``Z = M · H``; backward ``dH = M^T · dZ``: the graph servers' own host products
    (:meth:`CsrGraph.aggregate`), so that the reference computes what they compute."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, graph: CsrGraph, kind: str) -> torch.Tensor:
        ctx.graph, ctx.kind = graph, kind
        return torch.from_numpy(graph.aggregate(kind, h.detach().numpy()))

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        return torch.from_numpy(ctx.graph.aggregate_transpose(ctx.kind, grad_z.detach().numpy())), None, None


def aggregate(graph: CsrGraph, h: torch.Tensor, kind: str = "gcn") -> torch.Tensor:
    """``M_kind · h`` with autograd (``kind``: see :mod:`dorylus.models.graph`)."""
    return _Aggregate.apply(h, graph, kind)


class SparseInput:
    """Layer 0's input ``H_0`` ``[n, F]`` as torch CSR: ``h @ W`` is differentiable in ``W``
    (never in ``H_0``: input features get no gradient); :meth:`dropout` returns the same pattern
    with dropped entries zeroed; :func:`dense_input` densifies (a layer that gathers first)."""

    def __init__(self, rows: SparseRows):
        self.shape = rows.shape
        self.rows = rows
        self.crow = torch.from_numpy(np.ascontiguousarray(rows.indptr, dtype=np.int64))
        self.col = torch.from_numpy(np.ascontiguousarray(rows.indices, dtype=np.int64))
        self.values = torch.from_numpy(np.array(rows.data))  # writable: torch warns on read-only arrays
        # X^T as CSR: the entries in column-major order, each column's run pointed to by t_crow.
        order = rows.column_order()
        t_crow = np.zeros(rows.shape[1] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows.indices, minlength=rows.shape[1]), out=t_crow[1:])
        self.t_crow, self.t_col = torch.from_numpy(t_crow), torch.from_numpy(rows.entry_rows()[order].astype(np.int64))
        self.t_order = torch.from_numpy(order)

    def dropout(self, seed: int, epoch: int, layer: int, p: float) -> "SparseInput":
        """Inverted dropout of the stored entries, keyed as :func:`dorylus.masks.keep_mask` (row = vertex id)."""
        keep = keep_at(seed, epoch, layer, self.rows.entry_rows(), self.rows.indices, self.shape[1], p)
        dropped = copy.copy(self)  # the same structure and transpose, other values
        dropped.values = self.values * torch.from_numpy(keep) * (1.0 / (1.0 - p))
        return dropped

    def matrix(self) -> torch.Tensor:
        return _csr(self.crow, self.col, self.values, self.shape)

    def to_dense(self) -> torch.Tensor:
        return self.matrix().to_dense()

    def __matmul__(self, weight: torch.Tensor) -> torch.Tensor:
        return _SparseMatmul.apply(weight, self)


class _SparseMatmul(torch.autograd.Function):
    """``Y = X W`` for sparse ``X``; backward ``dW = X^T dY`` on the transpose's CSR."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: SparseInput) -> torch.Tensor:
        ctx.x = x
        return x.matrix() @ weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = ctx.x
        transpose = _csr(x.t_crow, x.t_col, x.values[x.t_order], (x.shape[1], x.shape[0]))
        return transpose @ grad.contiguous(), None


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=shape, check_invariants=False)


def input_features(features) -> "torch.Tensor | SparseInput":
    """The reference's input: a dense ``float32 [N, F]`` tensor, or :class:`SparseInput` for
    :class:`SparseRows`."""
    if isinstance(features, SparseRows):
        return SparseInput(features)
    return torch.from_numpy(np.asarray(features, dtype=np.float32))


def dense_input(h) -> torch.Tensor:
    """``h`` as a dense tensor (a model's layer that cannot use sparse rows)."""
    return h.to_dense() if isinstance(h, SparseInput) else h


_ACTIVATIONS = {"relu": torch.relu, "elu": F.elu}


class ReferenceModel(torch.nn.Module):
    """Each layer's parameters as ``layers.<l>.<name>`` (``named_parameters``, in the spec's
    order: the parameter server's); ``forward`` returns logits ``float32 [N, C]``."""

    def __init__(self, spec: ModelSpec, seed: int):
        super().__init__()
        self.spec = spec
        self.seed = seed
        self.model = get_model(spec.arch)
        self.layers = torch.nn.ModuleList(
            # pairs, not a dict: ParameterDict sorts a dict's keys, and the order is the model's
            torch.nn.ParameterDict([(name, torch.nn.Parameter(torch.from_numpy(w))) for name, w in params.items()])
            for params in spec.init_params(seed)
        )

    def forward(self, graph: CsrGraph, features, epoch: int, training: bool) -> torch.Tensor:
        """``features``: ``float32 [N, F]`` tensor or :class:`SparseInput` (see :func:`input_features`)."""
        h = input_features(features) if isinstance(features, (np.ndarray, SparseRows)) else features
        vertex_ids = np.arange(features.shape[0])
        for layer, params in zip(self.spec.layers, self.layers):
            if training and layer.dropout > 0 and isinstance(h, SparseInput):
                h = h.dropout(self.seed, epoch, layer.index, layer.dropout)
            elif training and layer.dropout > 0:
                h = _Dropout.apply(h, vertex_ids, (self.seed, epoch, layer.index), layer.dropout)
            h = self.model.reference_layer(layer, graph, h, dict(params), (self.seed, epoch, layer.index), training)
            if layer.activation is not None:
                h = _ACTIVATIONS[layer.activation](h)
        return h


class _Dropout(torch.autograd.Function):
    """``H = X * M / (1 - p)``; backward ``dX = dH * M / (1 - p)``: :func:`dorylus.models.ops.dropout`
    both ways (the graph servers' keyed dropout; the mask is hashed again, not held)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ids: np.ndarray, key: tuple[int, int, int], p: float) -> torch.Tensor:
        ctx.args = (ids, key, p)
        return torch.from_numpy(ops.dropout(x.detach().numpy(), ids, key, p))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.from_numpy(ops.dropout(grad.detach().numpy(), *ctx.args)), None, None, None


def masked_loss(logits: torch.Tensor, labels: torch.Tensor, train_mask: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy summed over training vertices, divided by the global train count."""
    return F.cross_entropy(logits[train_mask], labels[train_mask], reduction="sum") / int(train_mask.sum())


def accuracy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    count = int(mask.sum())
    if count == 0:
        return float("nan")
    return int((logits[mask].argmax(dim=1) == labels[mask]).sum()) / count
