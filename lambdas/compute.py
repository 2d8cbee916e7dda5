"""Tensor math of the serverless function: ApplyVertex forward/backward and the fused last layer.

Layer ``l`` of the model is ``H_{l+1} = act(A_hat · dropout_l(H_l) · W_l)``. The graph server
computes ``Z_l = A_hat · Hd_l`` (Gather); a function receives one interval's rows of ``Z_l`` with
their global vertex ids and computes the rest. A hidden layer's function returns its rows already
dropped with the NEXT layer's mask, ``Hd_{l+1} = dropout_{l+1}(relu(Z_l W_l))``, because those are
the rows the next Gather reads. Masks are keyed by (seed, epoch, layer, global vertex id)
(:mod:`dorylus.masks`), so results do not depend on how rows are cut into intervals, and the
backward pass regenerates them instead of storing them. The backward pass also recomputes the
activation from ``Z_l`` rather than keeping it between calls.

Everything is float32 numpy (no torch): this module is deployed in the Lambda bundle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dorylus.masks import keep_mask

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


def apply_vertex_forward(z: np.ndarray, w: np.ndarray, *, vertex_ids: np.ndarray, seed: int, epoch: int,
                         next_layer: int, next_dropout: float, training: bool) -> np.ndarray:
    """``Hd_{l+1} = dropout_{l+1}(relu(Z W))`` for one interval of a hidden layer ``l``.

    Args:
        z: ``float32 [n, in]``, the interval's rows of ``Z_l = A_hat · Hd_l``.
        w: ``float32 [in, out]``, ``W_l``.
        vertex_ids: ``int64 [n]``, global ids of the rows (the dropout key).
        seed, epoch, next_layer, next_dropout: key ``(seed, epoch, l + 1)`` and probability
            ``p_{l+1}`` of the next layer's input dropout; kept elements are scaled by
            ``1 / (1 - p_{l+1})``.
        training: without it (evaluation) there is no dropout.

    Returns:
        ``float32 [n, out]``.
    """
    z, w = _check_layer_inputs(z, w, vertex_ids)
    h = np.maximum(z @ w, np.float32(0.0))
    if training and next_dropout > 0.0:
        h = _dropout(h, keep_mask(seed, epoch, next_layer, vertex_ids, h.shape[1], next_dropout), next_dropout)
    return h


def apply_vertex_backward(z: np.ndarray, w: np.ndarray, grad_next: np.ndarray, *, vertex_ids: np.ndarray,
                          seed: int, epoch: int, next_layer: int,
                          next_dropout: float) -> tuple[np.ndarray, np.ndarray]:
    """Backward of :func:`apply_vertex_forward` (training mode) for one interval.

    With ``P = Z W`` recomputed and ``M`` the next layer's keep mask regenerated from its key::

        G_P = G * M / (1 - p_{l+1}) * [P > 0]      G = dL/dHd_{l+1}
        dW  = Z^T G_P                              (this interval's share: sum over intervals)
        dZ  = G_P W^T                              (the graph server turns it into A_hat^T dZ)

    Args:
        z: ``float32 [n, in]``; w: ``float32 [in, out]``; grad_next: ``float32 [n, out]``;
        the key arguments as in :func:`apply_vertex_forward`.

    Returns:
        ``(grad_w float32 [in, out], grad_z float32 [n, in])``.
    """
    z, w = _check_layer_inputs(z, w, vertex_ids)
    grad = _as_float32(grad_next, "grad_next")
    if grad.shape != (z.shape[0], w.shape[1]):
        raise ValueError(f"grad_next has shape {grad.shape}, expected {(z.shape[0], w.shape[1])} (rows of z, columns of w)")
    if next_dropout > 0.0:
        grad = _dropout(grad, keep_mask(seed, epoch, next_layer, vertex_ids, grad.shape[1], next_dropout), next_dropout)
    grad_pre = np.where(z @ w > 0, grad, np.float32(0.0))
    return z.T @ grad_pre, grad_pre @ w.T


@dataclass
class LastLayerResult:
    """One interval's share of the last layer.

    Attributes:
        loss_sum: ``sum_{train rows} CE(softmax(logits), label) / train_count``; the sum over all
            intervals is the mean training loss. Python float (accumulated in float64).
        correct: ``{"train": int, "val": int, "test": int}``, rows of each split whose argmax
            (first maximum on ties, like torch.argmax) equals the label.
        grad_w: ``float32 [in, C]``, this interval's share of ``dL/dW`` (``None`` unless training).
        grad_z: ``float32 [n, in]``, ``dL/dZ`` for the interval's rows (``None`` unless training).
    """

    loss_sum: float
    correct: dict[str, int]
    grad_w: np.ndarray | None = None
    grad_z: np.ndarray | None = None


def last_layer(z: np.ndarray, w: np.ndarray, labels: np.ndarray, split: np.ndarray, *, train_count: int,
               training: bool) -> LastLayerResult:
    """The fused last layer: logits, softmax cross-entropy, accuracy counts and (training) backward.

    With ``Y = Z W`` (logits, ``[n, C]``), ``S = softmax(Y)`` row-wise, ``T`` the train rows,
    ``N = train_count`` (the GLOBAL number of training vertices)::

        loss_sum = -sum_{i in T} log S[i, label_i] / N
        G        = (S - onehot(label)) / N  on rows in T, 0 elsewhere
        dW = Z^T G,   dZ = G W^T

    Args:
        z: ``float32 [n, in]``; w: ``float32 [in, C]``.
        labels: ``int64 [n]``; rows in a split must have a label in ``[0, C)``, others (e.g. ``-1``,
            unlabeled) are ignored.
        split: ``uint8 [n]`` codes, bits :data:`TRAIN`, :data:`VAL`, :data:`TEST`.
        train_count: global number of training vertices (>= this interval's).
        training: compute ``grad_w`` and ``grad_z``.
    """
    z, w = _check_layer_inputs(z, w, None)
    n, num_classes = z.shape[0], w.shape[1]
    labels = np.asarray(labels)
    split = np.asarray(split)
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

    logits = z @ w
    correct_rows = np.argmax(logits, axis=1) == labels
    correct = {name: int(np.count_nonzero(correct_rows & ((split & bit) != 0))) for name, bit in SPLITS.items()}

    # log-softmax of the train rows, shifted by the row maximum so exp never overflows
    train_logits = logits[train_rows]
    shifted = train_logits - train_logits.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_prob_label = (shifted - log_sum)[np.arange(len(train_rows)), labels[train_rows]]
    loss_sum = float(-log_prob_label.sum(dtype=np.float64) / train_count)
    if not training:
        return LastLayerResult(loss_sum=loss_sum, correct=correct)

    grad_logits = np.zeros_like(logits)
    train_grad = np.exp(shifted - log_sum)
    train_grad[np.arange(len(train_rows)), labels[train_rows]] -= np.float32(1.0)
    grad_logits[train_rows] = train_grad / np.float32(train_count)
    return LastLayerResult(loss_sum=loss_sum, correct=correct, grad_w=z.T @ grad_logits, grad_z=grad_logits @ w.T)


def _dropout(x: np.ndarray, keep: np.ndarray, p: float) -> np.ndarray:
    """Inverted dropout with a given mask: ``x * keep / (1 - p)`` (float32, as the reference)."""
    return np.where(keep, x * np.float32(1.0 / (1.0 - p)), np.float32(0.0))


def _as_float32(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {x.shape}")
    return x.astype(np.float32, copy=False)


def _check_layer_inputs(z: np.ndarray, w: np.ndarray, vertex_ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    z, w = _as_float32(z, "z"), _as_float32(w, "w")
    if z.shape[1] != w.shape[0]:
        raise ValueError(f"z has {z.shape[1]} columns but w has {w.shape[0]} rows (shapes {z.shape} and {w.shape})")
    if vertex_ids is not None and np.shape(vertex_ids) != (z.shape[0],):
        raise ValueError(f"vertex_ids has shape {np.shape(vertex_ids)}, expected ({z.shape[0]},) (one id per row of z)")
    return z, w
