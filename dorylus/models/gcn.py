"""GCN (Kipf & Welling, 2017) as stages and numpy vertex functions.

Layer ``l`` computes ``Y_l = A_hat · H_l · W_l`` on ``H_l = dropout_l(act(Y_{l-1}))``
(``H_0 = dropout_0(X)``; ``act`` is ReLU; the last layer's ``Y`` are the logits). Gather runs
at the narrow width (DESIGN §2): a layer whose input is wider than its output projects first,
``A_hat · (H W)``, so ghost rows and Gather are ``out`` wide; otherwise it gathers first,
``(A_hat · H) · W``. Per layer, with ``src`` = ``X`` or ``Y_{l-1}``:

project first (in > out)                     gather first (in <= out)
-------------------------------------------  ------------------------------------------------
AV      f   src, ids -> P_l = H_l W_l         PREP    v  src, ids -> H_l
GA      g   P_l -> Y_l = A_hat P_l            GA      g  H_l -> Z_l = A_hat H_l
(last) LOSS f  Y_l, labels, split -> dY_l     AV      f  Z_l -> Y_l = Z_l W_l
                                              (last) AV_LOSS f  Z_l, labels, split -> dZ_l, dW_l
backward:                                     backward:
GA_BWD  g   dY_l -> dP_l = A_hat^T dY_l       AV_BWD  f  Z_l, dY_l -> dW_l, dZ_l = dY_l W_l^T
AV_BWD  f   dP_l, src, ids -> dW_l,           GA_BWD  g  dZ_l -> dH_l = A_hat^T dZ_l
            dY_{l-1} (l > 0)                  PREP_BWD v dH_l, src, ids -> dY_{l-1} (l > 0)

(f: function, g: graph server Gather, v: graph server vertex stage.) No gradient flows into the
input features: layer 0's backward stops at ``dW_0``. Dropout masks are keyed by (seed, epoch,
layer, global vertex id) (:mod:`dorylus.masks`) and regenerated in the backward pass, and
activations are recomputed from ``src`` rather than stored between calls. The loss is the mean
cross-entropy over the GLOBAL training set. Everything is float32 numpy: this module ships in
the Lambda bundle.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dorylus.masks import keep_mask
from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, NEWEST, PIN, STASH, VERTEX, Plan, Result, Stage
from dorylus.models.spec import LayerSpec, ModelSpec

# Split codes: one uint8 per row, a bit per split (a row in no split has code 0).
TRAIN = np.uint8(1)
VAL = np.uint8(2)
TEST = np.uint8(4)
SPLITS = {"train": TRAIN, "val": VAL, "test": TEST}


def encode_split(train_mask: np.ndarray, val_mask: np.ndarray, test_mask: np.ndarray) -> np.ndarray:
    """``uint8 [N]`` split codes from three ``bool [N]`` masks: ``TRAIN*train | VAL*val | TEST*test``."""
    return (np.asarray(train_mask, dtype=np.uint8) * TRAIN
            | np.asarray(val_mask, dtype=np.uint8) * VAL
            | np.asarray(test_mask, dtype=np.uint8) * TEST).astype(np.uint8)


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
        args = (("dropout", layer.dropout), ("relu_in", l > 0), ("project_first", projects_first(layer)))
        grad_src = () if l == 0 else (f"dY{l - 1}",)
        if projects_first(layer):
            widths.update({f"P{l}": layer.out_dim, f"Y{l}": layer.out_dim, f"dY{l}": layer.out_dim,
                           f"dP{l}": layer.out_dim})
            forward += [Stage(FUNCTION, "AV", l, (src, "ids"), (f"P{l}",), PIN, args=args),
                        Stage(GATHER, "GA", l, (f"P{l}",), (f"Y{l}",))]
            if l == last:
                forward.append(Stage(FUNCTION, "LOSS", l, (f"Y{l}", "labels", "split"), (f"dY{l}",)))
            backward[:0] = [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dY{l}",), (f"dP{l}",)),
                            Stage(FUNCTION, "AV_BWD", l, (f"dP{l}", src, "ids"), grad_src, STASH, grad=True,
                                  args=args)]
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
                own_backward += [Stage(GATHER_BACKWARD, "GA_BWD", l, (f"dZ{l}",), (f"dH{l}",)),
                                 Stage(VERTEX, "PREP_BWD", l, (f"dH{l}", src, "ids"), grad_src, args=args)]
            backward[:0] = own_backward
    train = tuple(forward + backward)
    evaluate = tuple(_for_evaluation(s) for s in forward)
    return Plan(train=train, evaluate=evaluate, widths=widths)


def _for_evaluation(stage: Stage) -> Stage:
    """The forward stage without dropout's key use, weights unpinned and no gradient."""
    from dataclasses import replace

    loss = stage.task in ("LOSS", "AV_LOSS")
    return replace(stage, weights=NEWEST if stage.weights else None, grad=False, writes=() if loss else stage.writes)


