"""``--preempt PART@EPOCH`` (issue 21 item 3, locally): graph server PART's spot watcher reads a
local instance metadata service that posts the interruption notice when the coordinator starts
epoch EPOCH; the notice reaches the coordinator in a progress reply and it checkpoints at once;
the server is killed once that is done and the run recovers by itself. The command exits 0 and its
per-epoch metrics equal an uninterrupted sync run's (loss to 1e-5 relative)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dorylus import cli
from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from dorylus.runs import read_metrics
from tests.distributed.background import EPOCHS, REPO, assert_same_epochs
from tests.graphs import shared_data
from tests.processes import wait_gone

PREEMPT_AT = 3


def test_a_preempted_graph_server_checkpoints_comes_back_and_the_run_equals_an_uninterrupted_one(
        uninterrupted, training, tmp_path):
    run = tmp_path / "run"
    t = training(run, "--preempt", f"1@{PREEMPT_AT}")
    code, output = t.wait()
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    posted = next(i for i, line in enumerate(lines) if line.startswith(f"--preempt 1@{PREEMPT_AT}: spot interruption"))
    noticed = next(i for i, line in enumerate(lines) if line.startswith("graph server 1: interruption notice (spot "
                                                                         "terminate at "))
    recovered = next(i for i, line in enumerate(lines) if "recovery 1 of 3" in line)
    assert posted < noticed < recovered, output[-3000:]
    assert "graph server 1 died" in lines[recovered] and "(preempted: --preempt)" in lines[recovered]
    # The checkpoint taken on the notice is the state the recovery starts from, or an older one
    # when the run was still in the epoch before its first.
    saved = int(lines[noticed].split("checkpoint after epoch ")[1].split()[0])
    restarted_after = int(lines[recovered].rsplit("state after epoch ", 1)[1])
    assert PREEMPT_AT - 1 <= saved <= restarted_after, output[-3000:]
    metrics = read_metrics(run)
    assert_same_epochs(metrics, uninterrupted)
    assert sum(m["recoveries"] for m in metrics) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recoveries"] == 1 and summary["gradients"]["since_epoch"] == restarted_after + 1
    assert "spot terminate at" in (run / "logs" / "graphserver-1.log").read_text()
    assert not wait_gone(t.seen, 30), "processes left after the run"


@pytest.mark.parametrize("preempt, why", [
    ("2@3", "there is no graph server 2, the run has 2 (0 to 1)"),
    ("1@0", f"epoch 0 is not one the run trains (1 to {EPOCHS})"),
    (f"1@{EPOCHS + 1}", f"epoch {EPOCHS + 1} is not one the run trains (1 to {EPOCHS})"),
    ("1@x", "'1@x' is not PART@EPOCH"),
    ("1@3,1@3", "preempt 1@3 is given twice"),
    ("0@2,1@3,0@4,0@5", "preempt names 4 epoch(s), each a recovery, but max_recoveries is 3"),
])
def test_preempt_is_validated(preempt, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        TrainConfig(backend="cpu", parts=2, epochs=EPOCHS, preempt=preempt)
    with pytest.raises(ConfigError, match="reference backend has none"):
        TrainConfig(backend="reference", preempt="0@1")


def test_preempt_out_of_range_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Without --parts the run's 2 parts are known only once the dataset is loaded: still
    before the run directory exists. Cluster mode takes no --preempt."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "dorylus.cli", "train", "--dataset", str(shared_data("cora.npz")), "--backend",
            "cpu", "--run-dir", str(run), "--preempt", "0@2", "--preempt", "2@3"]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "there is no graph server 2, the run has 2" in result.stderr and not run.exists(), result.stderr
    assert cli.main(["train", "--cluster", str(tmp_path / "cluster.json"), "--preempt", "0@2"]) == 2
    assert "--preempt plays AWS in a local run" in capsys.readouterr().err
