"""The keyed dropout's two paths: the fused numba kernel (dorylus/models/_dropout_numba.py: graph
servers, the reference) and numpy (the Lambda bundle, small calls), in :mod:`dorylus.models.ops`.

The mask is integer hashing: the kernel's must be :func:`dorylus.masks.keep_mask` bit for bit.
The dropped values are one float32 multiply each (``x * scale`` or ``x * 0``), the same operation
on both paths, so they are equal bit for bit too (-0.0 and NaN included), and so is everything
element-wise built on them. Products (``project``, ``project_grad``) multiply those same bits by
the same BLAS calls on the same block shapes; they are compared against a float64 product of the
dropped rows with a tolerance of float32 rounding: a sum of 128 (or a block's rows of) O(1)
float32 products is within ~1e-5 relative of the exact one, and atol covers sums that cancel.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from dorylus.masks import keep_mask
from dorylus.models import _dropout_numba, ops, torch_ops
from dorylus.models.reference import _Dropout

KEYS = [(0, 0, 0), (7, 3, 1), (2**31 - 1, 10_000, 5)]


def _ids(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Global ids, unsorted, large (products that overflow 64 bits) and a strided (non-contiguous) view."""
    pool = np.concatenate([rng.choice(10**6, 2 * rows, replace=False), [2**31 - 1, 2**40 + 7, 2**62 + 3]])
    return rng.permutation(pool).astype(np.int64)[::2][:rows]


