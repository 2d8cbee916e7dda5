import io
import json

import numpy as np
import pytest
import torch

from dorylus.cli import main
from dorylus.config import TrainConfig
from dorylus.data.loaders import save_npz
from dorylus.errors import ConfigError
from dorylus.runs import EpochProgress, read_metrics
from dorylus.coordinator.training import run_training
from tests.graphs import random_graph

EPOCH_KEYS = {"epoch", "loss", "train_acc", "val_acc", "test_acc", "epoch_s"}


def test_run_directory_contents(tmp_path):
    config = TrainConfig(dataset="random", backend="reference", epochs=4, eval_every=2, hidden=4,
                         run_dir=str(tmp_path / "run"))
    summary = run_training(config, random_graph(), progress=io.StringIO())
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text()) == config.to_dict()
    metrics = read_metrics(run)
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert all(EPOCH_KEYS <= set(m) for m in metrics)
    assert metrics[0]["val_acc"] is None and metrics[1]["val_acc"] is not None
    saved = json.loads((run / "summary.json").read_text())
    assert saved["config"] == config.to_dict() and saved["final_test_acc"] == summary["final_test_acc"]
    assert summary["final_loss"] == metrics[-1]["loss"]
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    assert checkpoint["config"] == config.to_dict() and checkpoint["epoch"] == 4
    assert checkpoint["format"] == 2
    assert {name: tuple(w.shape) for name, w in checkpoint["params"].items()} == {
        "layers.0.weight": (5, 4), "layers.0.bias": (4,), "layers.1.weight": (4, 3), "layers.1.bias": (3,)}
    assert "layers.1.bias.exp_avg" in checkpoint["optimizer"]


def test_a_checkpoint_of_an_older_dorylus_is_refused_with_what_to_do(tmp_path):
    """Format 1 (one weight matrix per layer, W0, W1, no biases) cannot continue with this
    version's models: resume says where it came from and how to proceed."""
    from dorylus.runs import load_checkpoint

    torch.save({"format": 1, "config": TrainConfig().to_dict(), "epoch": 3,
                "weights": [torch.zeros(5, 4), torch.zeros(4, 3)], "optimizer": {}, "identity": {}},
               tmp_path / "checkpoint.pt")
    with pytest.raises(ConfigError, match=r"written by an older dorylus \(checkpoint format 1.*Start a new run"):
        load_checkpoint(tmp_path)


def test_training_lowers_loss_and_is_deterministic(tmp_path):
    def losses(name):
        config = TrainConfig(backend="reference", epochs=30, hidden=16, lr=0.05, dropout=0.0, input_dropout=0.0,
                             run_dir=str(tmp_path / name), row_normalize_features=False)
        run_training(config, random_graph(num_nodes=60, num_edges=200), progress=io.StringIO())
        return [m["loss"] for m in read_metrics(tmp_path / name)]

    first, second = losses("a"), losses("b")
    assert first == second
    assert first[-1] < 0.8 * first[0]


def test_refuses_non_empty_run_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("earlier results")
    with pytest.raises(ConfigError, match="not empty"):
        run_training(TrainConfig(backend="reference", epochs=1, run_dir=str(tmp_path)), random_graph(),
                     progress=io.StringIO())
    assert (tmp_path / "keep.txt").read_text() == "earlier results"
    assert not (tmp_path / "config.json").exists()


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = EpochProgress(2, out)
    bar.update({"epoch": 1, "loss": 0.5, "train_acc": None, "val_acc": None, "test_acc": None, "epoch_s": 0.01})
    bar.update({"epoch": 2, "loss": 0.25, "train_acc": 1.0, "val_acc": 0.5, "test_acc": 0.75, "epoch_s": 0.02})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2 | loss 0.5000 | train -")
    assert "test 0.7500" in lines[1] and "\r" not in out.getvalue()


def test_cli_train_end_to_end(tmp_path, capsys):
    data = tmp_path / "g.npz"
    save_npz(random_graph(num_nodes=40, num_edges=100), data)
    code = main(["train", "--dataset", str(data), "--backend", "reference", "--epochs", "3", "--hidden", "4", "--run-dir", str(tmp_path / "r")])
    assert code == 0
    assert "final test accuracy" in capsys.readouterr().out
    assert len(read_metrics(tmp_path / "r")) == 3


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["train", "--dataset", str(tmp_path / "missing.npz"), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.npz" in err[0] and err[0].startswith("dorylus train: error:")
    assert not (tmp_path / "r").exists()
    bad = random_graph()
    bad.features[3, 1] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, src=bad.src, dst=bad.dst, features=bad.features, labels=bad.labels,
             train_mask=bad.train_mask, val_mask=bad.val_mask, test_mask=bad.test_mask)
    assert main(["train", "--dataset", str(path), "--run-dir", str(tmp_path / "r")]) == 2
    assert "NaN" in capsys.readouterr().err


def test_bad_partition_store_leaves_no_run_directory(tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    (store / "meta.json").write_text("{not json")
    assert main(["train", "--partitions", str(store), "--backend", "cpu", "--run-dir", str(tmp_path / "r")]) == 2
    assert "meta.json" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    code = main(["train", "--dataset", "synthetic-small", "--parts", "30000", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and not (tmp_path / "r").exists()
