from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch

from dorylus.data.graph import GraphDataset
from tests.graphs import shared_data

# The suite's own process computes with one torch thread: its kernels are small, and on a shared
# or busy machine a second OpenMP thread spins for a core it does not get (200 reference epochs on
# synthetic-small: 0.03 CPU-s per epoch on one thread, 0.33 on two at load 10). Tests of
# multi-threaded code set their thread count themselves; the roles a test starts pick their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory):
    """The session's (and the roles' it starts) temporary files go under pytest's base directory.
    A coordinator that a test SIGKILLs cannot remove its sockets' directory; there it goes with
    pytest's rotation of old base directories instead of staying in /tmp."""
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # gettempdir() caches its answer
    yield
    if saved is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


@pytest.fixture
def cora() -> GraphDataset:
    """Planetoid Cora from ../shared/data (absent: a skip, or a failure under CI=true)."""
    z = np.load(shared_data("cora.npz"))
    return GraphDataset(
        name="cora", src=z["src"], dst=z["dst"], features=z["features"], labels=z["labels"],
        train_mask=z["train_mask"], val_mask=z["val_mask"], test_mask=z["test_mask"], num_classes=7,
    ).validate()
