"""Torch-free numpy pieces that every model's vertex functions share: split codes, the keyed
input dropout and activation of a layer (forward and backward), and the softmax cross-entropy
over the global training set. Ships in the Lambda bundle, like the model modules.

A model's ``compute`` is written once over an ``ops`` module: this one (numpy: functions, the
``cpu`` backend) or its torch twin :mod:`dorylus.models.torch_ops` (the ``gpu`` backend's
device), which has the same functions.

Layer 0's input rows may be :class:`~dorylus.models.sparse.SparseRows` (sparse features):
:func:`prepare` then drops out the stored non-zeros only and returns ``SparseRows``, which the
models use through ``h @ W`` and ``h.T @ G`` like dense rows; :func:`as_float32`,
:func:`check_shape` and :func:`matmul` pass them through.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dorylus.masks import keep_at, keep_mask
from dorylus.models.sparse import SparseRows

# Split codes: one uint8 per row, a bit per split (a row in no split has code 0).
TRAIN = np.uint8(1)
VAL = np.uint8(2)
TEST = np.uint8(4)
SPLITS = {"train": TRAIN, "val": VAL, "test": TEST}

ACTIVATIONS = (None, "relu", "elu")

# The keyed dropout runs fused in one pass on numba (dorylus/models/_dropout_numba.py) where
# numba is importable, and on numpy in the Lambda bundle (no numba): both give the same bits.
# numpy's passes cost about 6 ns an element (1M: 6 ms); numba's first call in a process costs
# 25 ms where its compiler is already started (roles forked from the zygote), 1-2 s where not,
# so until a call on this many elements (rows x width) has loaded the kernel, calls stay on numpy.
FUSED_MIN_ELEMENTS = 1 << 20
_fused_module: Any = None  # None: not tried yet; False: numba is missing


def _fused(elements: int) -> Any:
    """The fused kernel's module for a dropout of ``elements``, or None: run it on numpy."""
    global _fused_module
    if _fused_module is None and elements < FUSED_MIN_ELEMENTS:
        return None
    if _fused_module is None:
        try:  # optional: the Lambda bundle neither ships nor imports it
            from dorylus.models import _dropout_numba
        except ImportError:
            _fused_module = False
        else:
            _fused_module = _dropout_numba
    return _fused_module or None


def encode_split(train_mask: np.ndarray, val_mask: np.ndarray, test_mask: np.ndarray) -> np.ndarray:
    """``uint8 [N]`` split codes from three ``bool [N]`` masks: ``TRAIN*train | VAL*val | TEST*test``."""
    return (np.asarray(train_mask, dtype=np.uint8) * TRAIN
            | np.asarray(val_mask, dtype=np.uint8) * VAL
            | np.asarray(test_mask, dtype=np.uint8) * TEST).astype(np.uint8)


def prepare(src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, activation: str | None,
            training: bool) -> np.ndarray:
    """``H = dropout(act(src))``: a layer's input from the previous layer's pre-activation output
    (``activation`` None for layer 0's features), inverted dropout keyed by ``key`` = (seed,
    epoch, layer) and the rows' global ``ids``. ``float32 [rows, width]``, or ``SparseRows`` of
    the same pattern for sparse ``src`` (its dropped entries stored as zeros)."""
    h = as_float32(src, "src")
    if np.shape(ids) != (h.shape[0],):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({h.shape[0]},) (one id per row)")
    if isinstance(h, SparseRows):
        _dense_only(activation)
        if not (training and p > 0.0):
            return h
        # The dense mask read at the stored positions: the same draws, so the same H where X != 0.
        keep = keep_at(*key, np.asarray(ids)[h.entry_rows()], h.indices, h.shape[1], p)
        return h.with_data(np.where(keep, h.data * np.float32(1.0 / (1.0 - p)), np.float32(0.0)))
    return _prepared(h, ids, key, p, activation, training, _fused(h.size) if training and p > 0.0 else None)


