import numpy as np
import pytest

from dorylus.masks import dropout, keep_mask


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
