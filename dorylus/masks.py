"""Dropout masks keyed by (seed, epoch, layer, global vertex id, column).

Every role that applies dropout (the reference trainer, the cpu backend, the Lambda function)
derives the same mask from the same key, so results do not depend on partitioning or intervals.
Numpy only: the Lambda function imports this without torch. A counter-based hash is also much
faster here than torch's Bernoulli sampler. The same hash runs fused with the dropout itself in
``dorylus/models/_dropout_numba.py`` (graph servers, the reference) and in int64 torch kernels
in :mod:`dorylus.models.torch_ops` (the gpu backend): a change here is a change there, and
tests hold them bit-equal. :func:`dorylus.models.ops.dropout` applies a mask.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _stream_key(seed: int, epoch: int, layer: int) -> np.uint64:
    key = np.array([seed, epoch, layer], dtype=np.uint64)
    acc = np.zeros(1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for part in key:
            acc = _mix64(acc ^ (part + _GOLDEN))
    return acc[0]


def keep_mask(seed: int, epoch: int, layer: int, vertex_ids: np.ndarray, width: int, p: float) -> np.ndarray:
    """``bool [len(vertex_ids), width]``: ``True`` where the element is kept, with probability ``1 - p``.

    Element ``(v, j)`` depends only on ``(seed, epoch, layer, v, j)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    ids = np.asarray(vertex_ids, dtype=np.uint64)
    # One 64-bit hash per 4 columns, split into four 16-bit uniforms (p resolves to 1/65536).
    blocks = -(-width // 4)
    with np.errstate(over="ignore"):
        counter = ids[:, None] * np.uint64(blocks) + np.arange(blocks, dtype=np.uint64)[None, :]
        counter *= _GOLDEN
        counter += _stream_key(seed, epoch, layer)
        bits = _mix64(counter).astype("<u8", copy=False).view("<u2")
    return bits.reshape(len(ids), blocks * 4)[:, :width] >= _threshold(p)


def keep_at(seed: int, epoch: int, layer: int, vertex_ids: np.ndarray, columns: np.ndarray, width: int,
            p: float) -> np.ndarray:
    """``bool [k]``: ``keep_mask(seed, epoch, layer, vertex_ids, width, p)`` read at the ``k``
    positions ``(vertex_ids[i], columns[i])`` only, without building the ``[rows, width]`` mask
    (sparse features: their non-zeros). ``width`` is the full row width, which fixes the hash
    layout (one 64-bit hash per 4 columns of a row)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    ids, cols = np.asarray(vertex_ids), np.asarray(columns)
    if ids.shape != cols.shape or ids.ndim != 1:
        raise ValueError(f"vertex_ids and columns must be 1-D of one length, got {ids.shape} and {cols.shape}")
    if cols.size and (cols.min() < 0 or cols.max() >= width):
        raise ValueError(f"columns must be in [0, {width}), got [{cols.min()}, {cols.max()}]")
    blocks = -(-width // 4)
    cols = cols.astype(np.uint64)
    with np.errstate(over="ignore"):
        counter = ids.astype(np.uint64) * np.uint64(blocks)
        counter += cols >> np.uint64(2)
        counter *= _GOLDEN
        counter += _stream_key(seed, epoch, layer)
        bits = _mix64(counter)
    # Column j is the (j mod 4)-th little-endian 16-bit lane of its block's hash, as in keep_mask.
    bits >>= (cols & np.uint64(3)) << np.uint64(4)
    return (bits & np.uint64(0xFFFF)).astype(np.uint16) >= _threshold(p)


def _threshold(p: float) -> np.uint16:
    """A 16-bit uniform at or above this is kept: probability ``1 - p`` to within 1/65536."""
    return np.uint16(min(int(round(p * 65536)), 65535))


# Edge masks draw from their own streams, never correlated with a vertex mask of the same key.
_EDGE_STREAM = np.uint64(0x5EED_ED6E_0000_0001)


def keep_edge_mask(seed: int, epoch: int, layer: int, dst_ids: np.ndarray, src_ids: np.ndarray, width: int,
                   p: float) -> np.ndarray:
    """``bool [nnz, width]`` for edges ``src -> dst`` (global vertex ids): ``True`` where kept,
    with probability ``1 - p``. Element ``(e, j)`` depends only on ``(seed, epoch, layer,
    dst_e, src_e, j)``, so attention dropout does not depend on partitioning either."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    dst, src = np.asarray(dst_ids, dtype=np.uint64), np.asarray(src_ids, dtype=np.uint64)
    if dst.shape != src.shape or dst.ndim != 1:
        raise ValueError(f"dst_ids and src_ids must be 1-D of one length, got {dst.shape} and {src.shape}")
    blocks = -(-width // 4)
    with np.errstate(over="ignore"):
        edge = dst * _GOLDEN
        edge += _stream_key(seed, epoch, layer) ^ _EDGE_STREAM
        edge = _mix64(edge)
        edge ^= src * _M2
        counter = edge[:, None] + np.arange(blocks, dtype=np.uint64)[None, :] * _GOLDEN
        bits = _mix64(counter).astype("<u8", copy=False).view("<u2")
    return bits.reshape(len(dst), blocks * 4)[:, :width] >= _threshold(p)
