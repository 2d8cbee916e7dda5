"""The function's tensor math against torch autograd and against the reference trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dorylus.config import TrainConfig
from dorylus.masks import dropout, keep_mask
from dorylus.models.reference import masked_loss
from dorylus.training import ReferenceTrainer, prepare_graph
from lambdas.compute import (TEST, TRAIN, VAL, apply_vertex_backward, apply_vertex_forward, encode_split,
                             last_layer)
from tests.graphs import random_graph

SEED, EPOCH = 7, 3
KEY = dict(seed=SEED, epoch=EPOCH, next_layer=2)


def _close(ours: np.ndarray, oracle: torch.Tensor, rtol: float = 1e-5) -> None:
    """float32 results against a float64 oracle: relative to the oracle's scale."""
    expected = oracle.detach().numpy()
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=rtol * max(float(np.abs(expected).max()), 1e-30))


def _layer_inputs(n: int = 23, fin: int = 6, fout: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, fin)).astype(np.float32)
    w = rng.standard_normal((fin, fout)).astype(np.float32)
    ids = rng.choice(1000, n, replace=False).astype(np.int64)  # global ids: not 0..n-1
    return z, w, ids


def _torch_hidden(z, w, ids, p):
    """Oracle of a hidden layer's output rows: ``relu(Z W) * keep / (1 - p)`` in float64."""
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    out = torch.relu(zt @ wt)
    if p > 0:
        out = out * torch.from_numpy(keep_mask(SEED, EPOCH, 2, ids, w.shape[1], p)) / (1 - p)
    return zt, wt, out


@pytest.mark.parametrize("p", [0.0, 0.5, 0.2])
def test_forward_matches_torch(p):
    z, w, ids = _layer_inputs()
    _, _, expected = _torch_hidden(z, w, ids, p)
    h = apply_vertex_forward(z, w, vertex_ids=ids, next_dropout=p, training=True, **KEY)
    _close(h, expected)
    if p > 0:  # the mask is the one keyed by the NEXT layer and these global ids, not another one
        assert np.array_equal(h != 0, (z @ w > 0) & keep_mask(SEED, EPOCH, 2, ids, w.shape[1], p))
        other = apply_vertex_forward(z, w, vertex_ids=ids, next_dropout=p, training=True,
                                     seed=SEED, epoch=EPOCH, next_layer=1)
        assert not np.array_equal(other, h)


def test_forward_in_eval_mode_has_no_dropout():
    z, w, ids = _layer_inputs()
    _, _, expected = _torch_hidden(z, w, ids, 0.0)
    _close(apply_vertex_forward(z, w, vertex_ids=ids, next_dropout=0.5, training=False, **KEY), expected)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_backward_matches_autograd(p):
    z, w, ids = _layer_inputs()
    grad_next = np.random.default_rng(5).standard_normal((z.shape[0], w.shape[1])).astype(np.float32)
    zt, wt, out = _torch_hidden(z, w, ids, p)
    out.backward(torch.tensor(grad_next, dtype=torch.float64))
    grad_w, grad_z = apply_vertex_backward(z, w, grad_next, vertex_ids=ids, next_dropout=p, **KEY)
    _close(grad_w, wt.grad)
    _close(grad_z, zt.grad)
    assert np.abs(grad_z).max() > 0 and (p == 0 or np.any(grad_z != 0))


def _last_inputs(n: int = 40, fin: int = 6, classes: int = 4, seed: int = 1):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, fin)).astype(np.float32) * 3
    w = rng.standard_normal((fin, classes)).astype(np.float32)
    split = rng.choice(np.array([0, TRAIN, VAL, TEST], dtype=np.uint8), n)
    labels = rng.integers(0, classes, n)
    labels[split == 0] = -1  # unlabeled vertices are in no split
    return z, w, labels, split


