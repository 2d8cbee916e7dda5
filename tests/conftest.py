from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dorylus.data.graph import GraphDataset

CORA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cora.npz"


@pytest.fixture
def cora() -> GraphDataset:
    """Planetoid Cora from ../shared/data (skips when the file is absent)."""
    if not CORA.is_file():
        pytest.skip(f"real data not present at {CORA}")
    z = np.load(CORA)
    return GraphDataset(
        name="cora", src=z["src"], dst=z["dst"], features=z["features"], labels=z["labels"],
        train_mask=z["train_mask"], val_mask=z["val_mask"], test_mask=z["test_mask"], num_classes=7,
    ).validate()
