"""The torch twin of :mod:`dorylus.models.ops`: the same functions over torch tensors on any
device, so that a model's ``compute`` (written once over an ``ops`` module) runs on the graph
server's device (the ``gpu`` backend) as well as on numpy (functions, ``cpu`` backend).

Every tensor a stage reads lives on one device: rows ``float32 [n, width]``, ``ids`` ``int64
[n]``, ``labels`` ``int64 [n]``, ``split`` ``uint8 [n]``. Dropout masks are drawn on that device
by :func:`keep_mask`, the counter hash of :func:`dorylus.masks.keep_mask` in int64 arithmetic:
the same bits, so the same masks as every other role (sync training is exact only because every
backend drops the same elements). Results equal the numpy functions' within float32 rounding
(the products may sum in another order); the masks and the argmax are exact.

Nothing here waits for the device: the loss and the accuracy counts come back as 0-d tensors on
it (``Result.meta``), which the gpu backend copies to the host once per stage, together with the
gradients (:meth:`graphserver.backends.gpu_device.DeviceState.compute`). A :class:`MaskCache` (what
:class:`Ops` binds) computes each dropout mask once per (epoch, layer, rows) and gives it to the
backward pass instead of hashing again.

Not part of the Lambda bundle (it imports torch); nothing in the bundle imports it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from dorylus import masks
from dorylus.models.ops import SPLITS, TRAIN

# The hash's 16-bit lanes are read by viewing int64 words as int16 (see _keep_of_bits): lane k is
# bits 16k..16k+15 only on a little-endian machine, which CUDA devices and x86/ARM hosts are.
assert sys.byteorder == "little", "torch_ops reads the dropout hash's 16-bit lanes little-endian"


def _signed(value) -> int:
    """A uint64 constant as the int64 with the same bits (torch multiplies int64, wrapping)."""
    value = int(value) & ((1 << 64) - 1)
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _M1, _M2 = _signed(masks._GOLDEN), _signed(masks._M1), _signed(masks._M2)
# XOR with this maps each unsigned 16-bit lane u to u - 32768 read as int16, so that unsigned
# order (numpy's uint16 comparison) becomes signed order (torch has no uint16 comparisons).
_LANE_FLIP = _signed(0x8000_8000_8000_8000)


def _xor_shift_(x: torch.Tensor, bits: int) -> None:
    """``x ^= x >>> bits`` in place, ``>>>`` the logical shift of int64 read as uint64 (torch
    shifts int64 arithmetically, so the sign copies are masked off): three kernels, one temporary."""
    shifted = x >> bits
    shifted &= (1 << (64 - bits)) - 1
    x ^= shifted


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (:func:`dorylus.masks._mix64`) in place on int64 bits: 11 kernels."""
    _xor_shift_(x, 30)
    x *= _M1
    _xor_shift_(x, 27)
    x *= _M2
    _xor_shift_(x, 31)
    return x


def _keep_of_bits(bits: torch.Tensor, width: int, p: float) -> torch.Tensor:
    """``bool [rows, width]`` from ``bits`` ``int64 [rows, blocks]`` (consumed): column ``4b + k``
    is the k-th little-endian 16-bit lane of ``bits[:, b]``, kept where it is at or above the
    threshold of ``p``, as numpy's ``view("<u2") >= threshold``. Two kernels: the lane flip and
    one comparison on an int16 view (no lane is extracted into a tensor of its own)."""
    bits ^= _LANE_FLIP
    lanes = bits.view(torch.int16)
    return lanes[:, :width] >= int(masks._threshold(p)) - 32768


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")