def test_last_layer_matches_autograd():
    z, w, labels, split = _last_inputs()
    train = (split & TRAIN) != 0
    train_count = int(train.sum()) + 9  # the global count: other intervals hold 9 more
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    logits = zt @ wt
    t = torch.from_numpy(train)
    loss = F.cross_entropy(logits[t], torch.from_numpy(labels)[t], reduction="sum") / train_count
    loss.backward()

    result = last_layer(z, w, labels, split, train_count=train_count, training=True)
    assert isinstance(result.loss_sum, float)
    assert result.loss_sum == pytest.approx(loss.item(), rel=1e-6)
    _close(result.grad_w, wt.grad)
    _close(result.grad_z, zt.grad)
    assert np.all(result.grad_z[~train] == 0)
    predicted = logits.argmax(dim=1).numpy()
    for name, bit in (("train", TRAIN), ("val", VAL), ("test", TEST)):
        rows = (split & bit) != 0
        assert result.correct[name] == int((predicted[rows] == labels[rows]).sum())
        assert type(result.correct[name]) is int
    assert 0 < sum(result.correct.values()) < len(labels)

    evaluation = last_layer(z, w, labels, split, train_count=train_count, training=False)
    assert evaluation.grad_w is None and evaluation.grad_z is None
    assert evaluation.correct == result.correct and evaluation.loss_sum == result.loss_sum


def test_last_layer_is_stable_for_large_logits():
    z, w, labels, split = _last_inputs()
    z = z * 1e4  # exp of these logits overflows float32 without the max shift
    result = last_layer(z, w, labels, split, train_count=100, training=True)
    logits = torch.tensor(z, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64)
    t = torch.from_numpy((split & TRAIN) != 0)
    expected = F.cross_entropy(logits[t], torch.from_numpy(labels)[t], reduction="sum").item() / 100
    assert np.isfinite(result.loss_sum) and result.loss_sum == pytest.approx(expected, rel=1e-5)
    assert np.all(np.isfinite(result.grad_w)) and np.all(np.isfinite(result.grad_z))


def test_argmax_ties_take_the_first_maximum_like_torch():
    z = np.ones((3, 1), np.float32)
    w = np.array([[1.0, 1.0, 0.5]], np.float32)  # classes 0 and 1 tie in every row
    split = np.full(3, VAL, np.uint8)
    result = last_layer(z, w, np.array([0, 1, 1]), split, train_count=1, training=False)
    assert int(torch.tensor(z @ w).argmax(dim=1)[0]) == 0
    assert result.correct == {"train": 0, "val": 1, "test": 0} and result.loss_sum == 0.0