def _prepared(h: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, activation: str | None,
              training: bool, fused: Any, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`prepare` of dense float32 ``h`` whose ids are checked, on the ``fused`` kernel's
    module (into ``out``, C-contiguous float32 of ``h``'s shape, where given) or on numpy (None)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    if fused is not None and activation != "elu":
        mode = fused.RELU_OF_X if activation == "relu" else fused.PLAIN
        return fused.dropped(h, ids, key, p, mode, out=out)
    if activation == "relu":
        h = np.maximum(h, np.float32(0.0))
    elif activation == "elu":
        h = np.where(h > 0, h, np.expm1(np.minimum(h, np.float32(0.0))))
    if training and p > 0.0:
        h = _dropout(h, ids, key, p, fused)
    return h


# Rows per block of the blocked projections: a block's dropped copy, mask and hash temporaries
# (about 5x its rows' bytes) stay a few MB however many rows an interval has. On the fused path
# one block buffer is reused, still in cache when BLAS reads it: 50,000 x 128 rows x 16, one
# thread, CPU ms for project / project_grad: 8192 rows 15.2 / 13.8, 4096 11.6 / 12.3, 2048
# 12.4 / 13.4; 602 wide: 8192 94 / 104, 4096 87 / 104, 1024 70 / 79.
PROJECT_BLOCK_ROWS = 4096


def project(src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, activation: str | None,
            training: bool, w: np.ndarray) -> np.ndarray:
    """``prepare(src, ids, key, p, activation, training) @ w``, float32 ``[rows, w.shape[1]]``,
    a block of :data:`PROJECT_BLOCK_ROWS` rows at a time: the dropped ``[rows, width]`` input
    never exists whole (layer 0 of a wide-feature graph: an interval's rows are hundreds of MB)."""
    n = src.shape[0]
    if isinstance(src, SparseRows) or n <= PROJECT_BLOCK_ROWS:
        return matmul(prepare(src, ids, key, p, activation, training), w)
    if np.shape(ids) != (n,):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({n},) (one id per row)")
    w = as_float32(w, "w")
    out = np.empty((n, w.shape[1]), dtype=np.float32)
    fused = _fused(src.size) if training and p > 0.0 else None
    block = None if fused is None else np.empty((PROJECT_BLOCK_ROWS, src.shape[1]), dtype=np.float32)
    for lo in range(0, n, PROJECT_BLOCK_ROWS):
        hi = min(lo + PROJECT_BLOCK_ROWS, n)
        h = _prepared(as_float32(src[lo:hi], "src"), ids[lo:hi], key, p, activation, training, fused,
                      None if block is None else block[:hi - lo])
        out[lo:hi] = matmul(h, w)
    return out


def project_grad(src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, activation: str | None,
                 grad: np.ndarray) -> np.ndarray:
    """``prepare(src, ids, key, p, activation, True).T @ grad``: the weight gradient of
    :func:`project`, float32 ``[width, grad.shape[1]]``, summed over row blocks in float64 (no
    less accurate than one float32 product over all rows)."""
    n = src.shape[0]
    grad = check_shape(grad, "grad", (n, None))
    if isinstance(src, SparseRows) or n <= PROJECT_BLOCK_ROWS:
        return prepare(src, ids, key, p, activation, True).T @ grad
    if np.shape(ids) != (n,):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({n},) (one id per row)")
    total = np.zeros((src.shape[1], grad.shape[1]), dtype=np.float64)
    fused = _fused(src.size) if p > 0.0 else None
    block = None if fused is None else np.empty((PROJECT_BLOCK_ROWS, src.shape[1]), dtype=np.float32)
    for lo in range(0, n, PROJECT_BLOCK_ROWS):
        hi = min(lo + PROJECT_BLOCK_ROWS, n)
        h = _prepared(as_float32(src[lo:hi], "src"), ids[lo:hi], key, p, activation, True, fused,
                      None if block is None else block[:hi - lo])
        total += h.T @ grad[lo:hi]
    return total.astype(np.float32)


def dropout(x: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float) -> np.ndarray:
    """Inverted dropout of float32 ``x [len(ids), width]`` by ``keep_mask(*key, ids, width, p)``,
    ``p`` in ``(0, 1)``, as a new float32 array: ``x * scale`` where kept and ``x * 0`` where
    dropped (``-0.0`` for negative ``x``, NaN for NaN), ``scale = float32(1 / (1 - p))``. The
    fused kernel and numpy give the same bits."""
    return _dropout(x, ids, key, p, _fused(x.size))


def _dropout(x: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, fused: Any) -> np.ndarray:
    if fused is not None:
        return fused.dropped(x, ids, key, p)
    # (x * keep) * scale: a bool multiply, not np.where, which was 15x slower here on 128-wide
    # dense rows (11 of a layer-0 call's 19 ms on 12,500 rows)
    out = np.multiply(x, keep_mask(*key, ids, x.shape[1], p), dtype=np.float32)
    out *= np.float32(1.0 / (1.0 - p))
    return out


def prepare_backward(grad_h: np.ndarray, src: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float,
                     activation: str | None) -> np.ndarray:
    """``dL/dsrc = dL/dH * M / (1 - p) * act'(src)`` with the same mask ``M`` as the forward
    (``relu' = [src > 0]``, ``elu' = 1`` where ``src > 0``, else ``exp(src)``). Sparse ``src``
    (no activation) gives the dense ``dL/dsrc`` all the same."""
    src = as_float32(src, "src")
    grad = check_shape(grad_h, "grad", src.shape)
    if np.shape(ids) != (src.shape[0],):
        raise ValueError(f"ids has shape {np.shape(ids)}, expected ({src.shape[0]},) (one id per row)")
    if isinstance(src, SparseRows):
        _dense_only(activation)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    fused = _fused(grad.size) if p > 0.0 else None
    if fused is not None and activation == "relu":
        return fused.dropped(grad, ids, key, p, fused.GATED_BY_SRC, gate=src)
    if p > 0.0:
        grad = _dropout(grad, ids, key, p, fused)
    if activation == "relu":
        grad = np.where(src > 0, grad, np.float32(0.0))
    elif activation == "elu":
        grad = np.where(src > 0, grad, grad * np.exp(np.minimum(src, np.float32(0.0))))
    return grad


def loss_stage(rows: list[np.ndarray], args: dict[str, Any]):
    """The ``LOSS`` stage of a model whose last layer ends in logits: ``(Y, labels, split) -> dY``
    (training) and the loss share and accuracy counts in ``meta``."""
    from dorylus.models.base import Result

    y, labels, split = rows
    training = bool(args["training"])
    loss = softmax_cross_entropy(y, labels, split, int(args["train_count"]), training)
    return Result([loss.grad] if training else [], meta=loss.meta)


class _Loss:
    """``meta`` and, training, ``dL/dlogits`` kept as its non-zero rows: ``train_grad`` on rows
    ``train_rows`` of the ``[n, C]`` logits (the train rows are a few percent of an interval,
    so a product with the gradient needs only them)."""

    def __init__(self, meta: dict[str, Any], shape: tuple[int, int], train_rows: np.ndarray | None = None,
                 train_grad: np.ndarray | None = None):
        self.meta, self.shape, self.train_rows, self.train_grad = meta, shape, train_rows, train_grad

    @functools.cached_property
    def grad(self) -> np.ndarray | None:
        """``dL/dlogits`` as a dense ``float32 [n, C]`` array (None when not training)."""
        if self.train_grad is None:
            return None
        grad = np.zeros(self.shape, np.float32)
        grad[self.train_rows] = self.train_grad
        return grad


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, split: np.ndarray, train_count: int,
                          training: bool) -> _Loss:
    """Loss share, accuracy counts and ``dL/dlogits`` of one interval.

    With ``S = softmax(Y)`` row-wise, ``T`` the train rows, ``N = train_count`` (global)::

        loss = -sum_{i in T} log S[i, label_i] / N
        G    = (S - onehot(label)) / N  on rows in T, 0 elsewhere

    ``meta`` holds ``loss`` and, evaluating (``training`` false), ``correct_train``/``_val``/
    ``_test``: rows of each split whose argmax (first maximum on ties, as torch.argmax) equals the
    label. Training, it holds the loss alone: accuracy is the evaluation pass's (without dropout),
    and counting it would take an argmax over every row. Rows outside every split may have any
    label (e.g. -1).
    """
    logits = as_float32(logits, "logits")
    labels, split = _check_loss_inputs(logits.shape, labels, split, train_count)
    return _block_loss(logits, labels, split, train_count, training)


def softmax_regression(z: np.ndarray, w: np.ndarray, b: np.ndarray, labels: np.ndarray, split: np.ndarray,
                       train_count: int, training: bool, block_rows: int | None = None):
    """:func:`softmax_cross_entropy` of the logits ``Y = z @ w + b`` (``z [n, k]``, ``w [k, C]``,
    ``b [C]``) and, training, the gradients ``dL/dz = G w^T``, ``dL/dw = z^T G``, ``dL/db = 1^T G``,
    a block of ``block_rows`` rows at a time, so that no ``[n, C]`` array (logits, softmax, ``G``)
    exists whole: an ogbn-products interval's are 113 MB each at 47 classes.

    Training computes the logits of the train rows only (the others carry neither loss nor
    gradient, and the training ``meta`` has no accuracy counts): 8% of an ogbn-products
    interval's rows. Returns ``(meta, grad_z, grad_w, grad_b)``; the gradients are None when not
    training. ``grad_w`` and ``grad_b`` are summed over the blocks in float64."""
    z, w = as_float32(z, "z"), as_float32(w, "w")
    n = z.shape[0]
    if z.shape[1] != w.shape[0]:
        raise ValueError(f"rows have {z.shape[1]} columns but w has {w.shape[0]} rows (shapes {z.shape}, {w.shape})")
    if np.shape(b) != (w.shape[1],):
        raise ValueError(f"b has shape {np.shape(b)}, expected ({w.shape[1]},) (one per column of w)")
    labels, split = _check_loss_inputs((n, w.shape[1]), labels, split, train_count)
    block_rows = block_rows or LOSS_BLOCK_ROWS
    if not training:
        meta: dict[str, Any] = {}
        for lo in range(0, n, block_rows) if n else [0]:
            hi = min(lo + block_rows, n)
            block = _block_loss(z[lo:hi] @ w + b, labels[lo:hi], split[lo:hi], train_count, False)
            meta = {k: meta.get(k, 0) + v for k, v in block.meta.items()}
        return meta, None, None, None
    train_rows = np.flatnonzero(split & TRAIN)
    loss = 0.0
    grad_z = np.zeros(z.shape, np.float32)
    grad_w = np.zeros(w.shape, np.float64)
    grad_b = np.zeros(w.shape[1], np.float64)
    for lo in range(0, len(train_rows), block_rows):
        rows = train_rows[lo:lo + block_rows]
        z_rows = z[rows]
        block_loss, grad = _train_loss(z_rows @ w + b, labels[rows], train_count)
        loss += block_loss
        grad_z[rows] = grad @ w.T
        grad_w += z_rows.T @ grad
        grad_b += grad.sum(0)
    return {"loss": loss}, grad_z, grad_w.astype(np.float32), grad_b.astype(np.float32)


# Rows of one softmax_regression block: [32768, C] logits are 6 MB at 47 classes, and a loop of
# a few dozen numpy calls per block costs well under a millisecond.
LOSS_BLOCK_ROWS = 1 << 15


def _check_loss_inputs(shape: tuple[int, int], labels, split, train_count):
    """``labels`` and ``split`` as arrays, checked against logits of ``shape`` (see
    :func:`softmax_cross_entropy`): ValueErrors name the problem and the first bad row."""
    n, num_classes = shape
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
    return labels, split


def _block_loss(logits: np.ndarray, labels: np.ndarray, split: np.ndarray, train_count: int, training: bool) -> _Loss:
    """:func:`softmax_cross_entropy` on checked inputs."""
    train_rows = np.flatnonzero(split & TRAIN)
    if training:
        loss, train_grad = _train_loss(logits[train_rows], labels[train_rows], train_count)
        return _Loss({"loss": loss}, logits.shape, train_rows, train_grad)
    correct_rows = np.argmax(logits, axis=1) == labels
    meta: dict[str, Any] = {f"correct_{name}": int(np.count_nonzero(correct_rows & ((split & bit) != 0)))
                            for name, bit in SPLITS.items()}
    meta["loss"] = _train_loss(logits[train_rows], labels[train_rows], train_count, grad=False)[0]
    return _Loss(meta, logits.shape)


def _train_loss(logits: np.ndarray, labels: np.ndarray, train_count: int, grad: bool = True):
    """``(loss share, dL/dlogits or None)`` of train rows' ``logits [t, C]`` with ``labels [t]``."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp never overflows
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    picked = np.arange(len(labels)), labels
    loss = float(-(shifted - log_sum)[picked].sum(dtype=np.float64) / train_count)
    if not grad:
        return loss, None
    train_grad = np.exp(shifted - log_sum)
    train_grad[picked] -= np.float32(1.0)
    return loss, train_grad / np.float32(train_count)


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, w = as_float32(x, "rows"), as_float32(w, "w")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"rows have {x.shape[1]} columns but w has {w.shape[0]} rows (shapes {x.shape}, {w.shape})")
    return x @ w


def check_shape(x: np.ndarray, name: str, shape: tuple[int | None, int]) -> np.ndarray:
    x = as_float32(x, name)
    if any(want is not None and got != want for got, want in zip(x.shape, shape)):
        raise ValueError(f"{name} has shape {x.shape}, expected {tuple('any' if d is None else d for d in shape)}")
    return x


def check_rows_or_sum(x: np.ndarray, name: str, rows: int, width: int) -> np.ndarray:
    """``x`` as ``[rows, width]``, or as ``[1, width]``: the sum of those rows, which is what a
    function pulls for a read its stage declares ``summed``."""
    return check_shape(x, name, (1 if x.shape[0] == 1 else rows, width))


def concat(parts: list[np.ndarray], axis: int) -> np.ndarray:
    return np.concatenate(parts, axis=axis)


def vstack(parts: list[np.ndarray]) -> np.ndarray:
    return np.vstack(parts)


def as_float32(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as a 2-D float32 array; :class:`SparseRows` (float32 by construction) as they are."""
    if isinstance(x, SparseRows):
        return x
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {x.shape}")
    return x.astype(np.float32, copy=False)


def dense(x) -> np.ndarray:
    """Dense float32 rows of either layout (a stage that writes ``x`` into a row buffer)."""
    return x.toarray() if isinstance(x, SparseRows) else as_float32(x, "rows")


def _dense_only(activation: str | None) -> None:
    if activation is not None:
        raise ValueError(f"activation {activation!r} on sparse rows: only layer 0's input features are sparse, "
                         "and layer 0 has no input activation")
