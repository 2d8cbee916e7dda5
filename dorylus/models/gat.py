"""GAT (Velickovic et al., 2018): multi-head graph attention, as stages and numpy vertex functions.

Layer ``l`` with ``K`` heads of width ``F`` on ``H = dropout_l(act(Y_{l-1}))`` (``act`` is ELU;
``H_0 = dropout_0(X)``)::

    P = H W                                  [n, K, F]   (W: [in, K F])
    s_dst[v, k] = a_dst[k] · P[v, k],  s_src[u, k] = a_src[k] · P[u, k]
    e[v, u, k] = LeakyReLU_0.2(s_dst[v, k] + s_src[u, k])      for u in N(v) ∪ {v}
    alpha[v, :, k] = softmax_u(e[v, :, k]),  then attention dropout (keyed by the edge's ends)
    G[v, k] = sum_u alpha[v, u, k] P[u, k]   -> heads concatenated (hidden layers) or averaged (last)
    Y = G + b

as PyG's ``GATConv`` (bias after the heads are combined). The layer's parameters are ``weight``
``[in, K F]``, ``att_src`` and ``att_dst`` ``[K, F]`` and ``bias`` ``[K F]`` (concatenated) or
``[F]`` (averaged).

Where the work runs. ``P`` and the scores ``E = [s_dst, s_src]`` (``[n, 2K]``) are dense per-vertex
work: a function (``AV``) computes them. The edge work (scores per edge, the edge softmax, the
attention-weighted sum, and their backward) runs on the graph server inside Gather: it needs the
in-edges of each owned vertex, which only the graph server has, and per edge it keeps only ``K``
scalars, recomputed in the backward pass instead of stored, so its memory is a few ``nnz x K``
arrays for the duration of one Gather. Shipping edges to functions would move ``nnz`` rows per
epoch instead of ``n``. Ghost exchange carries the projected rows ``P`` and their scores ``E``
(the only per-vertex inputs remote edges need); the backward Scatter returns ``dP`` and ``dE`` of
ghost rows to their owners.

forward                                        backward
---------------------------------------------  -------------------------------------------------
AV   f  src, ids -> P_l, E_l                   GA_BWD g  dY_l, P_l, E_l -> dP_l, dE_l
GA   g  P_l, E_l -> G_l (edge softmax, sum)    AV_BWD f  dP_l, dE_l, dY_l, src, ids -> the
BIAS f  G_l -> Y_l = G_l + b_l                           gradients of weight, att_src, att_dst
(last: LOSS f  G_l, labels, split -> dY_l,               and bias (sum dY_l, pulled as its sum),
 the logits G_l + b_l, instead of BIAS)                  dY_{l-1} (l > 0)

The vertex functions are torch-free numpy (this module ships in the Lambda bundle); the Gather
functions use torch's kernels and run on graph servers only.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from dorylus.masks import keep_edge_mask
from dorylus.models.base import (
    FUNCTION, GATHER, GATHER_BACKWARD, PIN, STASH, Plan, Result, Stage, Work, check_params,
)
from dorylus.models import ops as numpy_ops
from dorylus.models.spec import LayerSpec, ModelSpec, glorot, zeros

NEGATIVE_SLOPE = 0.2
MULTI_HEAD = True           # heads, out_heads and attention_dropout apply (dorylus.models.spec)
HIDDEN_ACTIVATION = "elu"   # between layers, as Velickovic et al.


DESCRIPTION = "Velickovic et al., multi-head attention"
# Velickovic et al. 2018, section 3.3 (Cora): 8 heads of 8 (ELU), 1 output head, dropout 0.6 on every
# layer's input and on the attention coefficients, L2 5e-4, lr 0.005 (PyG's gat.py decays every layer).
DEFAULTS = {"hidden": 8, "heads": 8, "out_heads": 1, "dropout": 0.6, "input_dropout": 0.6, "attention_dropout": 0.6,
            "lr": 0.005, "weight_decay": 5e-4, "weight_decay_scope": "all"}


def build_plan(spec: ModelSpec) -> Plan:
    forward: list[Stage] = []
    backward: list[Stage] = []
    widths: dict[str, int] = {}
    last = len(spec.layers) - 1
    for layer in spec.layers:
        l = layer.index
        src = "X" if l == 0 else f"Y{l - 1}"
        heads = (("heads", layer.heads),)
        args = (("dropout", layer.dropout), ("act_in", spec.layers[l - 1].activation if l > 0 else None), *heads)
        edge_args = (*heads, ("concat", layer.concat), ("attention_dropout", layer.attention_dropout))
        projected = layer.heads * layer.out_dim
        widths.update({f"P{l}": projected, f"dP{l}": projected, f"E{l}": 2 * layer.heads,
                       f"dE{l}": 2 * layer.heads, f"G{l}": layer.output_width, f"dY{l}": layer.output_width})
        forward += [Stage(FUNCTION, "AV", l, (src, "ids"), (f"P{l}", f"E{l}"), PIN, args=args),
                    Stage(GATHER, "GA", l, (f"P{l}", f"E{l}"), (f"G{l}",), args=edge_args)]
        if l == last:  # the bias joins the loss's call: the logits are G + b
            forward.append(Stage(FUNCTION, "LOSS", l, (f"G{l}", "labels", "split"), (f"dY{l}",), PIN, args=heads))
        else:
            widths[f"Y{l}"] = layer.output_width
            forward.append(Stage(FUNCTION, "BIAS", l, (f"G{l}",), (f"Y{l}",), PIN, args=heads))
        backward[:0] = [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dY{l}", f"P{l}", f"E{l}"), (f"dP{l}", f"dE{l}"),
                              args=edge_args),
                        Stage(FUNCTION, "AV_BWD", l, (f"dP{l}", f"dE{l}", f"dY{l}", src, "ids"),
                              () if l == 0 else (f"dY{l - 1}",), STASH, grad=True, args=args,
                              summed=(f"dY{l}",))]  # dY: the bias gradient alone
    return Plan.of(forward, backward, widths)


def stage_work(task: str, args: dict, layer: LayerSpec, rows: float, training: bool, prepare: Work) -> Work | None:
    """The planner's cost: ``P = H W`` (``K`` heads of ``F``) and each head's two scores ``P a_dst``,
    ``P a_src``; the bias on the combined heads."""
    i, width = layer.in_dim, layer.heads * layer.out_dim
    product = Work(macs=rows * i * width)
    scores = Work(elementwise=2 * rows * width)
    bias = Work(elementwise=rows * layer.output_width)
    if task == "AV":
        return prepare + product + scores
    if task == "BIAS":
        return bias
    if task == "LOSS":
        return bias + Work(softmax=rows * layer.out_dim)
    if task == "AV_BWD":  # recompute P and the scores, their gradients into dP, dW, db, and dX above layer 0
        return (prepare + product + scores + Work(elementwise=4 * rows * width) + product + bias
                + (Work() if layer.index == 0 else product + prepare))
    return None


def gather_seconds(stage, layer: LayerSpec, nnz: float, rate, rates, training: bool) -> float:
    """The planner's cost of one (backward) Gather: one product per head at the head's width
    (twice backward: the weighted sum's gradient and the attention's) at ``rate(width)`` entries
    per second, plus the edge work on ``nnz x heads`` (``rates.attention_per_s``, and attention
    dropout's mask while training)."""
    heads, head_width = layer.heads, layer.out_dim
    forward = stage.kind == GATHER
    products = 1 if forward else 2
    seconds = products * heads * nnz * head_width / rate(head_width)
    edges = nnz * heads
    dropout = training and float(dict(stage.args).get("attention_dropout", 0.0)) > 0
    masks = (1 if forward else 2) if dropout else 0  # drawn again backward
    return seconds + edges / rates.attention_per_s[0 if forward else 1] + Work(dropout=masks * edges).seconds(rates)


def params(layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """``weight [in, K F]``, ``att_src``/``att_dst [K, F]``, ``bias [K F]`` (concatenated heads)
    or ``[F]`` (averaged), as PyG's ``GATConv`` with ``bias=True``."""
    k, f = layer.heads, layer.out_dim
    return {"weight": (layer.in_dim, k * f), "att_src": (k, f), "att_dst": (k, f), "bias": (layer.output_width,)}


def init_params(layer: LayerSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Glorot uniform for ``weight`` and for each attention vector (``[K, F]``, as PyG's), zero bias."""
    k, f = layer.heads, layer.out_dim
    weight = glorot(rng, layer.in_dim, k * f)
    att_src, att_dst = glorot(rng, k, f), glorot(rng, k, f)
    return {"weight": weight, "att_src": att_src, "att_dst": att_dst, "bias": zeros(layer.output_width)}


def _unpack(params, heads: int):
    """``weight [in, K F]``, ``att_src [K, F]``, ``att_dst [K, F]``, ``bias``, checked."""
    params = check_params(params, {"weight": (None, None), "att_src": (heads, None), "att_dst": (heads, None),
                                   "bias": (None,)}, f"gat with {heads} heads")
    weight, att_src, att_dst = params["weight"], params["att_src"], params["att_dst"]
    width = att_src.shape[1]
    if att_dst.shape[1] != width or weight.shape[1] != heads * width or params["bias"].shape[0] not in (heads * width,
                                                                                                        width):
        raise ValueError(f"gat: parameter shapes disagree: weight {tuple(weight.shape)}, att_src "
                         f"{tuple(att_src.shape)}, att_dst {tuple(att_dst.shape)}, bias {tuple(params['bias'].shape)}")
    return weight, att_src, att_dst, params["bias"]


def compute(task: str, layer: int, rows: Sequence[np.ndarray], params: dict | None, args: dict[str, Any],
            ops=numpy_ops) -> Result:
    """The tensor work of one stage on one interval (see the module docstring; ``args`` and
    ``ops`` as in :func:`dorylus.models.gcn.compute`, ``args`` with ``heads``)."""
    p, training = float(args.get("dropout", 0.0)), bool(args["training"])
    key = (int(args["seed"]), int(args["epoch"]), layer)
    act = args.get("act_in")
    weight, att_src, att_dst, bias = _unpack(params, int(args["heads"]))
    if task == "AV":
        src, ids = rows
        h = ops.check_shape(ops.prepare(src, ids, key, p, act, training), "src", (None, weight.shape[0]))
        projected = h @ weight
        per_head = projected.reshape(h.shape[0], *att_dst.shape)
        scores = ops.concat([(per_head * att_dst).sum(-1), (per_head * att_src).sum(-1)], axis=1)
        return Result([projected, scores])
    if task == "BIAS":
        return Result([ops.check_shape(rows[0], "G", (None, bias.shape[0])) + bias])
    if task == "LOSS":
        gathered, labels, split = rows
        return ops.loss_stage([ops.check_shape(gathered, "G", (None, bias.shape[0])) + bias, labels, split], args)
    if task == "AV_BWD":
        grad_p, grad_e, grad_y, src, ids = rows
        heads, width = att_dst.shape
        h = ops.check_shape(ops.prepare(src, ids, key, p, act, True), "src", (None, weight.shape[0]))
        n = h.shape[0]
        grad_p = ops.check_shape(grad_p, "dP", (n, heads * width)).reshape(n, heads, width)
        grad_e = ops.check_shape(grad_e, "dE", (n, 2 * heads))
        grad_y = ops.check_rows_or_sum(grad_y, "dY", n, bias.shape[0])
        per_head = (h @ weight).reshape(n, heads, width)
        # s_dst = P·a_dst and s_src = P·a_src feed back into P and into the attention vectors.
        grad_dst, grad_src = grad_e[:, :heads, None], grad_e[:, heads:, None]
        grad_per_head = grad_p + grad_dst * att_dst + grad_src * att_src
        grad_projected = grad_per_head.reshape(n, heads * width)
        grads = {"weight": h.T @ grad_projected, "att_src": (grad_src * per_head).sum(0),
                 "att_dst": (grad_dst * per_head).sum(0), "bias": grad_y.sum(0)}
        out = [ops.prepare_backward(grad_projected @ weight.T, src, ids, key, p, act)] if layer > 0 else []
        return Result(out, grads=grads)
    raise ValueError(f"gat has no task {task!r}")


# ----------------------------------------------------------------------------- edge work (graph server)


class _Attention:
    """Scores, edge softmax and attention dropout of one row block's in-edges (torch, on the
    device of ``graph`` and of ``projected``/``scores``)."""

    def __init__(self, graph, rows: tuple[int, int] | None, projected, scores, layer: int, args: dict[str, Any]):
        import torch

        heads = int(args["heads"])
        self.graph, self.heads, self.concat = graph, heads, bool(args["concat"])
        self.device = device = projected.device
        start = 0 if rows is None else rows[0]
        self.edges = edges = graph.edges(rows)
        self.num_rows = len(edges.indptr) - 1
        self.projected = projected.view(projected.shape[0], heads, -1)
        self.indptr = graph.tensor(("indptr", rows), edges.indptr)
        self.dst, self.src = graph.tensor(("dst", rows), edges.dst), graph.tensor(("src", rows), edges.src)
        # z[e, k] = s_dst[v, k] + s_src[u, k] for edge e = (u -> v)
        self.z = (scores[:, :heads].contiguous().index_select(0, self.dst + start)
                  + scores[:, heads:].contiguous().index_select(0, self.src))
        e = torch.nn.functional.leaky_relu(self.z, NEGATIVE_SLOPE)
        index = self.dst[:, None].expand(-1, heads)
        peak = torch.full((self.num_rows, heads), -torch.inf, device=device).scatter_reduce_(0, index, e, "amax")
        exp = torch.exp(e - peak.index_select(0, self.dst))
        total = torch.zeros(self.num_rows, heads, device=device).index_add_(0, self.dst, exp)
        self.alpha = exp / total.index_select(0, self.dst)
        p = float(args.get("attention_dropout", 0.0))
        self.keep_scale = None
        if args["training"] and p > 0.0:
            key, scale = (int(args["seed"]), int(args["epoch"]), layer), np.float32(1.0 / (1.0 - p))
            if device.type == "cpu":
                keep = keep_edge_mask(*key, edges.dst_ids, edges.src_ids, heads, p)
                self.keep_scale = torch.from_numpy(keep.astype(np.float32) * scale)
            else:  # hashed where the edges are: no [nnz, K] mask crosses the bus each Gather
                from dorylus.models.torch_ops import keep_edge_mask as keep_edge_mask_torch

                keep = keep_edge_mask_torch(key, graph.tensor(("dst_ids", rows), edges.dst_ids),
                                            graph.tensor(("src_ids", rows), edges.src_ids), heads, p)
                self.keep_scale = keep.to(torch.float32) * float(scale)
        self.weights = self.alpha if self.keep_scale is None else self.alpha * self.keep_scale

    def head(self, k: int):
        """``[local rows, F]``: head ``k``'s projected rows, contiguous."""
        return self.projected[:, k].contiguous()

    def matrix(self, values):
        """``[rows, local rows]`` CSR of the block's edges with ``values`` ``[nnz]``."""
        from dorylus.models.graph import csr_of_tensors

        return csr_of_tensors(self.indptr, self.src, values.contiguous(), (self.num_rows, self.projected.shape[0]))

    def transposes(self, values):
        """Per head, the ``[local rows, rows]`` CSR of the transpose with ``values`` ``[nnz, K]``
        (whole partition only)."""
        from dorylus.models.graph import csr_of_tensors

        indptr, order = self.graph.source_order()
        order_t = self.graph.tensor(("source_order",), order)
        crow, dst = self.graph.tensor(("source_indptr",), indptr), self.graph.tensor(("source_dst",), self.edges.dst[order])
        by_source = values.index_select(0, order_t)
        return [csr_of_tensors(crow, dst, by_source[:, k].contiguous(), (self.projected.shape[0], self.num_rows))
                for k in range(self.heads)]


def _attend(graph, rows, projected, scores, layer: int, args: dict[str, Any]):
    """Torch ``[rows, K F]`` (concatenated) or ``[rows, F]`` (averaged) from ``projected``
    ``[local rows, K F]`` and ``scores`` ``[local rows, 2K]``."""
    import torch

    attention = _Attention(graph, rows, projected, scores, layer, args)
    out = torch.stack([attention.matrix(attention.weights[:, k]) @ attention.head(k)
                       for k in range(attention.heads)], dim=1)
    return out.reshape(attention.num_rows, -1) if attention.concat else out.mean(dim=1)


def _attend_backward(graph, grad_out, projected, scores, layer: int, args: dict[str, Any]):
    """Torch ``(dP [local rows, K F], dE [local rows, 2K])`` from ``dY`` of every owned row.

    With ``g[v, k]`` the gradient of head ``k``'s output of ``v``, ``w = alpha * keep / (1 - p)``::

        dP[u, k]     = sum_{e=(u->v)} w[e, k] g[v, k]          (the transpose, per head)
        dw[e, k]     = g[v, k] · P[u, k]                       (sampled dense-dense product)
        dalpha       = dw * keep / (1 - p)
        de[e, k]     = alpha[e, k] (dalpha[e, k] - sum_{e' into v} alpha[e', k] dalpha[e', k])
        dz           = de * (1 if z > 0 else 0.2)
        ds_dst[v, k] = sum_{e into v} dz[e, k];   ds_src[u, k] = sum_{e out of u} dz[e, k]
    """
    import torch

    attention = _Attention(graph, None, projected, scores, layer, args)
    heads, dst, src, device = attention.heads, attention.dst, attention.src, attention.device
    n_local, width = attention.projected.shape[0], attention.projected.shape[2]
    grad_heads = (grad_out.view(-1, heads, width) if attention.concat
                  else (grad_out / heads)[:, None, :].expand(-1, heads, width))
    pattern = attention.matrix(torch.ones(len(dst), device=device))
    grad_projected = torch.empty(n_local, heads, width, device=device)
    grad_weights = torch.empty(len(dst), heads, device=device)
    transposes = attention.transposes(attention.weights)
    for k in range(heads):  # per head: sparse products, no nnz x F temporaries
        g = grad_heads[:, k].contiguous()
        grad_projected[:, k] = transposes[k] @ g
        grad_weights[:, k] = torch.sparse.sampled_addmm(pattern, g, attention.head(k).t(), beta=0.0).values()
    grad_alpha = grad_weights if attention.keep_scale is None else grad_weights * attention.keep_scale
    alpha = attention.alpha
    row_dot = torch.zeros(attention.num_rows, heads, device=device).index_add_(0, dst, alpha * grad_alpha)
    grad_z = alpha * (grad_alpha - row_dot.index_select(0, dst))
    grad_z = torch.where(attention.z > 0, grad_z, grad_z * NEGATIVE_SLOPE)
    grad_scores = torch.zeros(n_local, 2 * heads, device=device)
    grad_scores[: attention.num_rows, :heads] = torch.zeros(attention.num_rows, heads,
                                                            device=device).index_add_(0, dst, grad_z)
    grad_scores[:, heads:] = torch.zeros(n_local, heads, device=device).index_add_(0, src, grad_z)
    return grad_projected.reshape(n_local, heads * width), grad_scores


def gather_torch(task: str, layer: int, graph, rows: tuple[int, int], inputs, args: dict[str, Any]) -> list:
    """GA: attention-weighted sum of ``P`` over each row's in-edges (see the module docstring),
    on torch tensors on ``graph``'s device."""
    projected, scores = inputs
    return [_attend(graph, rows, projected, scores, layer, args)]


def gather_backward_torch(task: str, layer: int, graph, inputs, args: dict[str, Any]) -> list:
    """GA_BWD: from ``dY`` (owned rows) to ``dP`` and ``dE`` of every local row
    (:func:`_attend_backward`), on torch tensors on ``graph``'s device."""
    grad_out, projected, scores = inputs
    return list(_attend_backward(graph, grad_out, projected, scores, layer, args))


def gather(task: str, layer: int, graph, rows: tuple[int, int], inputs: Sequence[np.ndarray],
           args: dict[str, Any]) -> list[np.ndarray]:
    """:func:`gather_torch` on numpy rows (the graph server's CPU)."""
    return [t.numpy() for t in gather_torch(task, layer, graph, rows, _tensors(inputs), args)]


def gather_backward(task: str, layer: int, graph, inputs: Sequence[np.ndarray], args: dict[str, Any]) -> list[np.ndarray]:
    """:func:`gather_backward_torch` on numpy rows (the graph server's CPU)."""
    return [t.numpy() for t in gather_backward_torch(task, layer, graph, _tensors(inputs), args)]


def _tensors(arrays: Sequence[np.ndarray]) -> list:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) for x in arrays]


def reference_layer(layer: LayerSpec, graph, h, params: dict, key: tuple[int, int, int], training: bool):
    """The torch twin of one layer for the single-process reference: the projections and scores
    through autograd, the edge work through the same kernels as the graph server's Gather (their
    backward is checked against PyG's GATConv and against autograd on a dense formulation)."""
    import torch

    heads, width = layer.heads, layer.out_dim
    projected = h @ params["weight"]
    per_head = projected.view(h.shape[0], heads, width)
    scores = torch.cat([(per_head * params["att_dst"]).sum(-1), (per_head * params["att_src"]).sum(-1)], dim=1)
    args = {"heads": heads, "concat": layer.concat, "attention_dropout": layer.attention_dropout,
            "seed": key[0], "epoch": key[1], "training": training}
    return _attention_function().apply(projected, scores, graph, key[2], args) + params["bias"]


@functools.lru_cache(maxsize=None)
def _attention_function():
    """The edge work as a torch autograd function (defined on first use: this module imports no torch)."""
    import torch

    class AttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, projected, scores, graph, layer, args):
            ctx.save_for_backward(projected, scores)
            ctx.graph, ctx.layer, ctx.args = graph, layer, args
            return _attend(graph, None, projected.detach(), scores.detach(), layer, args)

        @staticmethod
        def backward(ctx, grad_out):
            projected, scores = ctx.saved_tensors
            grad_p, grad_s = _attend_backward(ctx.graph, grad_out.contiguous(), projected.detach(), scores.detach(),
                                              ctx.layer, ctx.args)
            return grad_p, grad_s, None, None, None

    return AttentionFunction