def keep_mask(key: tuple[int, int, int], ids: torch.Tensor, width: int, p: float) -> torch.Tensor:
    """``bool [len(ids), width]`` on ``ids``' device, equal to
    ``dorylus.masks.keep_mask(*key, ids, width, p)``: one 64-bit hash per 4 columns of row
    ``ids[i]``, its four little-endian 16-bit lanes compared with the threshold of ``p``.

    The counter ``(id * blocks + b) * GOLDEN + stream`` (mod 2^64) is formed as a per-row term
    ``id * (blocks * GOLDEN) + stream`` plus a per-block term ``b * GOLDEN``: one broadcast add
    over ``[rows, blocks]``, then the finalizer in place and the lane comparison, 14 kernels over
    the block matrix and one ``int64 [rows, blocks]`` temporary besides it (the lanes are never
    widened: at most about ``5 * rows * width`` bytes live, the mask included)."""
    _check_p(p)
    blocks = -(-width // 4)
    row = ids.to(torch.int64) * _signed(blocks * int(masks._GOLDEN))
    row += _signed(masks._stream_key(*key))
    block = torch.arange(blocks, dtype=torch.int64, device=ids.device) * _GOLDEN
    bits = row[:, None] + block[None, :]
    return _keep_of_bits(_mix64_(bits), width, p)


def keep_edge_mask(key: tuple[int, int, int], dst_ids: torch.Tensor, src_ids: torch.Tensor, width: int,
                   p: float) -> torch.Tensor:
    """``bool [nnz, width]`` on the ids' device, equal to
    ``dorylus.masks.keep_edge_mask(*key, dst_ids, src_ids, width, p)`` (GAT's attention dropout)."""
    _check_p(p)
    if dst_ids.shape != src_ids.shape or dst_ids.dim() != 1:
        raise ValueError(f"dst_ids and src_ids must be 1-D of one length, got {tuple(dst_ids.shape)} and "
                         f"{tuple(src_ids.shape)}")
    blocks = -(-width // 4)
    edge = dst_ids.to(torch.int64) * _GOLDEN  # a new tensor: the in-place steps never touch the ids
    edge += _signed(masks._stream_key(*key) ^ masks._EDGE_STREAM)
    _mix64_(edge)
    edge ^= src_ids.to(torch.int64) * _M2
    if blocks == 1:  # up to 4 heads: the block term is 0, the edge hash is the counter itself
        bits = edge[:, None]
    else:
        bits = edge[:, None] + torch.arange(blocks, dtype=torch.int64, device=dst_ids.device)[None, :] * _GOLDEN
    return _keep_of_bits(_mix64_(bits), width, p)


class MaskCache:
    """Dropout keep masks, each hashed once per (seed, epoch, layer, rows, width, p) and handed to
    every later use of the same key: the backward pass (``prepare_backward``, and the forward
    ``H`` that a weight gradient recomputes) reads what the forward pass drew instead of hashing
    again. Masks are ``bool`` (one byte per element).

    Only rows of ``ids`` (the partition's static ids tensor, alive as long as the state that
    owns this cache) are cached, keyed by their offset in it: a tensor that merely has the same
    address later can never hit. Masks of the ``epochs`` newest epochs are kept (sync needs one,
    pipe overlaps an epoch's backward with the next epoch's forward); an older epoch's mask is
    hashed and not stored. Masks are deterministic, so a miss costs time, never exactness.
    Thread-safe: stages of several intervals run in worker threads."""

    def __init__(self, ids: torch.Tensor, epochs: int = 2):
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.ids, self.epochs = ids, epochs
        self.hashed = 0  # masks computed (not found): what the tests count
        self._masks: dict[tuple, torch.Tensor] = {}
        self._newest = None
        self._lock = threading.Lock()

    def _rows(self, ids: torch.Tensor) -> tuple[int, int] | None:
        base = self.ids
        if (ids.dim() != 1 or ids.dtype != base.dtype or ids.device != base.device or ids.stride(0) != 1
                or ids.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()):
            return None
        return ids.storage_offset() - base.storage_offset(), len(ids)

    def keep(self, key: tuple[int, int, int], ids: torch.Tensor, width: int, p: float) -> torch.Tensor:
        """``keep_mask(key, ids, width, p)``, from the cache where it holds it."""
        rows = self._rows(ids)
        name = (tuple(key), rows, width, float(p))
        with self._lock:
            mask = self._masks.get(name) if rows is not None else None
        if mask is not None:
            return mask
        mask = keep_mask(key, ids, width, p)
        with self._lock:
            self.hashed += 1
            epoch = key[1]
            if rows is None or (self._newest is not None and epoch <= self._newest - self.epochs):
                return mask
            self._masks[name] = mask
            if self._newest is None or epoch > self._newest:
                self._newest = epoch
                self._masks = {k: m for k, m in self._masks.items() if k[0][1] > epoch - self.epochs}
        return mask

    def __len__(self) -> int:
        return len(self._masks)


def _dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``where(keep, x * s, 0)`` with ``s = float32(1 / (1 - p))``, as numpy's: the dropped
    elements zeroed, then one in-place scale (``0 * s`` is 0, so the order does not matter)."""
    return torch.where(keep, x, 0.0).mul_(1.0 / (1.0 - p))


def _keep(masks_: MaskCache | None, key, ids: torch.Tensor, width: int, p: float) -> torch.Tensor:
    return keep_mask(key, ids, width, p) if masks_ is None else masks_.keep(key, ids, width, p)


def prepare(src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int], p: float, activation: str | None,
            training: bool, masks_: MaskCache | None = None) -> torch.Tensor:
    """:func:`dorylus.models.ops.prepare`: ``H = dropout(act(src))`` (the mask from ``masks_``
    where given)."""
    h = check_shape(src, "src", (None, None))
    if activation == "relu":
        h = torch.relu(h)
    elif activation == "elu":
        h = F.elu(h)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    if training and p > 0.0:
        return _dropout(h, _keep(masks_, key, ids, h.shape[1], p), p)
    return h


def project(src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int], p: float, activation: str | None,
            training: bool, w: torch.Tensor, masks_: MaskCache | None = None) -> torch.Tensor:
    """:func:`dorylus.models.ops.project`, in one piece: a device's memory is sized for the
    whole interval (the numpy twin blocks its rows to bound a process's temporaries)."""
    return matmul(prepare(src, ids, key, p, activation, training, masks_), w)


def project_grad(src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int], p: float,
                 activation: str | None, grad: torch.Tensor, masks_: MaskCache | None = None) -> torch.Tensor:
    """:func:`dorylus.models.ops.project_grad`: ``prepare(src, ..., True).T @ grad``."""
    return prepare(src, ids, key, p, activation, True, masks_).T @ check_shape(grad, "grad", (src.shape[0], None))


def prepare_backward(grad_h: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int],
                     p: float, activation: str | None, masks_: MaskCache | None = None) -> torch.Tensor:
    """:func:`dorylus.models.ops.prepare_backward`: ``dL/dsrc = dL/dH * M / (1 - p) * act'(src)``,
    ``M`` the forward's mask (from ``masks_`` where given: not hashed again)."""
    grad = check_shape(grad_h, "grad", tuple(src.shape))
    if p > 0.0:
        grad = _dropout(grad, _keep(masks_, key, ids, grad.shape[1], p), p)
    if activation == "relu":
        grad = torch.where(src > 0, grad, 0.0)
    elif activation == "elu":
        grad = torch.where(src > 0, grad, grad * torch.exp(torch.clamp(src, max=0.0)))
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    return grad


class _Loss(NamedTuple):
    """The loss meta and, training, the dense ``dL/dlogits`` (None otherwise)."""

    meta: dict[str, Any]
    grad: torch.Tensor | None


def loss_stage(rows: list[torch.Tensor], args: dict[str, Any]):
    """:func:`dorylus.models.ops.loss_stage`: ``(Y, labels, split) -> dY`` and the loss share."""
    from dorylus.models.base import Result

    y, labels, split = rows
    training = bool(args["training"])
    loss = softmax_cross_entropy(y, labels, split, int(args["train_count"]), training)
    return Result([loss.grad] if training else [], meta=loss.meta)


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, split: torch.Tensor, train_count: int,
                          training: bool) -> _Loss:
    """:func:`dorylus.models.ops.softmax_cross_entropy` (the same formulas, the loss summed in
    float64; argmax takes the first maximum on ties, as numpy's), without waiting for the device:
    every row is computed and the train rows selected by masking (no ``nonzero``, whose size
    the host would have to read), and ``meta`` holds 0-d tensors on the logits' device (the
    loss float64, the counts int64), read by the caller with its other results.

    Masking instead of compacting changes no value: a train row's loss term and gradient are the
    same float32 operations on the same row; other rows add exact zeros to the float64 sum."""
    if train_count < 1:
        raise ValueError(f"train_count must be >= 1, got {train_count!r}")
    train = (split & int(TRAIN)) != 0
    # Checked on the device: asynchronously on an accelerator (a failure aborts its queued work),
    # at once on the CPU; either way the host never reads the count.
    message = f"train_count must be >= 1 and >= this interval's train rows, got {train_count!r}"
    try:
        torch._assert_async(train.sum() <= train_count, message)
    except RuntimeError as exc:
        raise ValueError(message) from exc
    meta: dict[str, Any] = {}
    if not training:  # accuracy counts are the evaluation pass's, as in ops
        correct_rows = logits.argmax(dim=1) == labels
        meta = {f"correct_{name}": (correct_rows & ((split & int(bit)) != 0)).sum() for name, bit in SPLITS.items()}
    shifted = logits - logits.max(dim=1, keepdim=True).values
    log_sum = torch.log(torch.exp(shifted).sum(dim=1, keepdim=True))
    log_p = shifted - log_sum
    label_col = torch.where(train, labels, 0)[:, None]  # rows outside every split may have label -1
    picked = log_p.gather(1, label_col).squeeze(1)
    meta["loss"] = -torch.where(train, picked, 0.0).sum(dtype=torch.float64) / train_count
    if not training:
        return _Loss(meta, None)
    grad = torch.exp(log_p)
    # -1 at the label of train rows; other rows get -0.0, which changes nothing before the mask.
    grad.scatter_add_(1, label_col, -train.to(grad.dtype)[:, None])
    grad = torch.where(train[:, None], grad, 0.0)
    return _Loss(meta, grad.div_(float(np.float32(train_count))))


