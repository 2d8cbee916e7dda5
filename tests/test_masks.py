import numpy as np
import pytest

from dorylus.masks import keep_at, keep_edge_mask, keep_mask


def test_partition_independent_and_keyed():
    full = keep_mask(7, 3, 1, np.arange(1000), 33, 0.5)
    ids = np.array([999, 5, 512])
    np.testing.assert_array_equal(keep_mask(7, 3, 1, ids, 33, 0.5), full[ids])
    for other in [(8, 3, 1), (7, 4, 1), (7, 3, 2)]:
        assert (keep_mask(*other, np.arange(1000), 33, 0.5) != full).mean() > 0.4


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    keep = keep_mask(0, 1, 0, np.arange(2000), 50, p)
    assert abs(keep.mean() - (1 - p)) < 0.01


def test_probability_outside_zero_one_is_refused():
    for p in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout probability"):
            keep_mask(0, 1, 0, np.arange(3), 4, p)


def test_importable_without_torch():
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; import dorylus.masks"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_edge_mask_is_keyed_by_both_ends_and_order_free():
    rng = np.random.default_rng(0)
    dst, src = rng.integers(0, 10**6, 5000), rng.integers(0, 10**6, 5000)
    mask = keep_edge_mask(1, 2, 3, dst, src, 8, 0.6)
    assert mask.shape == (5000, 8) and mask.dtype == bool
    assert abs(mask.mean() - 0.4) < 0.01
    order = rng.permutation(5000)
    np.testing.assert_array_equal(keep_edge_mask(1, 2, 3, dst[order], src[order], 8, 0.6), mask[order])
    # the reverse edge, another epoch or layer: other draws (agreement at chance, 0.4^2 + 0.6^2)
    for other in (keep_edge_mask(1, 2, 3, src, dst, 8, 0.6), keep_edge_mask(1, 3, 3, dst, src, 8, 0.6),
                  keep_edge_mask(1, 2, 4, dst, src, 8, 0.6)):
        assert abs((other == mask).mean() - 0.52) < 0.02
    # not the vertex mask of the same key
    vertex = keep_mask(1, 2, 3, dst, 8, 0.6)
    assert abs((vertex == mask).mean() - 0.52) < 0.02
    with pytest.raises(ValueError, match="one length"):
        keep_edge_mask(1, 2, 3, dst, src[:-1], 8, 0.6)


@pytest.mark.parametrize("width", [1, 4, 7, 33, 1433])
def test_keep_at_reads_the_dense_mask_at_given_positions(width):
    """Sparse features' dropout: the same keep decisions as keep_mask at the stored (vertex, column)
    positions, for widths that do and do not fill the last 4-column hash block."""
    rng = np.random.default_rng(width)
    ids = rng.choice(10**6, 300, replace=False)
    full = keep_mask(5, 2, 0, ids, width, 0.4)
    rows, cols = rng.integers(0, 300, 2000), rng.integers(0, width, 2000)
    np.testing.assert_array_equal(keep_at(5, 2, 0, ids[rows], cols, width, 0.4), full[rows, cols])
    every_row, every_col = np.divmod(np.arange(300 * width), width)  # every position, int32 columns too
    np.testing.assert_array_equal(keep_at(5, 2, 0, ids[every_row], every_col.astype(np.int32), width, 0.4),
                                  full.ravel())


def test_keep_at_checks_its_arguments():
    with pytest.raises(ValueError, match="one length"):
        keep_at(0, 1, 0, np.arange(3), np.arange(2), 4, 0.5)
    with pytest.raises(ValueError, match=r"columns must be in \[0, 4\)"):
        keep_at(0, 1, 0, np.arange(3), np.array([0, 1, 4]), 4, 0.5)
    with pytest.raises(ValueError, match="dropout probability"):
        keep_at(0, 1, 0, np.arange(3), np.arange(3), 4, 1.0)
    assert keep_at(0, 1, 0, np.arange(0), np.arange(0), 4, 0.5).shape == (0,)


# ------------------------------------------------------------------ the torch twins (dorylus.models.torch_ops)
# The numpy masks above are the oracle: sync training is exact only if every backend drops the
# same elements, so the device hash must agree bit for bit, not statistically.


def _torch_ops():
    pytest.importorskip("torch")
    from dorylus.models import torch_ops

    return torch_ops


# ids at the edges of int64 (the hash works on uint64 bits), thresholds at 0, 1 and 65535
_IDS = np.concatenate([np.arange(40), [2**31 - 1, 2**32, 2**40 + 7, 2**62 + 3, 2**63 - 1],
                       np.random.default_rng(3).integers(0, 2**63 - 1, 200)]).astype(np.int64)
