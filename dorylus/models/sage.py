"""GraphSAGE (Hamilton et al., 2017), mean aggregator with a root weight, as stages and numpy
vertex functions.

Layer ``l`` computes ``Y_l = H_l W_self + mean_{u in N(v)} (H_l W_neigh)[u] + b`` on
``H_l = dropout_l(act(Y_{l-1}))`` (``H_0 = dropout_0(X)``; ``act`` is ReLU; the last layer's
``Y`` are the logits). The mean is over each vertex's in-neighbours in the whole graph (its row of
the in-edge CSR without the self loop; a graph server owns all of them); a vertex with none gets
0, as PyG's ``SAGEConv``. The layer's parameters are ``weight_self`` and ``weight_neigh``
``[in, out]`` and ``bias`` ``[out]`` (PyG's ``lin_r``, ``lin_l`` and ``lin_l``'s bias: one bias,
which this module adds to ``S``, the vertex's own term, since the mean of a vertex without
in-neighbours is 0 and would drop it). Every layer projects before it gathers (``mean(H W_neigh)``), so ghost
rows and Gather are ``out`` wide; that is the narrow width whenever the input is wider than the
output, the usual case. Per layer, with ``src`` = ``X`` or ``Y_{l-1}``:

forward                                        backward
---------------------------------------------  -------------------------------------------------
AV   f  src, ids -> P_l = H W_neigh,           GA_BWD g  dY_l -> dP_l = M^T dY_l
            S_l = H W_self + b                 AV_BWD f  dP_l, dY_l, src, ids -> the gradients,
GA   g  P_l -> G_l = M P_l (M: mean)                     dY_{l-1} (l > 0)
SUM  v  G_l, S_l -> Y_l = G_l + S_l
(last) LOSS f  Y_l, labels, split -> dY_l

(f: function, g: graph server Gather, v: graph server vertex stage.) Dropout masks, recomputation
and the loss are as in :mod:`dorylus.models.gcn`. Torch-free: this module ships in the Lambda bundle.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dorylus.models.base import (
    FUNCTION, GATHER, GATHER_BACKWARD, PIN, STASH, VERTEX, Plan, Result, Stage, Work, check_params,
)
from dorylus.models import ops as numpy_ops
from dorylus.models.spec import LayerSpec, ModelSpec, glorot, zeros


DESCRIPTION = "GraphSAGE, mean aggregator with root weight"
# Hamilton et al. 2017, reference implementation (GraphSAGE supervised_train.py flags): dim_1 = dim_2 = 128,
# lr 0.01, dropout 0, weight decay 0.
DEFAULTS = {"hidden": 128, "dropout": 0.0, "input_dropout": 0.0, "lr": 0.01, "weight_decay": 0.0,
            "weight_decay_scope": "all"}


def build_plan(spec: ModelSpec) -> Plan:
    forward: list[Stage] = []
    backward: list[Stage] = []
    widths: dict[str, int] = {}
    last = len(spec.layers) - 1
    for layer in spec.layers:
        l = layer.index
        src = "X" if l == 0 else f"Y{l - 1}"
        args = (("dropout", layer.dropout), ("act_in", spec.layers[l - 1].activation if l > 0 else None))
        widths.update({f"{b}{l}": layer.out_dim for b in ("P", "S", "G", "Y", "dY", "dP")})
        forward += [Stage(FUNCTION, "AV", l, (src, "ids"), (f"P{l}", f"S{l}"), PIN, args=args),
                    Stage(GATHER, "GA", l, (f"P{l}",), (f"G{l}",)),
                    Stage(VERTEX, "SUM", l, (f"G{l}", f"S{l}"), (f"Y{l}",))]
        if l == last:
            forward.append(Stage(FUNCTION, "LOSS", l, (f"Y{l}", "labels", "split"), (f"dY{l}",)))
        backward[:0] = [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dY{l}",), (f"dP{l}",)),
                        Stage(FUNCTION, "AV_BWD", l, (f"dP{l}", f"dY{l}", src, "ids"),
                              () if l == 0 else (f"dY{l - 1}",), STASH, grad=True, args=args)]
    return Plan.of(forward, backward, widths)


def stage_work(task: str, args: dict, layer: LayerSpec, rows: float, training: bool, prepare: Work) -> Work | None:
    """The planner's cost: ``P = H W_neigh`` and ``S = H W_self + b`` from one input; ``Y = mean(P) + S``."""
    i, o = layer.in_dim, layer.out_dim
    both = Work(macs=2 * rows * i * o)
    bias = Work(elementwise=rows * o)
    if task == "AV":
        return prepare + both + bias
    if task == "SUM":
        return Work(elementwise=rows * o)
    if task == "LOSS":
        return Work(softmax=rows * o)
    if task == "AV_BWD":  # recompute H, both weights' gradients, the bias's, and dX above layer 0
        return prepare + both + bias + (Work() if layer.index == 0 else both + prepare)
    return None


