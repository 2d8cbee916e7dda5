"""Pipelined and bounded-asynchronous training, weight stashing, and relaunch under faults.

Sync and pipe exactness against the reference is in test_sync_exactness.py; here: async mode
keeps its staleness bound and trains Cora, a backward pass computes with its forward's weight
version, and a run with injected function failures, crashes and stragglers still applies every
gradient exactly once and equals the clean run.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict

import pytest

from dorylus.config import TrainConfig
from dorylus.models import MODELS
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training

LAYERS = 2


def _train(tmp_path, cora, name, **options):
    config = TrainConfig(dataset="cora", parts=2, run_dir=str(tmp_path / name), **options)
    summary = run_training(config, cora, progress=io.StringIO())
    return summary, read_metrics(tmp_path / name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("staleness", [0, 1])
def test_async_keeps_its_bounds_and_stashes_weights(tmp_path, cora, monkeypatch, staleness):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("DORYLUS_TEST_CALLS", str(calls))
    epochs, intervals = 15, 3  # 15: the bounds hold from the first epoch; the cost is the cluster's start
    summary, metrics = _train(tmp_path, cora, "run", backend="lambda", mode="async", staleness=staleness,
                              epochs=epochs, intervals=intervals, eval_every=5,
                              function_handler="tests.distributed.faulty_handler:recording_handler")
    assert [m["epoch"] for m in metrics] == list(range(1, epochs + 1))
    assert all(m["staleness_max"] <= staleness and m["weight_lag_max"] == 0 for m in metrics)
    assert all(0 <= m["staleness_mean"] <= m["staleness_max"] for m in metrics)
    assert summary["gradients"] == {"applied": 2 * intervals * LAYERS * epochs, "dropped": 0}
    # Cora at lr 0.01, sync (the reference): epoch 15's loss is 0.92 of epoch 1's (0.84 at 25);
    # with no update at all the ratio stays near 1
    ratio = metrics[-1]["loss"] / metrics[0]["loss"]
    assert ratio < 0.95, ratio

    forward, backward = {}, defaultdict(list)
    for call in map(json.loads, calls.read_text().splitlines()):
        key = (call["part"], call["interval"], call["epoch"], call["layer"])
        if call["weights"] == "pin":
            forward[key] = call["version"]
        elif call["weights"] == "stash":
            backward[key].append(call["version"])
    assert len(backward) == 2 * intervals * LAYERS * epochs
    for key, versions in backward.items():
        assert set(versions) == {forward[key]}, key  # every attempt got the forward's stashed version
        part, interval, epoch, layer = key
        assert forward[key] == epoch - 1, key  # training computes with the previous epoch's step, never older


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("staleness", [0, 1])
def test_async_reaches_cora_accuracy(tmp_path, cora, staleness):
    """The issue's acceptance: 2 parts, 200 epochs, mean test accuracy over 3 seeds >= 79.5%."""
    accuracies = []
    for seed in range(3):
        summary, _ = _train(tmp_path, cora, f"seed{seed}", backend="lambda", mode="async", staleness=staleness,
                            epochs=200, eval_every=50, seed=seed)
        accuracies.append(summary["final_test_acc"])
    assert sum(accuracies) / 3 >= 0.795, accuracies


