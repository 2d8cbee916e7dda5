from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dorylus.runs import read_metrics
from tests.distributed.background import REPO, Training, train_args


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
    """The per-epoch metrics of the background run with nothing happening to it (one run for
    every test that compares with it)."""
    run = tmp_path_factory.mktemp("plain") / "run"
    result = subprocess.run(train_args(run), capture_output=True, text=True, cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    return read_metrics(run)
