"""``dorylus train`` in the background on Cora (cpu, sync, 2 parts), as the tests of a run
that something happens to mid-way (a killed role, a spot notice, a forger) start it, and the
comparison of its epochs with an uninterrupted run's (fixtures in conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dorylus.runs import read_metrics
from tests.graphs import shared_data
from tests.processes import alive, children_of, cmdline

REPO = Path(__file__).resolve().parents[2]
# Every event of these tests (a kill, a preemption, a pause, the forger's first pushes) comes by
# epoch 3, which leaves 7 epochs compared after it; start-up, not epochs, is most of a run's cost
# (20 epochs before: about 5 CPU-s more per run).
EPOCHS = 10


def train_args(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dorylus.cli", "train", "--dataset", str(shared_data("cora.npz")),
            "--backend", "cpu", "--mode", "sync", "--parts", "2", "--epochs", str(EPOCHS), "--partition-method",
            "contiguous", "--checkpoint-every", str(EPOCHS), "--run-dir", str(run), *extra]


class Training:
    """``dorylus train`` in the background; every process it started is killed at the end."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen: set[int] = set()

    def watch(self) -> set[int]:
        now = children_of(self.process.pid)
        self.seen |= now
        return now

    def wait_for_epoch(self, run: Path, epoch: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not ((run / "metrics.jsonl").exists() and any(m["epoch"] >= epoch for m in read_metrics(run))):
            assert self.process.poll() is None, f"training exited early: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"training did not reach epoch {epoch}"
            self.watch()
            time.sleep(0.02)
        self.watch()

    def role(self, word: bytes, not_in: set[int] = frozenset(), timeout_s: float = 120) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [pid for pid in self.watch() if word in cmdline(pid) and pid not in not_in]
            if found:
                return found[0]
            assert self.process.poll() is None and time.monotonic() < deadline, f"no {word!r} process"
            time.sleep(0.005)

    def wait(self, timeout_s: float = 300) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout_s)
        return code, self.log.read_text()

    def close(self) -> None:
        for pid in self.seen | children_of(self.process.pid):
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def assert_same_epochs(got: list[dict], want: list[dict]) -> None:
    """Every epoch once, in order, each equal to the uninterrupted run's (conftest.py's: the
    single-process reference): the loss to 1e-5 relative (float32 sums in another order),
    accuracies within one vertex (a float32 tie may flip an argmax), as test_sync_exactness.py."""
    assert [m["epoch"] for m in got] == list(range(1, EPOCHS + 1))
    with np.load(shared_data("cora.npz")) as cora:
        counts = {split: int(cora[f"{split}_mask"].sum()) for split in ("train", "val", "test")}
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]
        for split, count in counts.items():
            assert abs(g[f"{split}_acc"] - w[f"{split}_acc"]) * count <= 1 + 1e-9, (g["epoch"], split)
