"""GIN (Xu et al., 2019, "How Powerful are Graph Neural Networks?"), as stages and numpy vertex
functions.

Layer ``l`` computes, on ``H = dropout_l(act(Y_{l-1}))`` (``act`` is ReLU; ``H_0 = dropout_0(X)``)::

    Y[v] = MLP((1 + eps) H[v] + sum_{u in N(v)} H[u]),   MLP(x) = ReLU(x W_1 + b_1) W_2 + b_2

with ``W_1 [in, m]``, ``b_1 [m]``, ``W_2 [m, out]``, ``b_2 [out]`` (``m``: the run's ``hidden``)
and ``eps`` fixed at 0 (GIN-0, the paper's best) or learned per layer (GIN-eps,
``--gin-train-eps``: a parameter ``eps [1]`` starting at 0), as PyG's ``GINConv`` with
``nn = Sequential(Linear, ReLU, Linear)``. The first product is linear, so it runs before the
aggregation at the narrow width (DESIGN §2): ``P = H W_1``, then ``G = (A + I) P`` (the graph's
``sum`` kind: every in-edge and the self loop at weight 1), and ``Z = G + eps P + b_1`` is the
MLP's hidden pre-activation. Per layer, with ``src`` = ``X`` or ``Y_{l-1}``:

forward                                        backward
---------------------------------------------  -------------------------------------------------
AV   f  src, ids -> P_l = H W_1                MLP_BWD f  G_l, P_l, dY_l -> dZ_l (hidden layers)
GA   g  P_l -> G_l = (A + I) P_l               GA_BWD  g  dZ_l -> dQ_l = (A + I)^T dZ_l
MLP  f  G_l, P_l -> Y_l (hidden layers)        AV_BWD  f  dQ_l, G_l, P_l, dY_l, src, ids -> every
(last) LOSS f  G_l, P_l, labels, split ->               gradient of the layer, dY_{l-1} (l > 0)
            dZ_l, dY_l (the MLP, the loss
            and dZ in one call)

with ``dZ = (dY W_2^T) * [Z > 0]``, ``dP = dQ + eps dZ``, ``dW_1 = H^T dP``, ``dW_2 = ReLU(Z)^T
dY``, ``db_1 = sum dZ``, ``db_2 = sum dY``, ``deps = sum(dZ * P)``. ``AV_BWD`` recomputes ``Z``
from ``G`` and ``P`` rather than reading it (activations are recomputed, DESIGN §2), so every
gradient of the layer goes out in that one call. Dropout masks and the loss are as in
:mod:`dorylus.models.gcn`. Torch-free: this module ships in the Lambda bundle.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dorylus.models import ops as numpy_ops
from dorylus.models.base import (
    FUNCTION, GATHER, GATHER_BACKWARD, PIN, STASH, Plan, Result, Stage, Work, check_params,
)
from dorylus.models.spec import LayerSpec, ModelSpec

DESCRIPTION = "Xu et al., graph isomorphism network: sum aggregation, a 2-layer MLP per layer"
# Xu et al. 2019, section 7: hidden 64, dropout 0.5, Adam at lr 0.01, no weight decay, eps fixed at 0 (GIN-0).
DEFAULTS = {"hidden": 64, "dropout": 0.5, "input_dropout": 0.5, "lr": 0.01, "weight_decay": 0.0,
            "weight_decay_scope": "all"}
CONFIG_FIELDS = {"gin_train_eps": (False, "learn each layer's epsilon (GIN-eps, starting at 0) instead of "
                                          "fixing it at 0 (GIN-0)")}


def _width(layer: LayerSpec) -> int:
    """``m``: the MLP's inner width, the run's ``hidden``."""
    return int(layer.option("hidden"))


def params(layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """``weight_1 [in, m]``, ``bias_1 [m]``, ``weight_2 [m, out]``, ``bias_2 [out]``, and ``eps [1]``
    when it is learned."""
    m = _width(layer)
    shapes = {"weight_1": (layer.in_dim, m), "bias_1": (m,), "weight_2": (m, layer.out_dim), "bias_2": (layer.out_dim,)}
    if layer.option("gin_train_eps", False):
        shapes["eps"] = (1,)
    return shapes


def init_params(layer: LayerSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """As ``torch.nn.Linear`` (the published code's MLPs): weight and bias ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))``; ``eps`` 0, as PyG's ``GINConv``."""
    values = {}
    for i, (fan_in, fan_out) in enumerate(((layer.in_dim, _width(layer)), (_width(layer), layer.out_dim)), 1):
        bound = 1.0 / np.sqrt(fan_in)
        values[f"weight_{i}"] = rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(np.float32)
        values[f"bias_{i}"] = rng.uniform(-bound, bound, size=fan_out).astype(np.float32)
    if layer.option("gin_train_eps", False):
        values["eps"] = np.zeros(1, np.float32)
    return values


# ----------------------------------------------------------------------------- the plan


def build_plan(spec: ModelSpec) -> Plan:
    forward: list[Stage] = []
    backward: list[Stage] = []
    widths: dict[str, int] = {}
    last = len(spec.layers) - 1
    for layer in spec.layers:
        l, m = layer.index, _width(layer)
        src = "X" if l == 0 else f"Y{l - 1}"
        learned = layer.option("gin_train_eps", False)
        args = (("dropout", layer.dropout), ("act_in", spec.layers[l - 1].activation if l > 0 else None),
                ("train_eps", learned))
        widths.update({f"P{l}": m, f"G{l}": m, f"dZ{l}": m, f"dQ{l}": m, f"dY{l}": layer.out_dim})
        forward += [Stage(FUNCTION, "AV", l, (src, "ids"), (f"P{l}",), PIN, args=args),
                    Stage(GATHER, "GA", l, (f"P{l}",), (f"G{l}",))]
        if l == last:  # task fusion: the MLP, the loss and dZ in one call
            forward.append(Stage(FUNCTION, "LOSS", l, (f"G{l}", f"P{l}", "labels", "split"), (f"dZ{l}", f"dY{l}"),
                                 PIN, args=args))
            own_backward: list[Stage] = []
        else:
            widths[f"Y{l}"] = layer.out_dim
            forward.append(Stage(FUNCTION, "MLP", l, (f"G{l}", f"P{l}"), (f"Y{l}",), PIN, args=args))
            own_backward = [Stage(FUNCTION, "MLP_BWD", l, (f"G{l}", f"P{l}", f"dY{l}"), (f"dZ{l}",), STASH,
                                  args=args)]
        backward[:0] = own_backward + [
            Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dZ{l}",), (f"dQ{l}",), symmetric=True),
            Stage(FUNCTION, "AV_BWD", l, (f"dQ{l}", f"G{l}", f"P{l}", f"dY{l}", src, "ids"),
                  () if l == 0 else (f"dY{l - 1}",), STASH, grad=True, args=args)]
    return Plan.of(forward, backward, widths)


def gather(task: str, layer: int, graph, rows: tuple[int, int], inputs: Sequence[np.ndarray],
           args: dict[str, Any]) -> list[np.ndarray]:
    """GA: ``(A + I)[rows, :] · P``."""
    return [graph.aggregate("sum", inputs[0], rows)]


def gather_backward(task: str, layer: int, graph, inputs: Sequence[np.ndarray], args: dict[str, Any]) -> list[np.ndarray]:
    """GA_BWD: ``(A + I)^T · dZ`` over the local rows."""
    return [graph.aggregate_transpose("sum", inputs[0])]


def gather_torch(task: str, layer: int, graph, rows: tuple[int, int], inputs, args: dict[str, Any]) -> list:
    """:func:`gather` on torch tensors on ``graph``'s device."""
    return [graph.matrix("sum", rows) @ inputs[0]]


def gather_backward_torch(task: str, layer: int, graph, inputs, args: dict[str, Any]) -> list:
    """:func:`gather_backward` on torch tensors on ``graph``'s device."""
    return [graph.transpose("sum") @ inputs[0]]


def reference_layer(layer: LayerSpec, graph, h, params: dict, key: tuple[int, int, int], training: bool):
    """The torch twin of one layer for the single-process reference (autograd does the backward),
    in the stages' order: ``P = H W_1``, ``Z = (A + I) P + eps P + b_1``."""
    from dorylus.models.reference import aggregate

    projected = h @ params["weight_1"]
    z = aggregate(graph, projected, "sum") + params["bias_1"]
    if "eps" in params:
        z = z + params["eps"] * projected
    return (z * (z > 0)) @ params["weight_2"] + params["bias_2"]


# ----------------------------------------------------------------------------- vertex functions


def _unpack(params, train_eps: bool):
    shapes = {"weight_1": (None, None), "bias_1": (None,), "weight_2": (None, None), "bias_2": (None,)}
    if train_eps:
        shapes["eps"] = (1,)
    params = check_params(params, shapes, "gin")
    w1, b1, w2, b2 = (params[name] for name in ("weight_1", "bias_1", "weight_2", "bias_2"))
    if b1.shape[0] != w1.shape[1] or w2.shape[0] != w1.shape[1] or b2.shape[0] != w2.shape[1]:
        raise ValueError(f"gin: parameter shapes disagree: {({k: tuple(v.shape) for k, v in params.items()})}")
    return w1, b1, w2, b2, params.get("eps", 0.0)


def compute(task: str, layer: int, rows: Sequence[np.ndarray], params: dict | None, args: dict[str, Any],
            ops=numpy_ops) -> Result:
    """The tensor work of one stage on one interval (see the module docstring; ``args`` and
    ``ops`` as in :func:`dorylus.models.gcn.compute`, ``args`` with ``train_eps``)."""
    p, training = float(args.get("dropout", 0.0)), bool(args["training"])
    key = (int(args["seed"]), int(args["epoch"]), layer)
    act = args.get("act_in")
    w1, b1, w2, b2, eps = _unpack(params, bool(args.get("train_eps", False)))
    if task == "AV":
        src, ids = rows
        return Result([ops.matmul(ops.prepare(src, ids, key, p, act, training), w1)])

    def hidden(gathered, projected):
        """``Z = G + eps P + b_1`` of the rows, checked."""
        gathered = ops.check_shape(gathered, "G", (None, w1.shape[1]))
        projected = ops.check_shape(projected, "P", tuple(gathered.shape))
        return gathered + eps * projected + b1, projected

    if task == "MLP":
        z, _ = hidden(*rows)
        return Result([(z * (z > 0)) @ w2 + b2])
    if task == "MLP_BWD":
        gathered, projected, grad_y = rows
        z, _ = hidden(gathered, projected)
        grad_y = ops.check_shape(grad_y, "dY", (z.shape[0], w2.shape[1]))
        return Result([(grad_y @ w2.T) * (z > 0)])
    if task == "LOSS":
        gathered, projected, labels, split = rows
        z, _ = hidden(gathered, projected)
        loss = ops.softmax_cross_entropy((z * (z > 0)) @ w2 + b2, labels, split, int(args["train_count"]), training)
        if not training:
            return Result([], meta=loss.meta)
        return Result([(loss.grad @ w2.T) * (z > 0), loss.grad], meta=loss.meta)
    if task == "AV_BWD":
        grad_q, gathered, projected, grad_y, src, ids = rows
        z, projected = hidden(gathered, projected)
        n = z.shape[0]
        grad_q = ops.check_shape(grad_q, "dQ", tuple(z.shape))
        grad_y = ops.check_shape(grad_y, "dY", (n, w2.shape[1]))
        h = ops.check_shape(ops.prepare(src, ids, key, p, act, True), "src", (n, w1.shape[0]))
        grad_z = (grad_y @ w2.T) * (z > 0)
        grad_p = grad_q + eps * grad_z
        grads = {"weight_1": h.T @ grad_p, "bias_1": grad_z.sum(0), "weight_2": (z * (z > 0)).T @ grad_y,
                 "bias_2": grad_y.sum(0)}
        if args.get("train_eps", False):
            grads["eps"] = (grad_z * projected).sum().reshape(1)
        out = [ops.prepare_backward(grad_p @ w1.T, src, ids, key, p, act)] if layer > 0 else []
        return Result(out, grads=grads)
    raise ValueError(f"gin has no task {task!r}")


def stage_work(task: str, args: dict, layer: LayerSpec, rows: float, training: bool, prepare: Work) -> Work | None:
    """The planner's cost of ``task`` on ``rows`` rows (see :class:`~dorylus.models.base.Work`)."""
    i, m, o = layer.in_dim, _width(layer), layer.out_dim
    first = Work(macs=rows * i * m)
    second = Work(macs=rows * m * o)
    hidden = Work(elementwise=3 * rows * m)  # Z = G + eps P + b_1, then its ReLU
    if task == "AV":
        return prepare + first
    if task == "MLP":
        return hidden + second + Work(elementwise=rows * o)
    if task == "MLP_BWD":
        return hidden + second + Work(elementwise=rows * m)
    if task == "LOSS":
        work = hidden + second + Work(elementwise=rows * o, softmax=rows * o)
        return work + second + Work(elementwise=rows * m) if training else work
    if task == "AV_BWD":  # recompute H and Z; dZ, dW_2, dP, dW_1, the biases and eps, dX above layer 0
        return (prepare + hidden + second + second + Work(elementwise=4 * rows * m + rows * o)
                + first + (Work() if layer.index == 0 else first + prepare))
    return None