# ----------------------------------------------------------------------------- vertex functions


def compute(task: str, layer: int, rows: Sequence[np.ndarray], w: np.ndarray | None, args: dict[str, Any]) -> Result:
    """The tensor work of one stage on one interval.

    Args:
        task, layer: the stage (see the module docstring for what each reads and writes).
        rows: the interval's rows of the stage's ``reads``, in order.
        w: ``float32 [in, out]``, ``W_layer`` (``None`` for stages without weights).
        args: the stage's ``args`` plus ``seed``, ``epoch``, ``training`` and ``train_count``
            (the global number of training vertices).
    """
    p, training = float(args.get("dropout", 0.0)), bool(args["training"])
    key = (int(args["seed"]), int(args["epoch"]), layer)
    relu_in = bool(args.get("relu_in", False))
    if task == "PREP":
        src, ids = rows
        return Result([_prepare(src, ids, key, p, relu_in, training)])
    if task == "PREP_BWD":
        grad_h, src, ids = rows
        return Result([_prepare_backward(grad_h, src, ids, key, p, relu_in)])
    if task == "AV":
        if args["project_first"]:
            src, ids = rows
            h = _prepare(src, ids, key, p, relu_in, training)
            return Result([_matmul(h, w)])
        return Result([_matmul(rows[0], w)])
    if task == "AV_BWD":
        if args["project_first"]:
            grad_p, src, ids = rows
            h = _prepare(src, ids, key, p, relu_in, True)
            grad_p = _check_shape(grad_p, "grad", (h.shape[0], _as_float32(w, "w").shape[1]))
            out = [_prepare_backward(grad_p @ w.T, src, ids, key, p, relu_in)] if layer > 0 else []
            return Result(out, grad_w=h.T @ grad_p)
        z, grad_y = rows
        z = _check_shape(z, "z", (None, _as_float32(w, "w").shape[0]))
        grad_y = _check_shape(grad_y, "grad", (z.shape[0], w.shape[1]))
        return Result([grad_y @ w.T] if layer > 0 else [], grad_w=z.T @ grad_y)
    if task == "LOSS":
        y, labels, split = rows
        loss = softmax_cross_entropy(y, labels, split, int(args["train_count"]), training)
        return Result([loss.grad] if training else [], meta=loss.meta)
    if task == "AV_LOSS":
        z, labels, split = rows
        z = _as_float32(z, "z")
        loss = softmax_cross_entropy(_matmul(z, w), labels, split, int(args["train_count"]), training)
        if not training:
            return Result([], meta=loss.meta)
        return Result([loss.grad @ w.T] if layer > 0 else [], grad_w=z.T @ loss.grad, meta=loss.meta)
    raise ValueError(f"gcn has no task {task!r}")


def _prepare(src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, relu_in: bool,
             training: bool) -> np.ndarray:
    """``H = dropout(relu(src))`` (no ReLU on layer 0's features), inverted dropout, float32."""
    h = _as_float32(src, "src")
    if np.shape(ids) != (h.shape[0],):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({h.shape[0]},) (one id per row)")
    if relu_in:
        h = np.maximum(h, np.float32(0.0))
    if training and p > 0.0:
        h = np.where(keep_mask(*key, ids, h.shape[1], p), h * np.float32(1.0 / (1.0 - p)), np.float32(0.0))
    return h


