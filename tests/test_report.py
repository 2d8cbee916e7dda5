"""``dorylus report``: plots and an index from real runs; bad input names the file and line and
leaves nothing behind."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from dorylus.cli import main
from dorylus.config import TrainConfig
from dorylus.report import PLOTS, load_run, write_report
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from tests.graphs import random_graph

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    """Two small runs: the cpu backend on 2 graph servers (per-task times, cost by component)
    and the single-process reference."""
    root = tmp_path_factory.mktemp("runs")
    graph = random_graph(num_nodes=80, num_edges=300)
    made = []
    for backend, epochs in (("cpu", 3), ("reference", 4)):
        config = TrainConfig(backend=backend, parts=2 if backend == "cpu" else None, epochs=epochs, hidden=4,
                             run_dir=str(root / backend))
        run_training(config, graph, progress=io.StringIO())
        made.append(root / backend)
    return made


def _table(index: str) -> list[dict[str, str]]:
    lines = [line for line in index.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_report_of_two_runs(runs, tmp_path):
    out = tmp_path / "report"
    progress = io.StringIO()
    assert write_report(runs, out, progress=progress) == out
    assert "plotting value.png (5/5)" in progress.getvalue()
    index = (out / "index.md").read_text()
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, name
        height, width, channels = matplotlib.image.imread(out / name).shape
        assert height >= 300 and width >= 400 and channels in (3, 4)
        assert f"![{name}]({name})" in index and f"## {name}" in index
    rows = _table(index)
    assert [r["run"] for r in rows] == ["cpu", "reference"]
    for row, run_dir in zip(rows, runs):
        history = read_metrics(run_dir)
        epoch_s = sum(m["epoch_s"] for m in history) / len(history)
        cost = sum(m["cost_usd"] for m in history) / len(history)
        assert row["backend"] == run_dir.name and row["epochs"] == str(len(history))
        assert float(row["s/epoch"]) == pytest.approx(epoch_s, abs=5e-5)
        assert float(row["$/epoch"]) == pytest.approx(cost, rel=1e-4)
        assert float(row["value"]) == pytest.approx(1 / (epoch_s * cost), rel=1e-4)
        assert float(row["final test acc"]) == pytest.approx(history[-1]["test_acc"], abs=5e-5)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert float(row["value"]) == pytest.approx(summary["value"], rel=1e-4)  # the same definition
    assert rows[0]["parts"] == "2" and rows[1]["parts"] == "-"
    assert "reference: no per-task times" in index
    assert not list(tmp_path.glob(".report.*"))  # no temporary directory left


def test_cli_default_out_is_the_first_runs_report_dir_and_is_replaced(runs, tmp_path, capsys):
    first = tmp_path / "cpu"
    shutil.copytree(runs[0], first)
    (first / "report").mkdir()
    (first / "report" / "stale.png").write_bytes(b"old")
    assert main(["report", str(first), str(runs[1])]) == 0
    assert "index.md" in capsys.readouterr().out
    assert sorted(p.name for p in (first / "report").iterdir()) == sorted([*PLOTS, "index.md"])


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report"))
    return copy


@pytest.mark.parametrize("damage, message", [
    (lambda run: shutil.rmtree(run), r"run directory .*cpu does not exist"),
    (lambda run: (run / "metrics.jsonl").unlink(), r"cpu is not a run directory \(no metrics.jsonl\)"),
    (lambda run: (run / "config.json").unlink(), r"cpu is not a run directory \(no config.json\)"),
    (lambda run: (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"epoch": 4, "loss"\n'),
     r"metrics.jsonl line 4: not valid JSON"),
    (lambda run: (run / "metrics.jsonl").write_text('{"epoch": 1, "loss": 1.0}\n'),
     r"metrics.jsonl line 1: epoch_s missing or not a finite number"),
    (lambda run: (run / "metrics.jsonl").write_text('[1, 2]\n'), r"metrics.jsonl line 1: expected a JSON object"),
    (lambda run: (run / "metrics.jsonl").write_text(''), r"metrics.jsonl: no epochs logged yet"),
])
def test_bad_input_is_one_error_naming_the_file_and_nothing_is_written(runs, tmp_path, capsys, damage, message):
    run = _copy(runs[0], tmp_path)
    damage(run)
    out = tmp_path / "out"
    assert main(["report", str(runs[1]), str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_load_run_reads_what_train_wrote(runs):
    run = load_run(runs[0])
    assert run.backend == "cpu" and run.parts == 2 and len(run.metrics) == 3
    assert run.cost_by_component() is not None and run.value == pytest.approx(1 / (run.epoch_s * run.cost_usd))


@pytest.mark.parametrize("backend, parts", [("reference", None), ("cpu", 2), ("lambda", 2), ("gpu", 2),
                                            ("some-later-backend", 2)])
def test_parts_are_shown_for_backends_with_graph_servers(backend, parts):
    """A backend that trains without graph servers has none, whatever its config's parts says
    (the registry says which); a backend this version does not know keeps what was recorded."""
    from dorylus.report import Run

    assert Run(Path("run"), "run", {"backend": backend, "parts": 2}, []).parts == parts
