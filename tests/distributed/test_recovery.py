"""Roles that come back (issue 21 item 2): a graph server or the parameter server killed with
SIGKILL mid-run is restarted by the coordinator, which restores the state after the last
finished epoch and trains on; the command exits 0 and, in sync mode, its per-epoch metrics equal
an uninterrupted run's (loss to 1e-5 relative). A role that dies again within the same epoch
stops the run with a checkpoint and the command that resumes it."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dorylus.cli import main as cli_main
from dorylus.runs import read_metrics
from tests.distributed.background import EPOCHS, assert_same_epochs
from tests.processes import wait_gone

KILL_AT = 3


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


def test_max_recoveries_is_validated_and_documented(tmp_path, capsys):
    # In-process: the real command line's exit status and one-line error in a subprocess are
    # tests/test_cli_errors.py's; here the option's bounds and its help.
    run_dir = tmp_path / "run"
    for bad in ("-1", "101"):
        assert cli_main(["train", "--max-recoveries", bad, "--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "max_recoveries must be in [0, 100]" in err and not run_dir.exists()
    with pytest.raises(SystemExit) as exited:
        cli_main(["train", "--help"])
    assert exited.value.code == 0 and "--max-recoveries" in capsys.readouterr().out