def test_intervals_sum_to_the_whole():
    """Cutting the rows into intervals (any cut) and summing per-interval results gives the whole."""
    z, w, labels, split = _last_inputs(n=50)
    ids = np.arange(100, 150)
    count = int(((split & TRAIN) != 0).sum())
    whole = last_layer(z, w, labels, split, train_count=count, training=True)
    grad_next = np.random.default_rng(2).standard_normal((50, w.shape[1])).astype(np.float32)
    whole_h = apply_vertex_forward(z, w, vertex_ids=ids, next_dropout=0.5, training=True, **KEY)
    whole_gw, whole_gz = apply_vertex_backward(z, w, grad_next, vertex_ids=ids, next_dropout=0.5, **KEY)

    bounds = [0, 7, 8, 8, 31, 50]  # includes an empty interval
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    results = [last_layer(z[s], w, labels[s], split[s], train_count=count, training=True) for s in parts]
    assert sum(r.loss_sum for r in results) == pytest.approx(whole.loss_sum, rel=1e-6)
    np.testing.assert_allclose(sum(r.grad_w for r in results), whole.grad_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.concatenate([r.grad_z for r in results]), whole.grad_z, rtol=1e-5, atol=1e-7)
    for name in ("train", "val", "test"):
        assert sum(r.correct[name] for r in results) == whole.correct[name]

    hs = [apply_vertex_forward(z[s], w, vertex_ids=ids[s], next_dropout=0.5, training=True, **KEY) for s in parts]
    np.testing.assert_allclose(np.concatenate(hs), whole_h, rtol=1e-6, atol=1e-6)
    backs = [apply_vertex_backward(z[s], w, grad_next[s], vertex_ids=ids[s], next_dropout=0.5, **KEY) for s in parts]
    np.testing.assert_allclose(sum(b[0] for b in backs), whole_gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([b[1] for b in backs]), whole_gz, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused():
    z, w, labels, split = _last_inputs()
    ids = np.arange(len(z))
    with pytest.raises(ValueError, match="z has 6 columns but w has 5 rows"):
        apply_vertex_forward(z, w[:5], vertex_ids=ids, next_dropout=0.5, training=True, **KEY)
    with pytest.raises(ValueError, match="vertex_ids has shape"):
        apply_vertex_forward(z, w, vertex_ids=ids[:-1], next_dropout=0.5, training=True, **KEY)
    with pytest.raises(ValueError, match="grad_next has shape"):
        apply_vertex_backward(z, w, np.zeros((len(z), 3), np.float32), vertex_ids=ids, next_dropout=0.5, **KEY)
    bad_labels = labels.copy()
    bad_labels[np.argmax(split == VAL)] = 4
    with pytest.raises(ValueError, match="is in a split but has label 4, outside"):
        last_layer(z, w, bad_labels, split, train_count=100, training=True)
    with pytest.raises(ValueError, match="split must be uint8"):
        last_layer(z, w, labels, split.astype(np.int64), train_count=100, training=True)
    with pytest.raises(ValueError, match="train_count"):
        last_layer(z, w, labels, split, train_count=1, training=True)


def test_full_chain_reproduces_the_reference_trainer():
    """Three GCN layers from the function math plus a dense numpy Gather equal ReferenceTrainer's
    first epoch: loss, weight gradients, and eval-mode accuracies, computed interval by interval."""
    config = TrainConfig(layers=3, hidden=8, dropout=0.5, input_dropout=0.5, seed=11, epochs=1)
    data = random_graph(num_nodes=40, num_edges=120, num_features=6, num_classes=3, seed=3)
    graph = prepare_graph(data, config)
    trainer = ReferenceTrainer(config, graph)
    epoch = 1

    # the reference's first-epoch forward/backward, as ReferenceTrainer.step does it
    logits = trainer.model(trainer.adj, trainer.features, epoch, training=True)
    loss = masked_loss(logits, trainer.labels, trainer.masks["train"])
    loss.backward()
    expected_grads = [w.grad.numpy().copy() for w in trainer.model.weights]
    expected_acc = trainer.evaluate(epoch)

    n = data.num_nodes
    adj = graph.adjacency
    a_hat = np.zeros((n, n), np.float32)
    np.add.at(a_hat, (np.repeat(np.arange(n), np.diff(adj.indptr)), adj.indices), adj.weights)
    weights = [w.detach().numpy().copy() for w in trainer.model.weights]
    layers = trainer.spec.layers
    ids = np.arange(n, dtype=np.int64)
    split = encode_split(data.train_mask, data.val_mask, data.test_mask)
    train_count = int(data.train_mask.sum())
    intervals = [slice(a, b) for a, b in [(0, 13), (13, 14), (14, 40)]]

    def forward(training):
        """Per-layer Z (inputs of the functions) and the last layer's per-interval results."""
        h = dropout(graph.features, config.seed, epoch, 0, ids, layers[0].dropout) if training else graph.features
        zs = []
        for layer, w in zip(layers[:-1], weights):
            zs.append(a_hat @ h)
            nxt = layers[layer.index + 1]
            h = np.concatenate([apply_vertex_forward(zs[-1][s], w, vertex_ids=ids[s], seed=config.seed, epoch=epoch,
                                                     next_layer=nxt.index, next_dropout=nxt.dropout, training=training)
                                for s in intervals])
        zs.append(a_hat @ h)
        return zs, [last_layer(zs[-1][s], weights[-1], data.labels[s], split[s], train_count=train_count,
                               training=training) for s in intervals]

    zs, results = forward(training=True)
    assert sum(r.loss_sum for r in results) == pytest.approx(loss.item(), rel=1e-6)
    grads = [None] * len(layers)
    grads[-1] = sum(r.grad_w for r in results)
    grad_z = np.concatenate([r.grad_z for r in results])
    for layer in reversed(layers[:-1]):
        grad_h = a_hat.T @ grad_z  # backward Gather: dL/dHd_{l+1}
        nxt = layers[layer.index + 1]
        parts = [apply_vertex_backward(zs[layer.index][s], weights[layer.index], grad_h[s], vertex_ids=ids[s],
                                       seed=config.seed, epoch=epoch, next_layer=nxt.index, next_dropout=nxt.dropout)
                 for s in intervals]
        grads[layer.index] = sum(p[0] for p in parts)
        grad_z = np.concatenate([p[1] for p in parts])
    for ours, expected in zip(grads, expected_grads):
        assert np.abs(expected).max() > 0
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())

    _, eval_results = forward(training=False)
    for name in ("train", "val", "test"):
        correct = sum(r.correct[name] for r in eval_results)
        assert correct / int(getattr(data, f"{name}_mask").sum()) == expected_acc[f"{name}_acc"]


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import lambdas.compute"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