def softmax_regression(z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, labels: torch.Tensor,
                       split: torch.Tensor, train_count: int, training: bool):
    """:func:`dorylus.models.ops.softmax_regression` in one block: ``(meta, grad_z, grad_w,
    grad_b)`` of the logits ``z @ w + b``, the gradients None when not training."""
    z = as_float32(z, "z")
    if z.shape[1] != w.shape[0]:
        raise ValueError(f"rows have {z.shape[1]} columns but w has {w.shape[0]} rows "
                         f"(shapes {tuple(z.shape)}, {tuple(w.shape)})")
    if tuple(b.shape) != (w.shape[1],):
        raise ValueError(f"b has shape {tuple(b.shape)}, expected ({w.shape[1]},) (one per column of w)")
    loss = softmax_cross_entropy(z @ w + b, labels, split, train_count, training)
    if not training:
        return loss.meta, None, None, None
    return loss.meta, loss.grad @ w.T, z.T @ loss.grad, loss.grad.sum(0)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"rows have {x.shape[1]} columns but w has {w.shape[0]} rows "
                         f"(shapes {tuple(x.shape)}, {tuple(w.shape)})")
    return x @ w


def check_shape(x: torch.Tensor, name: str, shape: tuple[int | None, ...]) -> torch.Tensor:
    x = as_float32(x, name)
    if any(want is not None and got != want for got, want in zip(x.shape, shape)):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple('any' if d is None else d for d in shape)}")
    return x


