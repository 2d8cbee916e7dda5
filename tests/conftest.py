from __future__ import annotations

import numpy as np
import pytest

from dorylus.data.graph import GraphDataset
from tests.graphs import shared_data


@pytest.fixture
def cora() -> GraphDataset:
    """Planetoid Cora from ../shared/data (absent: a skip, or a failure under CI=true)."""
    z = np.load(shared_data("cora.npz"))
    return GraphDataset(
        name="cora", src=z["src"], dst=z["dst"], features=z["features"], labels=z["labels"],
        train_mask=z["train_mask"], val_mask=z["val_mask"], test_mask=z["test_mask"], num_classes=7,
    ).validate()
