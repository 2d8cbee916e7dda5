"""``--curve`` in local mode: every connection of the run is CURVE (ephemeral keys in the run
directory, removed at the end), and the run equals the single-process reference, epoch by epoch
(loss to 1e-5 relative, accuracy within one vertex, as test_sync_exactness.py holds every backend
to). A plain run's logs say no CURVE: test_cluster.py's lambda run checks that."""

from __future__ import annotations

import io

import pytest

from dorylus.config import TrainConfig
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from tests.graphs import random_graph


def test_a_curve_run_equals_the_reference(tmp_path):
    graph = random_graph(num_nodes=70, num_edges=250, num_features=5, num_classes=3)
    runs = {}
    for backend in ("reference", "lambda"):
        run = tmp_path / backend
        config = TrainConfig(backend=backend, parts=2, functions=2, hidden=4, epochs=3, curve=backend == "lambda",
                             run_dir=str(run))
        run_training(config, graph, progress=io.StringIO())
        runs[backend] = read_metrics(run)
    logs = tmp_path / "lambda" / "logs"
    for name in ("paramserver", "graphserver-0", "graphserver-1"):
        assert "CURVE on" in (logs / f"{name}.log").read_text(), name
    assert not (tmp_path / "lambda" / "keys").exists()  # ephemeral: gone with the run
    assert [m["epoch"] for m in runs["lambda"]] == [1, 2, 3]
    for want, got in zip(runs["reference"], runs["lambda"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), want["epoch"]
        for split in ("train", "val", "test"):
            mask = getattr(graph, f"{split}_mask")
            assert abs(got[f"{split}_acc"] - want[f"{split}_acc"]) * mask.sum() <= 1 + 1e-9, (split, want["epoch"])
