"""The keyed dropout of :mod:`dorylus.models.ops` in one pass, compiled by numba.

numpy builds the mask of :func:`dorylus.masks.keep_mask` in about ten passes over uint64
temporaries (8 bytes per 4 columns each) and applies it in two more; here a row's hashes become
the row's factors (``scale`` or 0) in a buffer that stays in L1, and every element is read and
written once. The hash, its 16-bit lanes and
the threshold are :func:`~dorylus.masks.keep_mask`'s, so the mask is the same bit for bit, and
a kept element is ``x * scale`` and a dropped one ``x * 0`` (``-0.0`` for negative ``x``), as
numpy's ``(x * keep) * scale``: the values are the same bit for bit too.

Imported lazily by :mod:`dorylus.models.ops` (inside ``try: ... except ImportError``), so the
Lambda bundle, which has no numba, neither ships nor imports this module.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dorylus.masks import _GOLDEN, _M1, _M2, _stream_key, _threshold

# What happens to an element besides the dropout: see :func:`dropped`.
PLAIN, RELU_OF_X, GATED_BY_SRC = 0, 1, 2
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_LANE = np.uint64(0xFFFF)


@njit(cache=True, inline="always")
def _mix64(x):
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@njit(cache=True, nogil=True)
def _dropped_into(x, gate, ids, stream, threshold, scale, mode, out):
    rows, width = x.shape
    blocks = (width + 3) // 4
    # One row's factors: scale where kept, 0 where dropped. Filled by a scalar loop of hashes
    # (64-bit multiplies), applied by a vector loop over the row.
    factor = np.empty(blocks * 4, dtype=np.float32)
    zero = np.float32(0.0)
    for i in range(rows):
        # block b's counter is id * blocks + b, hashed as keep_mask does: mix64(counter * GOLDEN + stream)
        base = ids[i] * np.uint64(blocks) * _GOLDEN + stream
        for b in range(blocks):
            h = _mix64(base + np.uint64(b) * _GOLDEN)
            for k in range(4):  # little-endian 16-bit lanes, as keep_mask's view("<u2")
                factor[4 * b + k] = scale if (h & _LANE) >= threshold else zero
                h >>= np.uint64(16)
        if mode == PLAIN:
            for j in range(width):
                out[i, j] = x[i, j] * factor[j]
        elif mode == RELU_OF_X:
            for j in range(width):
                v = x[i, j]
                out[i, j] = (zero if v <= zero else v) * factor[j]  # np.maximum(v, 0): NaN stays NaN
        else:
            for j in range(width):
                out[i, j] = x[i, j] * factor[j] if gate[i, j] > zero else zero  # np.where(src > 0, ., 0)


def dropped(x: np.ndarray, ids: np.ndarray, key: tuple[int, int, int], p: float, mode: int = PLAIN,
            gate: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``float32 [rows, width]``: inverted dropout of ``x`` with ``keep_mask(*key, ids, width, p)``,
    ``p`` in ``(0, 1)``: ``x * scale`` where kept, ``x * 0`` where dropped, ``scale = 1 / (1 - p)``
    in float32. ``mode`` :data:`RELU_OF_X` drops ``np.maximum(x, 0)`` instead of ``x``;
    :data:`GATED_BY_SRC` zeroes the result where ``gate > 0`` fails (relu's backward, ``gate``
    the forward's input). Written into ``out`` (C-contiguous float32, may be ``x``) when given."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in (0, 1) here, got {p}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.uint64)  # wraps as keep_mask's conversion does
    if x.ndim != 2 or ids.shape != (x.shape[0],):
        raise ValueError(f"x must be [rows, width] with one id per row, got {x.shape} and ids {ids.shape}")
    if mode == GATED_BY_SRC:
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        if gate.shape != x.shape:
            raise ValueError(f"gate has shape {gate.shape}, expected {x.shape}")
    else:
        gate = x  # never read; one array type keeps one compiled signature
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
    elif out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of shape {x.shape}, got {out.dtype} {out.shape}")
    _dropped_into(x, gate, ids, _stream_key(*key), _threshold(p), np.float32(1.0 / (1.0 - p)), mode, out)
    return out