def params(layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """``weight_self``, ``weight_neigh`` ``[in, out]`` and ``bias [out]`` (PyG's ``SAGEConv``:
    ``lin_r``, ``lin_l`` and ``lin_l.bias``)."""
    return {"weight_self": (layer.in_dim, layer.out_dim), "weight_neigh": (layer.in_dim, layer.out_dim),
            "bias": (layer.out_dim,)}


def init_params(layer: LayerSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each weight Glorot uniform, ``weight_self`` drawn first; zero bias."""
    return {"weight_self": glorot(rng, layer.in_dim, layer.out_dim),
            "weight_neigh": glorot(rng, layer.in_dim, layer.out_dim), "bias": zeros(layer.out_dim)}


def _unpack(params):
    params = check_params(params, {"weight_self": (None, None), "weight_neigh": (None, None), "bias": (None,)},
                          "sage")
    w_self, w_neigh, b = params["weight_self"], params["weight_neigh"], params["bias"]
    if tuple(w_neigh.shape) != tuple(w_self.shape) or b.shape[0] != w_self.shape[1]:
        raise ValueError(f"sage: parameter shapes disagree: weight_self {tuple(w_self.shape)}, weight_neigh "
                         f"{tuple(w_neigh.shape)}, bias {tuple(b.shape)}")
    return w_self, w_neigh, b


def compute(task: str, layer: int, rows: Sequence[np.ndarray], params: dict | None, args: dict[str, Any],
            ops=numpy_ops) -> Result:
    """The tensor work of one stage on one interval (see the module docstring; ``args`` and
    ``ops`` as in :func:`dorylus.models.gcn.compute`)."""
    p, training = float(args.get("dropout", 0.0)), bool(args["training"])
    key = (int(args["seed"]), int(args["epoch"]), layer)
    act = args.get("act_in")
    if task == "SUM":
        gathered, own = rows
        gathered = ops.as_float32(gathered, "G")
        return Result([gathered + ops.check_shape(own, "S", tuple(gathered.shape))])
    if task == "LOSS":
        return ops.loss_stage(list(rows), args)
    if task == "AV":
        src, ids = rows
        w_self, w_neigh, b = _unpack(params)
        h = ops.check_shape(ops.prepare(src, ids, key, p, act, training), "src", (None, w_self.shape[0]))
        return Result([h @ w_neigh, h @ w_self + b])
    if task == "AV_BWD":
        grad_p, grad_y, src, ids = rows
        w_self, w_neigh, b = _unpack(params)
        h = ops.check_shape(ops.prepare(src, ids, key, p, act, True), "src", (None, w_self.shape[0]))
        grad_p = ops.check_shape(grad_p, "dP", (h.shape[0], w_self.shape[1]))
        grad_y = ops.check_shape(grad_y, "dY", (h.shape[0], w_self.shape[1]))
        grads = {"weight_self": h.T @ grad_y, "weight_neigh": h.T @ grad_p, "bias": grad_y.sum(0)}
        out = ([ops.prepare_backward(grad_y @ w_self.T + grad_p @ w_neigh.T, src, ids, key, p, act)]
               if layer > 0 else [])
        return Result(out, grads=grads)
    raise ValueError(f"sage has no task {task!r}")


def gather(task: str, layer: int, graph, rows: tuple[int, int], inputs: Sequence[np.ndarray],
           args: dict[str, Any]) -> list[np.ndarray]:
    """GA: ``M[rows, :] · P`` with ``M`` the in-neighbour mean."""
    return [graph.aggregate("mean", inputs[0], rows)]


def gather_backward(task: str, layer: int, graph, inputs: Sequence[np.ndarray], args: dict[str, Any]) -> list[np.ndarray]:
    """GA_BWD: ``M^T · dY`` over the local rows."""
    return [graph.aggregate_transpose("mean", inputs[0])]


def gather_torch(task: str, layer: int, graph, rows: tuple[int, int], inputs, args: dict[str, Any]) -> list:
    """:func:`gather` on torch tensors on ``graph``'s device."""
    return [graph.matrix("mean", rows) @ inputs[0]]


def gather_backward_torch(task: str, layer: int, graph, inputs, args: dict[str, Any]) -> list:
    """:func:`gather_backward` on torch tensors on ``graph``'s device."""
    return [graph.transpose("mean") @ inputs[0]]


def reference_layer(layer: LayerSpec, graph, h, params: dict, key: tuple[int, int, int], training: bool):
    """The torch twin of one layer for the single-process reference (autograd does the backward)."""
    from dorylus.models.reference import aggregate

    return h @ params["weight_self"] + params["bias"] + aggregate(graph, h @ params["weight_neigh"], "mean")
