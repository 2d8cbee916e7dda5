"""``--curve`` in local mode: every connection of the run is CURVE (ephemeral keys in the run
directory, removed at the end), and the run equals the same run without it, epoch by epoch."""

from __future__ import annotations

import io

import pytest

from dorylus.config import TrainConfig
from dorylus.runs import read_metrics
from dorylus.training import run_training
from tests.graphs import random_graph


def test_a_curve_run_equals_a_plain_run(tmp_path):
    graph = random_graph(num_nodes=70, num_edges=250, num_features=5, num_classes=3)
    runs = {}
    for curve in (False, True):
        run = tmp_path / f"curve-{curve}"
        config = TrainConfig(backend="lambda", parts=2, functions=2, hidden=4, epochs=3, curve=curve,
                             run_dir=str(run))
        run_training(config, graph, progress=io.StringIO())
        runs[curve] = read_metrics(run)
    logs = tmp_path / "curve-True" / "logs"
    for name in ("paramserver", "graphserver-0", "graphserver-1"):
        assert "CURVE on" in (logs / f"{name}.log").read_text(), name
        assert "CURVE on" not in (tmp_path / "curve-False" / "logs" / f"{name}.log").read_text()
    assert not (tmp_path / "curve-True" / "keys").exists()  # ephemeral: gone with the run
    for plain, secure in zip(runs[False], runs[True], strict=True):
        assert secure["loss"] == pytest.approx(plain["loss"], rel=1e-6), plain["epoch"]
        assert (secure["train_acc"], secure["val_acc"], secure["test_acc"]) == \
            (plain["train_acc"], plain["val_acc"], plain["test_acc"])
