import numpy as np
import pytest

from dorylus.errors import DatasetError
from tests.graphs import random_graph


def test_overlapping_masks_are_rejected():
    g = random_graph()
    g.test_mask[np.argmax(g.train_mask)] = True
    with pytest.raises(DatasetError, match="train_mask and test_mask overlap"):
        g.validate("somewhere.npz")


def test_fractional_num_classes_rejected():
    g = random_graph()
    g.num_classes = 2.9
    with pytest.raises(DatasetError, match="num_classes must be an integer"):
        g.validate()


def test_error_names_the_source():
    g = random_graph()
    g.src[0] = 10**6
    with pytest.raises(DatasetError, match=r"^graph\.npz: src has vertex id 1000000 out of range"):
        g.validate("graph.npz")