def _awkward(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Normal values plus the ones where the sign of zero and NaN show: -0.0, +0.0, +-inf, NaN."""
    x = rng.standard_normal((rows, width)).astype(np.float32)
    flat = x.reshape(-1)
    special = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    flat[rng.choice(flat.size, min(flat.size, 40), replace=False)] = np.resize(special, min(flat.size, 40))
    return x


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _run_on(monkeypatch, path: str) -> None:
    """ops runs its dropout on ``path`` whatever the size of a call (False: as if numba were missing)."""
    monkeypatch.setattr(ops, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(ops, "_fused_module", None if path == "numba" else False)


@pytest.fixture(params=["numba", "numpy"])
def kernel(request, monkeypatch):
    _run_on(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("width", [1, 3, 4, 16, 17, 128])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_fused_mask_is_keep_mask_and_values_are_x_times_scale_or_zero(width, p):
    rng = np.random.default_rng(width * 10 + int(p * 10))
    ids = _ids(rng, 200)
    assert not ids.flags.c_contiguous
    for key in KEYS:
        keep = keep_mask(*key, ids, width, p)
        ones = _dropout_numba.dropped(np.ones((len(ids), width), np.float32), ids, key, p)
        np.testing.assert_array_equal(ones != 0, keep)
        for id_type in (np.int32, np.uint64):  # the kernel converts ids as keep_mask does
            small = ids[ids < 2**31].astype(id_type)
            got = _dropout_numba.dropped(np.ones((len(small), width), np.float32), small, key, p) != 0
            np.testing.assert_array_equal(got, keep_mask(*key, small, width, p))
        x = _awkward(rng, len(ids), width)
        scale = np.float32(1.0 / (1.0 - p))
        with np.errstate(invalid="ignore"):  # inf * 0
            want = np.where(keep, x * scale, x * np.float32(0.0))  # written independently of either path
            numpy_path = ops._dropout(x, ids, key, p, None)
        np.testing.assert_array_equal(_bits(_dropout_numba.dropped(x, ids, key, p)), _bits(want))
        np.testing.assert_array_equal(_bits(numpy_path), _bits(want))


@pytest.mark.parametrize("activation", [None, "relu", "elu"])
def test_elementwise_ops_equal_on_both_paths_bit_for_bit(monkeypatch, activation):
    rng = np.random.default_rng(1)
    rows, width, key, p = 300, 17, (3, 4, 1), 0.4
    ids, src, grad_h = _ids(rng, rows), _awkward(rng, rows, width), _awkward(rng, rows, width)
    results = {}
    for path in ("numba", "numpy"):
        _run_on(monkeypatch, path)
        with np.errstate(invalid="ignore", over="ignore"):
            results[path] = [ops.prepare(src, ids, key, p, activation, True),
                             ops.prepare_backward(grad_h, src, ids, key, p, activation),
                             ops.dropout(src, ids, key, p)]
    for got, want in zip(results["numba"], results["numpy"]):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # relu's forward keeps NaN and turns -0.0 into +0.0 before the dropout, as np.maximum does
    if activation == "relu":
        scale, keep = np.float32(1.0 / (1.0 - p)), keep_mask(*key, ids, width, p)
        with np.errstate(invalid="ignore"):
            want = np.where(keep, np.maximum(src, 0) * scale, np.maximum(src, 0) * np.float32(0.0))
        np.testing.assert_array_equal(_bits(results["numba"][0]), _bits(want))


@pytest.mark.parametrize("activation", [None, "relu", "elu"])
def test_blocked_products_equal_the_dropped_rows_product(kernel, monkeypatch, activation):
    """project and project_grad in blocks (and a last partial block) against float64 products of
    prepare's rows, which the previous test holds equal on both paths."""
    monkeypatch.setattr(ops, "PROJECT_BLOCK_ROWS", 64)
    rng = np.random.default_rng(2)
    rows, width, key, p = 300, 33, (1, 2, 0), 0.5
    ids = _ids(rng, rows)
    src = rng.standard_normal((rows, width)).astype(np.float32)
    w = rng.standard_normal((width, 8)).astype(np.float32)
    grad = rng.standard_normal((rows, 8)).astype(np.float32)
    h = ops.prepare(src, ids, key, p, activation, True).astype(np.float64)
    for training in (True, False):
        got = ops.project(src, ids, key, p, activation, training, w)
        want = (h if training else ops.prepare(src, ids, key, p, activation, False).astype(np.float64)) @ w
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    want = h.T @ grad
    np.testing.assert_allclose(ops.project_grad(src, ids, key, p, activation, grad), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_gpu_twin_with_its_mask_cache_gives_the_same_values(kernel):
    """torch_ops (the gpu backend, here on torch's CPU device) with its MaskCache, hit and missed:
    the same values as ops (its dropped elements are +0.0 where ops' may be -0.0: equal values)."""
    rng = np.random.default_rng(3)
    rows, width, key, p = 200, 20, (5, 6, 1), 0.3
    ids, src = _ids(rng, rows).copy(), rng.standard_normal((rows, width)).astype(np.float32)
    grad_h = rng.standard_normal((rows, width)).astype(np.float32)
    cache = torch_ops.MaskCache(torch.from_numpy(ids))
    t_ids, t_src, t_grad = cache.ids, torch.from_numpy(src), torch.from_numpy(grad_h)
    for _ in range(2):  # the second round hits the cache
        np.testing.assert_array_equal(torch_ops.prepare(t_src, t_ids, key, p, "relu", True, cache).numpy(),
                                      ops.prepare(src, ids, key, p, "relu", True))
        np.testing.assert_array_equal(torch_ops.prepare_backward(t_grad, t_src, t_ids, key, p, "relu", cache).numpy(),
                                      ops.prepare_backward(grad_h, src, ids, key, p, "relu"))
    assert cache.hashed == 1


def test_reference_dropout_gradient_is_autograds(kernel):
    """The reference's dropout (ops.dropout both ways) against torch autograd of ``x * M * scale``."""
    rng = np.random.default_rng(4)
    rows, width, key, p = 150, 9, (2, 1, 1), 0.6
    ids = np.arange(rows)
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    g = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    keep = torch.from_numpy(keep_mask(*key, ids, width, p))
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = _Dropout.apply(mine, ids, key, p)
    out.backward(g)
    want = theirs * keep * (1.0 / (1.0 - p))
    want.backward(g)
    np.testing.assert_array_equal(out.detach().numpy(), want.detach().numpy())
    np.testing.assert_array_equal(mine.grad.numpy(), theirs.grad.numpy())


def test_small_calls_stay_on_numpy_until_a_large_one_has_loaded_the_kernel(monkeypatch):
    monkeypatch.setattr(ops, "_fused_module", None)
    assert ops._fused(ops.FUSED_MIN_ELEMENTS - 1) is None and ops._fused_module is None
    assert ops._fused(ops.FUSED_MIN_ELEMENTS) is _dropout_numba
    assert ops._fused(1) is _dropout_numba  # loaded: the start-up is paid
    monkeypatch.setattr(ops, "_fused_module", False)
    assert ops._fused(ops.FUSED_MIN_ELEMENTS) is None


def test_the_kernel_refuses_what_it_cannot_do():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"dropout probability must be in \(0, 1\)"):
        _dropout_numba.dropped(x, np.arange(3), (0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="one id per row"):
        _dropout_numba.dropped(x, np.arange(2), (0, 0, 0), 0.5)
    with pytest.raises(ValueError, match="gate has shape"):
        _dropout_numba.dropped(x, np.arange(3), (0, 0, 0), 0.5, _dropout_numba.GATED_BY_SRC, gate=x[:2])
    with pytest.raises(ValueError, match="out must be"):
        _dropout_numba.dropped(x, np.arange(3), (0, 0, 0), 0.5, out=np.empty((3, 4), np.float64))


WITHOUT_NUMBA = r"""
import sys
sys.modules["numba"] = None  # as in the Lambda bundle: importing numba raises ImportError
import numpy as np
from dorylus.masks import keep_mask
from dorylus.models import ops
rows, width, key, p = 1 << 12, 256, (1, 2, 3), 0.25
assert rows * width >= ops.FUSED_MIN_ELEMENTS  # a size that would run fused where numba is
x = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
got = ops.prepare(x, np.arange(rows), key, p, None, True)
want = x * keep_mask(*key, np.arange(rows), width, p) * np.float32(1 / (1 - p))
assert np.array_equal(got, want)
assert "dorylus.models._dropout_numba" not in sys.modules
print("numpy path")
"""


def test_without_numba_large_calls_run_on_numpy_and_the_bundle_leaves_the_kernel_out():
    from dorylus.packaging import walk_imports

    result = subprocess.run([sys.executable, "-c", WITHOUT_NUMBA], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "numpy path", result.stderr
    walk = walk_imports()
    bundled = {path.name for path in walk.files}
    assert "ops.py" in bundled and "_dropout_numba.py" not in bundled
    assert "numba" not in walk.external
