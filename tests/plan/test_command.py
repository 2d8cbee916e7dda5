"""``dorylus plan`` prints its tables from a calibration file without calibrating."""

from __future__ import annotations

import io
import json
import re
import statistics

import pytest

from dorylus.cli import main
from dorylus.config import TrainConfig
from dorylus.plan import command
from dorylus.plan.calibration import Calibration
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from tests.graphs import random_graph
from tests.plan.handmade import RATES

CAL = Calibration(host="test host", cores=2, measured_at="2025-01-01T00:00:00", cpu=RATES,
                  loopback_bytes_per_s=2e9, round_trip_s=5e-5, invoke_s=1e-3, stage_s=0.002, call_s=0.01)


@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("calibrated although a calibration file was given")

    monkeypatch.setattr(command, "measure", refuse)
    path = tmp_path / "cal.json"
    CAL.save(path)
    return path


def _rows(out: str, first: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return [line.split() for line in lines[start + 1:] if line and not line.startswith((" ", "value ="))]


def test_scale_table_from_a_calibration_file(calibration_file, tmp_path, capsys):
    assert main(["plan", "--calibration", str(calibration_file), "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "test host" in out and "us-east-1" in out
    rows = _rows(out, "workload")
    assert [(r[0], r[1]) for r in rows] == [(w, b) for w in ("reddit", "amazon", "friendster")
                                            for b in ("lambda", "cpu", "gpu")]
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["calibration"]["host"] == "test host" and len(saved["predictions"]) == 9
    for row, p in zip(rows, saved["predictions"]):
        assert p["value"] == pytest.approx(1 / (p["epoch_s"] * p["cost_usd"]))
        assert row[1] == p["setup"]["backend"]
    cpu = {p["shape"]["vertices"]: p["value"] for p in saved["predictions"] if p["setup"]["backend"] == "cpu"}
    for row, p in zip(rows, saved["predictions"]):
        assert f"{p['value'] / cpu[p['shape']['vertices']]:.2f}x" in row


def test_local_prediction_of_a_preset(calibration_file, capsys):
    assert main(["plan", "--calibration", str(calibration_file), "--dataset", "synthetic-1m"]) == 0
    out = capsys.readouterr().out
    assert "64,000 vertices, 2 parts" in out and "hidden 16" in out
    rows = _rows(out, "backend")
    assert [r[0] for r in rows] == ["lambda", "cpu"] and all(float(r[3]) > 0 for r in rows)


@pytest.mark.parametrize("model", ["gat", "sage"])
def test_gat_and_sage_runs_are_predicted(calibration_file, tmp_path, capsys, model):
    run = tmp_path / "run"
    # server_stage_ops 0: a graph this small would run every stage but the dropout ones on its servers
    run_training(TrainConfig(model=model, backend="lambda", parts=2, epochs=3, hidden=4, heads=2, server_stage_ops=0,
                             run_dir=str(run)),
                 random_graph(num_nodes=60, num_edges=200), progress=io.StringIO())
    assert main(["plan", "--calibration", str(calibration_file), "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"{model.upper()} hidden 4" in out
    assert "evaluation pass on" in out  # the run evaluated every epoch: predicted as it ran
    (row,) = _rows(out, "backend")
    assert row[0] == "lambda" and float(row[3]) > 0 and int(row[6]) > 0  # seconds, and function calls
    # The model's own stages are walked: SAGE's vertex stage SUM is there.
    stages = next(line for line in out.splitlines() if line.startswith("  lambda: "))
    assert (" sum " in stages) == (model == "sage") and " ga_bwd " in stages


def test_a_run_is_compared_with_its_epochs_of_the_predicted_kind(calibration_file, tmp_path, capsys):
    """A prediction beside a measured run. Evaluating every other epoch: the prediction without
    the evaluation pass is set beside the epochs without one, and ``--evaluate`` beside the epochs
    with one (one cluster run for both; a run that evaluates every epoch is predicted with the
    pass: the gat and sage cases)."""
    run = tmp_path / "run"
    run_training(TrainConfig(backend="cpu", parts=2, epochs=7, eval_every=2, hidden=4, run_dir=str(run)),
                 random_graph(num_nodes=60, num_edges=200), progress=io.StringIO())
    history = read_metrics(run)
    for flag, evaluated in (([], False), (["--evaluate"], True)):
        assert main(["plan", "--calibration", str(calibration_file), "--run", str(run), *flag]) == 0
        out = capsys.readouterr().out
        assert f"evaluation pass {'on' if evaluated else 'off'}" in out
        (row,) = _rows(out, "backend")
        assert row[0] == "cpu"
        epochs = [m["epoch_s"] for m in history if (m["test_acc"] is not None) == evaluated][1:]
        assert len(epochs) >= 2 and row[8:11] == ["(median", "of", f"{len(epochs)})"]
        predicted, measured, ratio = float(row[3]), float(row[7]), float(row[-1])
        assert measured == pytest.approx(statistics.median(epochs), abs=1e-4)
        assert ratio == pytest.approx(predicted / measured, abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--calibration", "{missing}"], "calibration file .* does not exist"),
    (["--dataset", "synthetic-1m", "--backend", "gpu"], "needs a calibration with a GPU"),
    (["--run", "{missing}"], "run directory .* does not exist"),
    (["--intervals", "0", "--dataset", "synthetic-1m"], "--intervals must be >= 1"),
    (["--server", "gpu=c5.xlarge"], "GPU instance type 'c5.xlarge' is not in the planner's table"),
])
def test_bad_options_are_one_error_line(calibration_file, tmp_path, capsys, argv, message):
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    if "--calibration" not in argv:
        argv = ["--calibration", str(calibration_file), *argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dorylus plan: error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_a_registered_backend_is_planned_from_the_registry(calibration_file, monkeypatch, capsys):
    """A fourth backend with graph servers on CPU cores, registered and nothing else: its row in
    the table at scale on its own instance, a local prediction by default, and the help text."""
    from graphserver.backends import BACKENDS

    monkeypatch.setitem(BACKENDS, "fourth", "tests.plan.fourth_backend")
    assert main(["plan", "--calibration", str(calibration_file)]) == 0
    rows = _rows(capsys.readouterr().out, "workload")
    assert [(r[0], r[1]) for r in rows] == [(w, b) for w in ("reddit", "amazon", "friendster")
                                            for b in ("lambda", "cpu", "gpu", "fourth")]
    assert all(r[4] == "c5n.4xlarge" for r in rows if r[1] == "fourth")
    assert main(["plan", "--calibration", str(calibration_file), "--dataset", "synthetic-1m"]) == 0
    assert [r[0] for r in _rows(capsys.readouterr().out, "backend")] == ["lambda", "cpu", "fourth"]
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: lambda, cpu and fourth)" in help_text
    assert "c5n.2xlarge for lambda and cpu, p3.2xlarge for gpu, c5n.4xlarge for fourth" in help_text
