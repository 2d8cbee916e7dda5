"""Small hand-built graphs shared by the tests."""

from __future__ import annotations

import numpy as np

from dorylus.data.graph import GraphDataset


def random_graph(num_nodes: int = 30, num_edges: int = 80, num_features: int = 5, num_classes: int = 3,
                 seed: int = 0, directed: bool = False) -> GraphDataset:
    """A small random labelled graph with every split non-empty."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_nodes)
    split = rng.permutation(num_nodes)
    masks = [np.zeros(num_nodes, dtype=bool) for _ in range(3)]
    for mask, chunk in zip(masks, np.array_split(split, 3)):
        mask[chunk] = True
    return GraphDataset(
        name=f"random-{seed}", src=rng.integers(0, num_nodes, num_edges), dst=rng.integers(0, num_nodes, num_edges),
        features=rng.standard_normal((num_nodes, num_features)).astype(np.float32), labels=labels,
        train_mask=masks[0], val_mask=masks[1], test_mask=masks[2], num_classes=num_classes, directed=directed,
    ).validate()
