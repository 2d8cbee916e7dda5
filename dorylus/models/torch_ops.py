"""The torch twin of :mod:`dorylus.models.ops`: the same functions over torch tensors on any
device, so that a model's ``compute`` (written once over an ``ops`` module) runs on the graph
server's device (the ``gpu`` backend) as well as on numpy (functions, ``cpu`` backend).

Every tensor a stage reads lives on one device: rows ``float32 [n, width]``, ``ids`` ``int64
[n]``, ``labels`` ``int64 [n]``, ``split`` ``uint8 [n]``. Dropout masks are drawn on that device
by :func:`keep_mask`, the counter hash of :func:`dorylus.masks.keep_mask` in int64 arithmetic:
the same bits, so the same masks as every other role. Results equal the numpy functions' within
float32 rounding (the products may sum in another order); the masks and the argmax are exact.

Not part of the Lambda bundle (it imports torch); nothing in the bundle imports it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dorylus import masks
from dorylus.models.ops import SPLITS, TRAIN, _Loss


def _signed(value: np.uint64) -> int:
    """A uint64 constant as the int64 with the same bits (torch multiplies int64, wrapping)."""
    value = int(value)
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _M1, _M2 = _signed(masks._GOLDEN), _signed(masks._M1), _signed(masks._M2)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical ``x >> bits`` of int64 read as uint64 (torch shifts int64 arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (:func:`dorylus.masks._mix64`) on int64 bits."""
    x = x ^ _shift_right(x, 30)
    x = x * _M1
    x = x ^ _shift_right(x, 27)
    x = x * _M2
    return x ^ _shift_right(x, 31)


def keep_mask(key: tuple[int, int, int], ids: torch.Tensor, width: int, p: float) -> torch.Tensor:
    """``bool [len(ids), width]`` on ``ids``' device, equal to
    ``dorylus.masks.keep_mask(*key, ids, width, p)``: one 64-bit hash per 4 columns of row
    ``ids[i]``, its four little-endian 16-bit lanes compared with the threshold of ``p``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    blocks = -(-width // 4)
    counter = ids.to(torch.int64)[:, None] * blocks + torch.arange(blocks, device=ids.device)[None, :]
    bits = _mix64(counter * _GOLDEN + _signed(masks._stream_key(*key)))
    lanes = torch.stack([(bits >> (16 * lane)) & 0xFFFF for lane in range(4)], dim=2)
    return lanes.reshape(len(ids), 4 * blocks)[:, :width] >= int(masks._threshold(p))


def keep_edge_mask(key: tuple[int, int, int], dst_ids: torch.Tensor, src_ids: torch.Tensor, width: int,
                   p: float) -> torch.Tensor:
    """``bool [nnz, width]`` on the ids' device, equal to
    ``dorylus.masks.keep_edge_mask(*key, dst_ids, src_ids, width, p)`` (GAT's attention dropout)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if dst_ids.shape != src_ids.shape or dst_ids.dim() != 1:
        raise ValueError(f"dst_ids and src_ids must be 1-D of one length, got {tuple(dst_ids.shape)} and "
                         f"{tuple(src_ids.shape)}")
    blocks = -(-width // 4)
    stream = _signed(masks._stream_key(*key) ^ masks._EDGE_STREAM)
    edge = _mix64(dst_ids.to(torch.int64) * _GOLDEN + stream) ^ (src_ids.to(torch.int64) * _M2)
    bits = _mix64(edge[:, None] + torch.arange(blocks, device=dst_ids.device)[None, :] * _GOLDEN)
    lanes = torch.stack([(bits >> (16 * lane)) & 0xFFFF for lane in range(4)], dim=2)
    return lanes.reshape(len(dst_ids), 4 * blocks)[:, :width] >= int(masks._threshold(p))


def _dropout(x: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int], p: float) -> torch.Tensor:
    return torch.where(keep_mask(key, ids, x.shape[1], p), x * (1.0 / (1.0 - p)), 0.0)


def prepare(src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int], p: float, activation: str | None,
            training: bool) -> torch.Tensor:
    """:func:`dorylus.models.ops.prepare`: ``H = dropout(act(src))``."""
    h = check_shape(src, "src", (None, None))
    if activation == "relu":
        h = torch.relu(h)
    elif activation == "elu":
        h = F.elu(h)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    return _dropout(h, ids, key, p) if training and p > 0.0 else h


def prepare_backward(grad_h: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, key: tuple[int, int, int],
                     p: float, activation: str | None) -> torch.Tensor:
    """:func:`dorylus.models.ops.prepare_backward`: ``dL/dsrc = dL/dH * M / (1 - p) * act'(src)``."""
    grad = check_shape(grad_h, "grad", tuple(src.shape))
    if p > 0.0:
        grad = _dropout(grad, ids, key, p)
    if activation == "relu":
        grad = torch.where(src > 0, grad, 0.0)
    elif activation == "elu":
        grad = torch.where(src > 0, grad, grad * torch.exp(torch.clamp(src, max=0.0)))
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}; known: relu, elu")
    return grad


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
    float64; argmax takes the first maximum on ties, as numpy's)."""
    train_rows = torch.nonzero(split & int(TRAIN)).squeeze(1)
    if train_count < max(len(train_rows), 1):
        raise ValueError(f"train_count must be >= 1 and >= this interval's {len(train_rows)} train rows, "
                         f"got {train_count!r}")
    correct_rows = logits.argmax(dim=1) == labels
    meta: dict[str, Any] = {f"correct_{name}": int((correct_rows & ((split & int(bit)) != 0)).sum())
                            for name, bit in SPLITS.items()}
    train_logits = logits.index_select(0, train_rows)
    train_labels = labels.index_select(0, train_rows)
    shifted = train_logits - train_logits.max(dim=1, keepdim=True).values
    log_sum = torch.log(torch.exp(shifted).sum(dim=1, keepdim=True))
    picked = (shifted - log_sum).gather(1, train_labels[:, None])
    meta["loss"] = float(-picked.sum(dtype=torch.float64) / train_count)
    if not training:
        return _Loss(meta, None)
    train_grad = torch.exp(shifted - log_sum)
    train_grad[torch.arange(len(train_rows), device=logits.device), train_labels] -= 1.0
    grad = torch.zeros_like(logits)
    grad.index_copy_(0, train_rows, train_grad / float(np.float32(train_count)))
    return _Loss(meta, grad)


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