_PS = [0.0, 1e-6, 1 / 65536, 0.1, 0.5, 0.9, 0.99999]


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 9, 64, 602])
@pytest.mark.parametrize("p", _PS)
def test_torch_keep_mask_is_the_numpy_mask_bit_for_bit(width, p):
    import torch

    torch_ops = _torch_ops()
    for key in ((0, 0, 0), (7, 3, 1), (2**31 - 1, 10_000, 5)):
        got = torch_ops.keep_mask(key, torch.from_numpy(_IDS), width, p)
        assert got.dtype == torch.bool and got.is_contiguous()
        np.testing.assert_array_equal(got.numpy(), keep_mask(*key, _IDS, width, p))


@pytest.mark.parametrize("width", [1, 4, 5, 8, 9])
@pytest.mark.parametrize("p", _PS)
def test_torch_edge_mask_is_the_numpy_mask_bit_for_bit(width, p):
    import torch

    torch_ops = _torch_ops()
    rng = np.random.default_rng(width)
    dst, src = rng.choice(_IDS, 300), rng.choice(_IDS, 300)
    for key in ((0, 0, 0), (7, 3, 1)):
        got = torch_ops.keep_edge_mask(key, torch.from_numpy(dst), torch.from_numpy(src), width, p)
        np.testing.assert_array_equal(got.numpy(), keep_edge_mask(*key, dst, src, width, p))
    # the ids are inputs, never scratch space
    np.testing.assert_array_equal(dst, rng.__class__(rng.bit_generator.__class__(width)).choice(_IDS, 300))


def _trace(fn):
    """The kernels fn runs (``trace.ops``: name and output size; views are not kernels) and the
    peak bytes of the tensors it allocated alive at once (``trace.peak``), traced below autograd."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.live, self.peak = [], 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    fresh = storage.data_ptr() not in inputs
                    if fresh or func._schema.name.endswith("_"):  # a kernel ran (not a view)
                        self.ops.append((func.__name__, t.numel()))
                    if fresh and storage.nbytes():
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self._free, storage.nbytes())
            return out

        def _free(self, nbytes):
            self.live -= nbytes

    trace = Trace()
    with trace:
        result = fn()
    return result, trace


def test_torch_keep_mask_kernels_and_temporaries():
    """The device hash: 14 kernels over the [rows, width / 4] block matrix (one broadcast add, the
    finalizer's 11 in place, the lane flip, one comparison on an int16 view) and at most about
    4 bytes per mask element alive at once, the mask included (the earlier twin ran about 26
    kernels and widened every lane to int64: 8 bytes per element for the lanes alone)."""
    import torch

    torch_ops = _torch_ops()
    rows, width = 3000, 64
    ids = torch.arange(rows, dtype=torch.int64) * 7919
    mask, trace = _trace(lambda: torch_ops.keep_mask((1, 2, 3), ids, width, 0.5))
    np.testing.assert_array_equal(mask.numpy(), keep_mask(1, 2, 3, ids.numpy(), width, 0.5))
    big = [name for name, numel in trace.ops if numel >= rows * width // 4]
    assert len(big) <= 14, big
    assert trace.peak <= 4 * rows * width + 16 * rows, trace.peak  # + the per-row int64 term


def test_mask_cache_reuses_evicts_and_never_confuses_rows():
    import torch

    torch_ops = _torch_ops()
    ids = torch.arange(100, dtype=torch.int64) * 3
    cache = torch_ops.MaskCache(ids, epochs=2)
    first = cache.keep((1, 5, 0), ids[10:40], 8, 0.5)
    assert cache.keep((1, 5, 0), ids[10:40], 8, 0.5) is first and cache.hashed == 1
    np.testing.assert_array_equal(first.numpy(), keep_mask(1, 5, 0, ids[10:40].numpy(), 8, 0.5))
    # other rows, width, p, layer: other masks
    for args in (((1, 5, 0), ids[11:41], 8, 0.5), ((1, 5, 0), ids[10:40], 9, 0.5), ((1, 5, 0), ids[10:40], 8, 0.4),
                 ((1, 5, 1), ids[10:40], 8, 0.5)):
        np.testing.assert_array_equal(cache.keep(*args).numpy(), keep_mask(*args[0], args[1].numpy(), args[2],
                                                                              args[3]))
    assert cache.hashed == 5
    # a tensor equal to some rows but not a view of the state's ids is hashed, never cached
    copy = ids[10:40].clone()
    cache.keep((1, 5, 0), copy, 8, 0.5)
    cache.keep((1, 5, 0), copy, 8, 0.5)
    assert cache.hashed == 7
    # two newest epochs kept: epoch 6 keeps 5's masks, epoch 7 drops them; an old epoch is not stored
    cache.keep((1, 6, 0), ids[10:40], 8, 0.5)
    assert cache.keep((1, 5, 0), ids[10:40], 8, 0.5) is first
    cache.keep((1, 7, 0), ids[10:40], 8, 0.5)
    hashed = cache.hashed
    assert cache.keep((1, 5, 0), ids[10:40], 8, 0.5) is not first and cache.hashed == hashed + 1
    assert {k[0][1] for k in cache._masks} == {6, 7}
    with pytest.raises(ValueError, match="epochs"):
        torch_ops.MaskCache(ids, epochs=0)
