"""GCN (Kipf & Welling, 2017) as stages and numpy vertex functions.

Layer ``l`` computes ``Y_l = A_hat · H_l · W_l + b_l`` on ``H_l = dropout_l(act(Y_{l-1}))``
(``H_0 = dropout_0(X)``; ``act`` is ReLU; the last layer's ``Y`` are the logits), with the bias
added after the aggregation as PyG's ``GCNConv``. Its parameters are ``weight`` ``[in, out]`` and
``bias`` ``[out]``. Gather runs at the narrow width (DESIGN §2): a layer whose input is wider than
its output projects first, ``A_hat · (H W)``, so ghost rows and Gather are ``out`` wide;
otherwise it gathers first, ``(A_hat · H) · W``. Per layer, with ``src`` = ``X`` or ``Y_{l-1}``:

project first (in > out)                     gather first (in <= out)
-------------------------------------------  ------------------------------------------------
AV      f   src, ids -> P_l = H_l W_l         PREP    v  src, ids -> H_l
GA      g   P_l -> G_l = A_hat P_l            GA      g  H_l -> Z_l = A_hat H_l
BIAS    f   G_l -> Y_l = G_l + b_l            AV      f  Z_l -> Y_l = Z_l W_l + b_l
(last: LOSS f  G_l, labels, split -> dY_l,    (last) AV_LOSS f  Z_l, labels, split -> dZ_l,
 the logits G_l + b_l, instead of BIAS)                  dW_l, db_l
backward:                                     backward:
GA_BWD  g   dY_l -> dP_l = A_hat^T dY_l       AV_BWD  f  Z_l, dY_l -> dW_l, db_l,
AV_BWD  f   dP_l, sum dY_l, src, ids -> dW_l,            dZ_l = dY_l W_l^T
            db_l = sum dY_l, dY_{l-1} (l > 0) GA_BWD  g  dZ_l -> dH_l = A_hat^T dZ_l
                                              PREP_BWD v dH_l, src, ids -> dY_{l-1} (l > 0)

(f: function, g: graph server Gather, v: graph server vertex stage.) No gradient flows into the
input features: layer 0's backward stops at ``dW_0``. Sparse input features
(:mod:`dorylus.models.sparse`) stay sparse through layer 0's ``AV``/``AV_BWD`` (``H W``,
``H^T dP``); a layer 0 that gathers first densifies its rows in ``PREP``, since Gather reads a
dense row buffer. Dropout masks are keyed by (seed, epoch, layer, global vertex id)
(:mod:`dorylus.masks`) and regenerated in the backward pass, and
activations are recomputed from ``src`` rather than stored between calls. The loss is the mean
cross-entropy over the GLOBAL training set. Everything is float32 numpy: this module ships in
the Lambda bundle.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dorylus.models.base import (
    FUNCTION, GATHER, GATHER_BACKWARD, PIN, STASH, VERTEX, Plan, Result, Stage, Work, check_params,
)
from dorylus.models import ops as numpy_ops
from dorylus.models.spec import LayerSpec, ModelSpec, glorot, zeros

DESCRIPTION = "Kipf & Welling, graph convolution"
# Kipf & Welling 2017, section 5.2 (Planetoid): 16 hidden units, dropout 0.5, L2 5e-4 on the first layer, lr 0.01.
DEFAULTS = {"hidden": 16, "dropout": 0.5, "input_dropout": 0.5, "lr": 0.01, "weight_decay": 5e-4,
            "weight_decay_scope": "first"}


def projects_first(layer: LayerSpec) -> bool:
    """``A_hat · (H W)`` when the input is wider than the output (DGL's GraphConv rule)."""
    return layer.in_dim > layer.out_dim


# ----------------------------------------------------------------------------- the plan


def build_plan(spec: ModelSpec) -> Plan:
    forward: list[Stage] = []
    backward: list[Stage] = []
    widths: dict[str, int] = {}
    last = len(spec.layers) - 1
    for layer in spec.layers:
        l = layer.index
        src = "X" if l == 0 else f"Y{l - 1}"
        args = (("dropout", layer.dropout), ("act_in", spec.layers[l - 1].activation if l > 0 else None), ("project_first", projects_first(layer)))
        grad_src = () if l == 0 else (f"dY{l - 1}",)
        if projects_first(layer):
            widths.update({f"P{l}": layer.out_dim, f"G{l}": layer.out_dim, f"dY{l}": layer.out_dim,
                           f"dP{l}": layer.out_dim})
            forward += [Stage(FUNCTION, "AV", l, (src, "ids"), (f"P{l}",), PIN, args=args),
                        Stage(GATHER, "GA", l, (f"P{l}",), (f"G{l}",))]
            if l == last:  # the bias joins the loss's call: the logits are G + b
                forward.append(Stage(FUNCTION, "LOSS", l, (f"G{l}", "labels", "split"), (f"dY{l}",), PIN))
            else:
                widths[f"Y{l}"] = layer.out_dim
                forward.append(Stage(FUNCTION, "BIAS", l, (f"G{l}",), (f"Y{l}",), PIN))
            backward[:0] = [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dY{l}",), (f"dP{l}",), symmetric=True),
                            Stage(FUNCTION, "AV_BWD", l, (f"dP{l}", f"dY{l}", src, "ids"), grad_src, STASH,
                                  grad=True, args=args, summed=(f"dY{l}",))]
        else:
            widths.update({f"H{l}": layer.in_dim, f"Z{l}": layer.in_dim, f"dZ{l}": layer.in_dim,
                           f"dH{l}": layer.in_dim, f"Y{l}": layer.out_dim, f"dY{l}": layer.out_dim})
            forward += [Stage(VERTEX, "PREP", l, (src, "ids"), (f"H{l}",), args=args),
                        Stage(GATHER, "GA", l, (f"H{l}",), (f"Z{l}",))]
            grad_z = (f"dZ{l}",) if l > 0 else ()
            if l == last:  # task fusion: the layer's product, the loss and their backward in one call
                forward.append(Stage(FUNCTION, "AV_LOSS", l, (f"Z{l}", "labels", "split"), grad_z, PIN, grad=True,
                                     args=args))
                own_backward: list[Stage] = []
            else:
                forward.append(Stage(FUNCTION, "AV", l, (f"Z{l}",), (f"Y{l}",), PIN, args=args))
                own_backward = [Stage(FUNCTION, "AV_BWD", l, (f"Z{l}", f"dY{l}"), grad_z, STASH, grad=True,
                                      args=args)]
            if l > 0:
                own_backward += [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dZ{l}",), (f"dH{l}",), symmetric=True),
                                 Stage(VERTEX, "PREP_BWD", l, (f"dH{l}", src, "ids"), grad_src, args=args)]
            backward[:0] = own_backward
    return Plan.of(forward, backward, widths)


def gather(task: str, layer: int, graph, rows: tuple[int, int], inputs: Sequence[np.ndarray],
           args: dict[str, Any]) -> list[np.ndarray]:
    """GA: ``A_hat[rows, :] · inputs[0]``."""
    return [graph.aggregate("gcn", inputs[0], rows)]


def gather_backward(task: str, layer: int, graph, inputs: Sequence[np.ndarray], args: dict[str, Any]) -> list[np.ndarray]:
    """GA_BWD: ``A_hat^T · dY`` over the local rows."""
    return [graph.aggregate_transpose("gcn", inputs[0])]


def gather_torch(task: str, layer: int, graph, rows: tuple[int, int], inputs, args: dict[str, Any]) -> list:
    """:func:`gather` on torch tensors on ``graph``'s device."""
    return [graph.matrix("gcn", rows) @ inputs[0]]


def gather_backward_torch(task: str, layer: int, graph, inputs, args: dict[str, Any]) -> list:
    """:func:`gather_backward` on torch tensors on ``graph``'s device."""
    return [graph.transpose("gcn") @ inputs[0]]


def reference_layer(layer: LayerSpec, graph, h, params: dict, key: tuple[int, int, int], training: bool):
    """The torch twin of one layer for the single-process reference (autograd does the backward)."""
    from dorylus.models.reference import aggregate, dense_input

    weight = params["weight"]
    y = aggregate(graph, h @ weight) if projects_first(layer) else aggregate(graph, dense_input(h)) @ weight
    return y + params["bias"]


# ----------------------------------------------------------------------------- vertex functions


def compute(task: str, layer: int, rows: Sequence[np.ndarray], params: dict | None, args: dict[str, Any],
            ops=numpy_ops) -> Result:
    """The tensor work of one stage on one interval.

    Args:
        task, layer: the stage (see the module docstring for what each reads and writes).
        rows: the interval's rows of the stage's ``reads``, in order.
        params: ``{"weight": float32 [in, out], "bias": float32 [out]}``, the layer's
            parameters (``None`` for stages without weights).
        args: the stage's ``args`` plus ``seed``, ``epoch``, ``training`` and ``train_count``
            (the global number of training vertices).
        ops: the array functions: :mod:`dorylus.models.ops` (numpy arrays) or its torch twin
            :mod:`dorylus.models.torch_ops` (``rows`` and ``params`` torch tensors on one
            device; the result's rows and ``grads`` are then tensors on it too).
    """
    p, training = float(args.get("dropout", 0.0)), bool(args["training"])
    key = (int(args["seed"]), int(args["epoch"]), layer)
    act = args.get("act_in")
    if task == "PREP":
        src, ids = rows
        # H_l is written into a row buffer that Gather reads: sparse features (layer 0) densify here.
        return Result([ops.dense(ops.prepare(src, ids, key, p, act, training))])
    if task == "PREP_BWD":
        grad_h, src, ids = rows
        return Result([ops.prepare_backward(grad_h, src, ids, key, p, act)])
    w, b = _unpack(params)
    if task == "AV":
        if args["project_first"]:
            src, ids = rows
            return Result([ops.project(src, ids, key, p, act, training, w)])
        return Result([ops.matmul(rows[0], w) + b])
    if task == "BIAS":
        return Result([ops.check_shape(rows[0], "G", (None, b.shape[0])) + b])
    if task == "LOSS":
        gathered, labels, split = rows
        return ops.loss_stage([ops.check_shape(gathered, "G", (None, b.shape[0])) + b, labels, split], args)
    if task == "AV_BWD":
        if args["project_first"]:
            grad_p, grad_y, src, ids = rows
            grad_p = ops.check_shape(grad_p, "grad", (src.shape[0], w.shape[1]))
            grad_y = ops.check_rows_or_sum(grad_y, "dY", src.shape[0], w.shape[1])
            out = [ops.prepare_backward(grad_p @ w.T, src, ids, key, p, act)] if layer > 0 else []
            return Result(out, grads={"weight": ops.project_grad(src, ids, key, p, act, grad_p),
                                      "bias": grad_y.sum(0)})
        z, grad_y = rows
        z = ops.check_shape(z, "z", (None, w.shape[0]))
        grad_y = ops.check_shape(grad_y, "grad", (z.shape[0], w.shape[1]))
        return Result([grad_y @ w.T] if layer > 0 else [], grads={"weight": z.T @ grad_y, "bias": grad_y.sum(0)})
    if task == "AV_LOSS":
        z, labels, split = rows
        meta, grad_z, grad_w, grad_b = ops.softmax_regression(z, w, b, labels, split, int(args["train_count"]),
                                                              training)
        if not training:
            return Result([], meta=meta)
        return Result([grad_z] if layer > 0 else [], grads={"weight": grad_w, "bias": grad_b}, meta=meta)
    raise ValueError(f"gcn has no task {task!r}")


def _unpack(params):
    """``(weight [in, out], bias [out])``, checked."""
    params = check_params(params, {"weight": (None, None), "bias": (None,)}, "gcn")
    w, b = params["weight"], params["bias"]
    if b.shape[0] != w.shape[1]:
        raise ValueError(f"gcn: bias has {b.shape[0]} entries but weight has {w.shape[1]} columns")
    return w, b


def stage_work(task: str, args: dict, layer: LayerSpec, rows: float, training: bool, prepare: Work) -> Work | None:
    """The planner's cost of ``task`` on ``rows`` rows (see :class:`~dorylus.models.base.Work`)."""
    i, o = layer.in_dim, layer.out_dim
    product = Work(macs=rows * i * o)
    bias = Work(elementwise=rows * o)  # adding it, or summing its gradient
    first = layer.index == 0
    if task in ("PREP", "PREP_BWD"):
        return prepare  # the mask (or the activation's derivative) again, on the gradient
    if task == "AV":
        return prepare + product if args.get("project_first") else product + bias
    if task == "BIAS":
        return bias
    if task == "AV_BWD":
        if args.get("project_first"):  # recompute H, dW = H^T dP, db, and dX = prep'(dP W^T) above layer 0
            return prepare + product + bias + (Work() if first else product + prepare)
        return product + bias + (Work() if first else product)  # dW = Z^T dY, db, dZ = dY W^T
    if task == "LOSS":
        return bias + Work(softmax=rows * o)
    if task == "AV_LOSS":
        work = product + bias + Work(softmax=rows * o)
        return work + product + bias + (Work() if first else product) if training else work
    return None


def params(layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """``weight [in, out]``, ``bias [out]`` (PyG's ``GCNConv``: ``bias=True``)."""
    return {"weight": (layer.in_dim, layer.out_dim), "bias": (layer.out_dim,)}


def init_params(layer: LayerSpec, rng) -> dict[str, np.ndarray]:
    """Glorot uniform weight (Kipf & Welling, PyG), zero bias."""
    return {"weight": glorot(rng, layer.in_dim, layer.out_dim), "bias": zeros(layer.out_dim)}