def check_rows_or_sum(x: torch.Tensor, name: str, rows: int, width: int) -> torch.Tensor:
    """:func:`dorylus.models.ops.check_rows_or_sum`'s twin: ``[rows, width]`` or ``[1, width]``."""
    return check_shape(x, name, (1 if x.shape[0] == 1 else rows, width))


def as_float32(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` itself: a device stage's rows are float32 matrices by construction (checked, not converted)."""
    if x.ndim != 2 or x.dtype != torch.float32:
        raise ValueError(f"{name} must be a 2-D float32 matrix, got {x.dtype} of shape {tuple(x.shape)}")
    return x


def dense(x: torch.Tensor) -> torch.Tensor:
    """Rows on a device are dense (the gpu backend densifies sparse input features)."""
    return x


def concat(parts: list[torch.Tensor], axis: int) -> torch.Tensor:
    return torch.cat(parts, dim=axis)


def vstack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


class Ops:
    """This module as an ``ops`` object whose dropout reads ``masks`` (a :class:`MaskCache`):
    what a graph server's device state passes to ``model.compute``. Every other function is the
    module's own."""

    def __init__(self, masks_: MaskCache):
        self.masks = masks_

    def __getattr__(self, name: str):
        return globals()[name] if not name.startswith("_") and name in globals() else object.__getattribute__(self, name)

    def prepare(self, src, ids, key, p, activation, training):
        return prepare(src, ids, key, p, activation, training, self.masks)

    def prepare_backward(self, grad_h, src, ids, key, p, activation):
        return prepare_backward(grad_h, src, ids, key, p, activation, self.masks)

    def project(self, src, ids, key, p, activation, training, w):
        return project(src, ids, key, p, activation, training, w, self.masks)

    def project_grad(self, src, ids, key, p, activation, grad):
        return project_grad(src, ids, key, p, activation, grad, self.masks)