# Every registered model runs the test below (dorylus.models.MODELS), with its own defaults
# unless it has options here (tests/test_registries.py holds them to registered models).
MODEL_RECIPES = {
    "gat": dict(hidden=8, heads=8, dropout=0.6, input_dropout=0.6, attention_dropout=0.6, lr=0.005,
                weight_decay_scope="all"),
    # GraphSAGE-mean with the Planetoid regularisation this acceptance was set with (SAGE's own
    # defaults, from GraphSAGE's code, use neither dropout nor weight decay and overfit Cora)
    "sage": dict(hidden=64, dropout=0.5, input_dropout=0.5, lr=0.01, weight_decay=5e-4, weight_decay_scope="all"),
    # GIN-0 at the paper's defaults (hidden 64, dropout 0.5, lr 0.01) with the same weight decay
    "gin": dict(weight_decay=5e-4),
}
# Sync's test accuracy after 200 epochs (seed 0, 2 graph servers, cpu), at least: the Planetoid
# figure unless named. Seen 2026-11-25: GCN 82.1% (async S=0 the same); GIN 77.9% with its recipe
# (async S=0 77.9%, S=1 74.8%; with no weight decay 75.8, 75.8 and 75.9%): sum aggregation is not
# Cora's best inductive bias. GIN's training loss reaches 0.01 by epoch 200, where float32
# round-off of the CPU's kernels decides the last points: on an AMD EPYC (2026-11-28) the
# single-process reference ended at 76.4% and sync at 75.5%, so its floor is 74%.
SYNC_FLOOR = {"gin": 0.74}


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_async_models_within_a_point_of_sync_on_cora(tmp_path, cora, model):
    """Issue 8's acceptance: async S=0 within one point of sync, 200 epochs, 2 graph servers."""
    runs = {mode: _train(tmp_path, cora, mode, backend="cpu", mode=mode, epochs=200, eval_every=200, model=model,
                         **MODEL_RECIPES.get(model, {}))[0]
            for mode in ("sync", "async")}
    assert runs["sync"]["final_test_acc"] >= SYNC_FLOOR.get(model, 0.79), runs
    assert abs(runs["async"]["final_test_acc"] - runs["sync"]["final_test_acc"]) <= 0.01, runs


@pytest.mark.slow  # the default suite has test_fallback's faulty run (raise, straggle, crash)
@pytest.mark.timeout(600)
def test_faults_are_relaunched_and_every_gradient_applied_once(tmp_path, cora):
    """10% of calls raise, 2% crash their sandbox, 5% straggle x10 (relaunched after 0.3 s, up to 8
    attempts: the payload carries the run's random token, so which calls fail differs from run to
    run, and with 4 attempts one of ~770 calls failing every time had a chance of about 15%):
    the sync run completes, equals the clean run epoch by epoch, and the parameter server applied
    exactly intervals x layers x epochs gradients, dropping the stragglers' late duplicates."""
    epochs, intervals = 12, 4
    common = dict(backend="lambda", epochs=epochs, intervals=intervals, eval_every=4)
    _, clean = _train(tmp_path, cora, "clean", **common)
    summary, faulty = _train(tmp_path, cora, "faulty", **common, fault_raise=0.10, fault_crash=0.02,
                             fault_straggle=0.05, fault_straggle_factor=10, fault_seed=3, relaunch_min_s=0.3,
                             fallback_after=8)
    assert summary["gradients"]["applied"] == 2 * intervals * LAYERS * epochs
    assert sum(m["failed_calls"] for m in faulty) > 0 and sum(m["relaunches"] for m in faulty) > 0
    for want, got in zip(clean, faulty):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["epoch"]
        assert got["test_acc"] == want["test_acc"]


@pytest.mark.timeout(300)
def test_cpu_backend_pulls_each_stash_key_once(tmp_path, cora):
    """The cpu backend pulls a stash key's weights once per training pass: its later pin and
    stash stages (GCN: BIAS and AV_BWD after AV) reuse them; evaluation pulls the newest each
    call. Async S=1 still applies every gradient once and trains."""
    from dorylus.models import get_model
    from dorylus.models.base import FUNCTION
    from dorylus.models.spec import ModelSpec

    epochs, intervals = 4, 2
    summary, metrics = _train(tmp_path, cora, "run", backend="cpu", mode="async", staleness=1, epochs=epochs,
                              intervals=intervals, eval_every=epochs)
    config = TrainConfig(dataset="cora")
    plan = get_model(config.model).build_plan(ModelSpec.from_config(config, cora.num_features, cora.num_classes))
    keys = {s.layer for s in plan.train if s.kind == FUNCTION and s.weights in ("pin", "stash")}
    eval_pulls = sum(1 for s in plan.evaluate if s.kind == FUNCTION and s.weights)
    assert len(keys) == LAYERS and eval_pulls > 0
    assert summary["weight_pulls"] == 2 * intervals * (epochs * len(keys) + eval_pulls)
    assert summary["gradients"] == {"applied": 2 * intervals * LAYERS * epochs, "dropped": 0}
    assert metrics[-1]["loss"] < metrics[0]["loss"]
