from __future__ import annotations

from pathlib import Path

import pytest

from dorylus.cli import main as cli_main
from dorylus.runs import read_metrics
from tests.distributed.background import EPOCHS, Training, train_args
from tests.graphs import shared_data


@pytest.fixture
def training(tmp_path):
    """``start(run, *extra)``: a background ``dorylus train`` (tests/distributed/background.py),
    every process of which is killed when the test ends."""
    started: list[Training] = []

    def start(run: Path, *extra: str) -> Training:
        started.append(Training(train_args(run, *extra), tmp_path / f"train-{len(started)}.log"))
        return started[-1]

    yield start
    for t in started:
        t.close()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The per-epoch metrics the background run must have whatever happens to it: the
    single-process reference of the same data and model, trained in this process
    (test_sync_exactness.py holds the cpu backend to it; a cluster run of its own cost a cluster
    start, ~16 CPU-s)."""
    run = tmp_path_factory.mktemp("plain") / "run"
    assert cli_main(["train", "--dataset", str(shared_data("cora.npz")), "--backend", "reference", "--epochs",
                     str(EPOCHS), "--run-dir", str(run)]) == 0
    return read_metrics(run)
