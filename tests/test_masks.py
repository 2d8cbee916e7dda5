import numpy as np
import pytest

from dorylus.masks import dropout, keep_at, keep_edge_mask, keep_mask


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


def test_dropout_scales_kept_and_zero_p_is_identity():
    x = np.ones((100, 8), dtype=np.float32)
    out = dropout(x, 0, 1, 0, np.arange(100), 0.25)
    assert set(np.unique(out)) <= {0.0, np.float32(1 / 0.75)}
    assert dropout(x, 0, 1, 0, np.arange(100), 0.0) is x
    with pytest.raises(ValueError):
        keep_mask(0, 1, 0, np.arange(3), 4, 1.0)


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