def _prepare_backward(grad_h: np.ndarray, src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float,
                      relu_in: bool) -> np.ndarray:
    """``dL/dsrc = dL/dH * M / (1 - p) * [src > 0]`` with the same mask ``M`` as the forward."""
    src = _as_float32(src, "src")
    grad = _check_shape(grad_h, "grad", src.shape)
    if np.shape(ids) != (src.shape[0],):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({src.shape[0]},) (one id per row)")
    if p > 0.0:
        grad = np.where(keep_mask(*key, ids, grad.shape[1], p), grad * np.float32(1.0 / (1.0 - p)), np.float32(0.0))
    if relu_in:
        grad = np.where(np.asarray(src) > 0, grad, np.float32(0.0))
    return grad


class _Loss:
    def __init__(self, meta: dict[str, Any], grad: np.ndarray | None):
        self.meta, self.grad = meta, grad


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, split: np.ndarray, train_count: int,
                          training: bool) -> _Loss:
    """Loss share, accuracy counts and ``dL/dlogits`` of one interval.

    With ``S = softmax(Y)`` row-wise, ``T`` the train rows, ``N = train_count`` (global)::

        loss = -sum_{i in T} log S[i, label_i] / N
        G    = (S - onehot(label)) / N  on rows in T, 0 elsewhere

    ``meta`` holds ``loss`` and ``correct_train``/``_val``/``_test``: rows of each split whose
    argmax (first maximum on ties, as torch.argmax) equals the label. Rows outside every split
    may have any label (e.g. -1).
    """
    logits = _as_float32(logits, "logits")
    n, num_classes = logits.shape
    labels, split = np.asarray(labels), np.asarray(split)
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
    if split.shape != (n,) or split.dtype != np.uint8:
        raise ValueError(f"split must be uint8 of shape ({n},), got {split.dtype} {split.shape}")
    bad = (split != 0) & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"row {row} is in a split but has label {int(labels[row])}, outside [0, {num_classes})")
    train_rows = np.flatnonzero(split & TRAIN)
    if not isinstance(train_count, (int, np.integer)) or train_count < max(len(train_rows), 1):
        raise ValueError(f"train_count must be an int >= 1 and >= this interval's {len(train_rows)} train rows, "
                         f"got {train_count!r}")
    correct_rows = np.argmax(logits, axis=1) == labels
    meta: dict[str, Any] = {f"correct_{name}": int(np.count_nonzero(correct_rows & ((split & bit) != 0)))
                            for name, bit in SPLITS.items()}
    train_logits = logits[train_rows]
    shifted = train_logits - train_logits.max(axis=1, keepdims=True)  # exp never overflows
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    meta["loss"] = float(-(shifted - log_sum)[np.arange(len(train_rows)), labels[train_rows]].sum(dtype=np.float64)
                         / train_count)
    if not training:
        return _Loss(meta, None)
    grad = np.zeros_like(logits)
    train_grad = np.exp(shifted - log_sum)
    train_grad[np.arange(len(train_rows)), labels[train_rows]] -= np.float32(1.0)
    grad[train_rows] = train_grad / np.float32(train_count)
    return _Loss(meta, grad)


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, w = _as_float32(x, "rows"), _as_float32(w, "w")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"rows have {x.shape[1]} columns but w has {w.shape[0]} rows (shapes {x.shape}, {w.shape})")
    return x @ w


def _check_shape(x: np.ndarray, name: str, shape: tuple[int | None, int]) -> np.ndarray:
    x = _as_float32(x, name)
    if any(want is not None and got != want for got, want in zip(x.shape, shape)):
        raise ValueError(f"{name} has shape {x.shape}, expected {tuple('any' if d is None else d for d in shape)}")
    return x


def _as_float32(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {x.shape}")
    return x.astype(np.float32, copy=False)
