"""`dorylus train` and `dorylus partition` refuse bad input in one line, exit 2, before writing
anything; `--resume` refuses a changed dataset, partition store or model."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from dorylus.cli import main
from dorylus.data.loaders import save_npz
from dorylus.partition import assign_parts, write_store
from dorylus.runs import read_metrics
from tests.graphs import random_graph


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories land here, where the test can see them
    save_npz(random_graph(num_nodes=40, num_edges=120), tmp_path / "g.npz")
    return tmp_path


def refused(capsys, argv: list[str], words: str, workdir, status: int = 2) -> str:
    before = sorted(os.listdir(workdir))
    assert main(argv) == status
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dorylus {argv[0]}: error: ") and words in err, err
    assert sorted(os.listdir(workdir)) == before, "something was written"
    return err


def _npz(path, **changes):
    arrays = dict(np.load(path))
    arrays.update(changes)
    np.savez(path, **arrays)


@pytest.mark.parametrize("flags, words", [
    (["--lambda-memory-mb", "20000"], "lambda_memory_mb must be in [128, 10240]"),
    (["--lambda-memory-mb", "64"], "lambda_memory_mb must be in [128, 10240]"),
    (["--task-timeout-s", "1000"], "task_timeout_s must be <= 900 with the lambda backend"),
    (["--function-handler", "no_such_module:handler"], "function_handler 'no_such_module:handler' does not import"),
    (["--function-handler", "lambdas.handler:no_such_function"], "does not import"),
    (["--run-dir", "g.npz/run"], "g.npz is a file, not a directory"),
    (["--watchdog-factor", "0.5"], "watchdog_factor must be >= 1"),
    (["--checkpoint-every", "0"], "checkpoint_every must be >= 1"),
    (["--seed", "-1"], "seed must be >= 0, got -1"),
])
def test_bad_options_are_one_line_and_write_nothing(capsys, workdir, flags, words):
    refused(capsys, ["train", "--dataset", "g.npz", "--epochs", "1", *flags], words, workdir)


def test_bad_dataset_content_is_one_line(capsys, workdir):
    _npz(workdir / "g.npz", features=np.zeros((40, 0), np.float32))
    refused(capsys, ["train", "--dataset", "g.npz"], "g.npz: features have 0 columns", workdir)
    save_npz(random_graph(num_nodes=40, num_edges=120), workdir / "g.npz")
    labels = np.load(workdir / "g.npz")["labels"].copy()
    labels[0] = 99
    _npz(workdir / "g.npz", labels=labels)
    data = dict(np.load(workdir / "g.npz"))
    del data["num_classes"]
    np.savez(workdir / "g.npz", **data)
    refused(capsys, ["train", "--dataset", "g.npz"], "96 of 100 classes have no vertex: 3..98", workdir)


def test_config_file_errors_name_the_file(capsys, workdir):
    (workdir / "run.toml").write_text("dropout = 1.0\n")
    refused(capsys, ["train", "--config", "run.toml", "--dataset", "g.npz"], "run.toml with command-line flags: "
            "invalid config: dropout must be in [0, 1)", workdir)
    refused(capsys, ["train", "--config", "run.toml"], "run.toml: invalid config: dropout", workdir)


def test_parts_that_disagree_with_the_store(capsys, workdir):
    graph = random_graph(num_nodes=40, num_edges=120)
    write_store(graph, assign_parts(40, graph.src, graph.dst, 4, "contiguous"), workdir / "store",
                method="contiguous", seed=0)
    refused(capsys, ["train", "--partitions", "store", "--parts", "2", "--backend", "cpu"],
            "--parts 2 disagrees with the partition store store, which has 4 parts", workdir)


def test_partition_out_under_a_regular_file(capsys, workdir):
    refused(capsys, ["partition", "--dataset", "g.npz", "--parts", "2", "--out", "g.npz/store"],
            "g.npz is a file, not a directory", workdir)


def test_resume_refuses_changes_and_continues_otherwise(capsys, workdir):
    assert main(["train", "--dataset", "g.npz", "--backend", "reference", "--epochs", "4", "--hidden", "4",
                 "--checkpoint-every", "2", "--run-dir", "run"]) == 0
    capsys.readouterr()
    refused(capsys, ["train", "--resume", "run"], "run already finished epoch 4 of 4", workdir)
    refused(capsys, ["train", "--resume", "run", "--epochs", "6", "--hidden", "8"],
            "--resume cannot change hidden (the run has 4, got 8)", workdir)
    refused(capsys, ["train", "--resume", "run", "--config", "x.toml"], "--config cannot be combined", workdir)
    refused(capsys, ["train", "--resume", "nowhere"], "nowhere is not a run directory", workdir)
    original = (workdir / "g.npz").read_bytes()
    _npz(workdir / "g.npz", features=np.load(workdir / "g.npz")["features"] + 1)
    refused(capsys, ["train", "--resume", "run", "--epochs", "6"], "the dataset g.npz changed since the run started",
            workdir)
    (workdir / "g.npz").write_bytes(original)

    assert main(["train", "--resume", "run", "--epochs", "6"]) == 0
    assert [m["epoch"] for m in read_metrics(workdir / "run")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((workdir / "run" / "config.json").read_text())["epochs"] == 6


def test_resume_refuses_a_changed_partition_store(capsys, workdir):
    graph = random_graph(num_nodes=40, num_edges=120)
    write_store(graph, assign_parts(40, graph.src, graph.dst, 2, "contiguous"), workdir / "store",
                method="contiguous", seed=0)
    assert main(["train", "--partitions", "store", "--backend", "cpu", "--epochs", "2", "--hidden", "4",
                 "--run-dir", "run"]) == 0
    capsys.readouterr()
    shutil.rmtree(workdir / "store")
    write_store(graph, assign_parts(40, graph.src, graph.dst, 2, "random", seed=1), workdir / "store",
                method="random", seed=1)
    refused(capsys, ["train", "--resume", "run", "--epochs", "3"],
            "the partition store store changed since the run started", workdir)
