"""Sparse input features end to end on Cora (1.3% non-zero): the lambda backend on 2 graph
servers with CSR features (stored, pulled and multiplied sparse, moving far fewer bytes than
dense rows), the reference's sparse path and the cpu backend's equal the dense reference,
epoch by epoch: loss to 1e-5
relative (float32 sums in another order), accuracy within one vertex (a float32 tie may flip an
argmax)."""

from __future__ import annotations

import io

import pytest

from dorylus.config import TrainConfig
from dorylus.partition import open_store
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training

EPOCHS = 4


def _run(tmp_path, dataset, name, **options):
    config = TrainConfig(dataset=dataset.name, epochs=EPOCHS, run_dir=str(tmp_path / name), **options)
    run_training(config, dataset, progress=io.StringIO())
    return read_metrics(tmp_path / name)


def _assert_same(got, want, dataset):
    counts = {"train": dataset.train_mask.sum(), "val": dataset.val_mask.sum(), "test": dataset.test_mask.sum()}
    assert len(got) == len(want) == EPOCHS
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"epoch {w['epoch']}"
        for split, count in counts.items():
            assert abs(g[f"{split}_acc"] - w[f"{split}_acc"]) * count <= 1 + 1e-9, (split, w["epoch"])


@pytest.mark.timeout(600)
def test_cora_sparse_features_equal_dense(tmp_path, cora):
    reference_dense = _run(tmp_path, cora, "ref-dense", backend="reference", sparse_features="off")
    reference_sparse = _run(tmp_path, cora, "ref-sparse", backend="reference", sparse_features="auto")
    _assert_same(reference_sparse, reference_dense, cora)

    shape = dict(backend="lambda", parts=2, intervals=2, mode="sync")
    sparse = _run(tmp_path, cora, "lambda-sparse", sparse_features="auto", **shape)
    _assert_same(sparse, reference_dense, cora)
    assert open_store(tmp_path / "lambda-sparse" / "partitions").meta.feature_layout(0) == "csr"
    # Epoch 1 pulls X into the functions, at least once per interval (later epochs read their
    # warm cache): CSR moves its non-zeros, 49K x 8 bytes (0.4 MB), where dense rows would be
    # 2708 x 1433 x 4 bytes (15.5 MB) at least. So all of epoch 1's function traffic stays under
    # half of dense X. (A dense run beside it cost a cluster start; sparse_features="off" writes
    # dense parts: tests/partition/test_store.py.)
    dense_x = cora.num_nodes * cora.num_features * 4
    assert sparse[0]["bytes"]["functions"] < 0.5 * dense_x, (sparse[0]["bytes"], dense_x)

    cpu = _run(tmp_path, cora, "cpu-sparse", sparse_features="on", **{**shape, "backend": "cpu"})
    _assert_same(cpu, reference_dense, cora)
