"""Small hand-built graphs shared by the tests, and the one way tests find shared data files and
the optional libraries they check against (both a skip locally, a failure under CI=true)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

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


# ../shared/data beside the checkout (the checkout is this file's parents[1]). Never an absolute path.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def in_ci() -> bool:
    """True when ``CI`` says so (``CI=true``, as GitHub Actions and most CI systems set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def shared_data(name: str) -> Path:
    """The path of ``../shared/data/<name>``, relative to the checkout.

    When the file is missing, the test is skipped with the reason, except in CI (``CI=true``),
    where a missing data file fails the test: CI must not pass by skipping the real-data cases.
    """
    path = SHARED_DATA / name
    if not path.is_file():
        why = f"shared test data ../shared/data/{name} is missing (looked for {path})"
        if in_ci():
            pytest.fail(f"{why}; CI=true, so this is a failure, not a skip: put the file there", pytrace=False)
        pytest.skip(why)
    return path


def oracle(module: str, reason: str) -> ModuleType:
    """``module`` imported, for a test that checks against it (PyG's layers, say).

    When it cannot be imported, the test is skipped with ``reason``, as ``pytest.importorskip``
    does, except in CI (``CI=true``), where that is a failure: CI installs the optional oracles
    (``make`` installs ``.[dev,pyg]``) and must not pass by skipping the cases they check."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = f"{module} cannot be imported ({exc}); {reason}"
        if in_ci():
            pytest.fail(f"{why}; CI=true, so this is a failure, not a skip: install it (pip install -e '.[pyg]')",
                        pytrace=False)
        pytest.skip(why)
