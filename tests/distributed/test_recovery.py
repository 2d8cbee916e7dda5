"""Roles that come back (issue 21 item 2): a graph server or the parameter server killed with
SIGKILL mid-run is restarted by the coordinator, which restores the state after the last
finished epoch and trains on; the command exits 0 and, in sync mode, its per-epoch metrics equal
an uninterrupted run's (loss to 1e-5 relative). A role that dies again within the same epoch
stops the run with a checkpoint and the command that resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dorylus.runs import read_metrics
from tests.graphs import shared_data
from tests.processes import alive, children_of, cmdline, wait_gone

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 20
KILL_AT = 3


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


@pytest.fixture
def training(tmp_path):
    started: list[Training] = []

    def start(run: Path, *extra: str) -> Training:
        started.append(Training(train_args(run, *extra), tmp_path / f"train-{len(started)}.log"))
        return started[-1]

    yield start
    for t in started:
        t.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("plain") / "run"
    result = subprocess.run(train_args(run), capture_output=True, text=True, cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    return read_metrics(run)


def assert_same_epochs(got: list[dict], want: list[dict]) -> None:
    assert [m["epoch"] for m in got] == list(range(1, EPOCHS + 1))  # every epoch once, in order
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]
        for key in ("train_acc", "val_acc", "test_acc"):
            assert g[key] == pytest.approx(w[key], abs=1e-9), (g["epoch"], key)


@pytest.mark.parametrize("victim", [
    "graph server",
    pytest.param("parameter server", marks=pytest.mark.slow),
])
def test_a_killed_role_comes_back_and_the_run_equals_an_uninterrupted_one(uninterrupted, training, tmp_path,
                                                                         victim):
    run = tmp_path / "run"
    t = training(run)
    t.wait_for_epoch(run, KILL_AT)
    word = {"graph server": b"graphserver.server", "parameter server": b"dorylus.paramserver"}[victim]
    os.kill(t.role(word), signal.SIGKILL)
    code, output = t.wait()
    assert code == 0, output[-3000:]
    assert f"{victim}" in output and "recovery 1 of 3" in output, output[-3000:]
    metrics = read_metrics(run)
    assert_same_epochs(metrics, uninterrupted)
    assert sum(m["recoveries"] for m in metrics) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recoveries"] == 1 and summary["epochs"] == EPOCHS
    since = summary["gradients"]["since_epoch"]  # the restarted parameter server's own count
    assert since > KILL_AT and summary["gradients"]["applied"] == 2 * 2 * 2 * (EPOCHS - since + 1)
    assert not wait_gone(t.seen, 30), "processes left after the run"


@pytest.mark.slow  # the default suite's 10 minutes keep the recovery itself (above)
def test_a_role_killed_twice_in_one_epoch_stops_the_run_with_a_checkpoint(training, tmp_path):
    run = tmp_path / "run"
    t = training(run)
    t.wait_for_epoch(run, KILL_AT)
    first = t.role(b"graphserver.server")
    before = set(t.watch())
    os.kill(first, signal.SIGKILL)
    # Its replacement, killed as soon as it exists: it dies again before the epoch is trained.
    os.kill(t.role(b"graphserver.server", not_in=before), signal.SIGKILL)
    code, output = t.wait()
    assert code == 1, output[-3000:]
    assert "recovery 1 of 3" in output and "recovery 2" not in output
    assert f"dorylus train --resume {run}" in output and "exited" in output
    import torch

    saved = int(torch.load(run / "checkpoint.pt", weights_only=True)["epoch"])
    assert saved >= KILL_AT and saved == read_metrics(run)[-1]["epoch"] < EPOCHS
    assert not wait_gone(t.seen, 30), "processes left after the stopped run"


def test_max_recoveries_is_validated_and_documented(tmp_path):
    run_dir = tmp_path / "run"
    for bad in ("-1", "101"):
        result = subprocess.run([sys.executable, "-m", "dorylus.cli", "train", "--max-recoveries", bad,
                                 "--run-dir", str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "max_recoveries must be in [0, 100]" in result.stderr and not run_dir.exists()
    helped = subprocess.run([sys.executable, "-m", "dorylus.cli", "train", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert "--max-recoveries" in helped.stdout
