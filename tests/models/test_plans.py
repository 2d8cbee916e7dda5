"""Every model's plan, run stage by stage with its own vertex and Gather functions over intervals
(tests/models/interpreter.py), equals its single-process reference (torch autograd): loss,
accuracy counts and the gradient of every parameter, with and without dropout, for 2 and 3 layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.config import TrainConfig
from dorylus.models import MODELS, get_model
from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, STATIC
from dorylus.models.ops import TEST, TRAIN, VAL
from dorylus.models.reference import ReferenceModel, masked_loss, whole_graph
from dorylus.models.spec import ModelSpec
from dorylus.normalize import gcn_normalize
from tests.models.interpreter import Interpreter

SEED, EPOCH, FEATURES, CLASSES = 5, 4, 10, 3


def _graph(seed: int = 0):
    """7 vertices, directed edges (A_hat not symmetric), vertex 6 without in-neighbours."""
    adj = gcn_normalize(np.array([0, 1, 2, 3, 4, 0, 5, 2, 1, 6]), np.array([1, 2, 3, 4, 5, 3, 0, 0, 3, 2]), 7,
                        symmetrize=False)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, 7).astype(np.int64)
    labels[5] = -1
    statics = {"X": rng.standard_normal((7, FEATURES)).astype(np.float32), "ids": np.arange(7, dtype=np.int64),
               "labels": labels, "split": np.array([TRAIN, TRAIN, VAL, TRAIN, TEST, 0, TRAIN], np.uint8)}
    return adj, statics


def _biased(reference: ReferenceModel) -> list[dict[str, np.ndarray]]:
    """The reference's parameters, its biases first set to values that are not zero (so that a
    bias added in the wrong place shows), as the interpreter takes them."""
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.linspace(-0.3, 0.4, param.shape[0]))
    return [{name: p.detach().numpy().copy() for name, p in layer.items()} for layer in reference.layers]


def _reference_grads(reference: ReferenceModel) -> list[dict[str, np.ndarray]]:
    return [{name: p.grad.double().numpy() for name, p in layer.items()} for layer in reference.layers]


def _spec(arch: str, layers: int, p: float) -> ModelSpec:
    config = TrainConfig(model=arch, layers=layers, hidden=4, heads=3, out_heads=2, dropout=p, input_dropout=p,
                         attention_dropout=p)
    return ModelSpec.from_config(config, FEATURES, CLASSES)


@pytest.mark.parametrize("intervals", [[(0, 7)], [(0, 2), (2, 5), (5, 7)]], ids=["1", "3"])
@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_plan_equals_reference(arch, layers, p, intervals):
    spec = _spec(arch, layers, p)
    model = get_model(arch)
    plan = model.build_plan(spec)
    adj, statics = _graph()
    split = statics["split"]
    train_count = int(((split & TRAIN) != 0).sum())
    reference = ReferenceModel(spec, SEED)
    params = _biased(reference)
    assert [{k: v.shape for k, v in layer.items()} for layer in params] == spec.param_shapes()
    graph = whole_graph(adj)
    interpreter = Interpreter(model, plan, graph, statics, params, intervals, train_count, SEED)
    meta, grads = interpreter.run(training=True, epoch=EPOCH)

    labels = torch.from_numpy(statics["labels"])
    masks = {name: torch.from_numpy((split & bit) != 0) for name, bit in (("train", TRAIN), ("val", VAL),
                                                                          ("test", TEST))}
    logits = reference(graph, torch.from_numpy(statics["X"]), EPOCH, training=True)
    loss = masked_loss(logits, labels, masks["train"])
    loss.backward()
    # float32 on both sides, different summation orders: loss to 1e-5 relative (DESIGN §2),
    # gradients to 1e-4 relative with an absolute floor at 1e-5 of each gradient's scale.
    assert meta["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert sorted(grads) == list(range(layers))
    # (the floor is the layer's largest gradient's scale: a gradient that is 0 in exact arithmetic,
    # as GAT's att_dst where the edge softmax cancels it, is float32 noise on both sides)
    for l, expected_layer in enumerate(_reference_grads(reference)):
        assert list(grads[l]) == list(expected_layer)
        scale = max(np.abs(expected).max() for expected in expected_layer.values())
        assert scale > 0, l
        for name, expected in expected_layer.items():
            np.testing.assert_allclose(grads[l][name], expected, rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=f"layer {l} {name}")
    assert not [k for k in meta if k.startswith("correct_")]  # accuracy is the evaluation pass's

    eval_meta, eval_grads = interpreter.run(training=False, epoch=EPOCH)
    assert eval_grads == {}
    with torch.no_grad():
        eval_logits = reference(graph, torch.from_numpy(statics["X"]), EPOCH, training=False)
    assert eval_meta["loss"] == pytest.approx(masked_loss(eval_logits, labels, masks["train"]).item(), rel=1e-5)
    predicted = eval_logits.argmax(dim=1)
    for name, mask in masks.items():
        assert abs(eval_meta[f"correct_{name}"] - int((predicted[mask] == labels[mask]).sum())) <= 1, name


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_plan_is_well_formed(arch):
    """Static inputs are never written; Gather reads ghosted buffers only; every layer pushes one
    gradient; function stages never read a buffer no earlier stage wrote."""
    plan = get_model(arch).build_plan(_spec(arch, 3, 0.5))
    written = set(STATIC)
    for stage in plan.train:
        assert not set(stage.writes) & set(STATIC), stage
        if stage.kind == GATHER:
            assert set(stage.reads) <= plan.ghosted
        if stage.kind == GATHER_BACKWARD:
            assert set(stage.reads[1:]) <= plan.ghosted and stage.reads[0] not in plan.ghosted
        assert set(stage.reads) <= written, (stage, set(stage.reads) - written)
        written |= set(stage.writes)
    assert sorted(s.layer for s in plan.train if s.grad) == [0, 1, 2]
    assert all(s.kind == FUNCTION for s in plan.train if s.weights)
    assert not any(s.grad for s in plan.evaluate)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_results_do_not_depend_on_intervals(arch):
    """Masks are keyed by global vertex (and edge) ids: one interval or three, same loss and gradients."""
    spec = _spec(arch, 2, 0.5)
    model = get_model(arch)
    adj, statics = _graph(seed=1)
    params = spec.init_params(SEED)
    runs = [Interpreter(model, model.build_plan(spec), whole_graph(adj), statics, params, cut, 4, SEED).run(True, 2)
            for cut in ([(0, 7)], [(0, 1), (1, 4), (4, 7)])]
    (meta_a, grads_a), (meta_b, grads_b) = runs
    assert meta_a["loss"] == pytest.approx(meta_b["loss"], rel=1e-6)
    for l in grads_a:
        for name in grads_a[l]:
            np.testing.assert_allclose(grads_a[l][name], grads_b[l][name], rtol=1e-5, atol=1e-7)


SPARSE_SHAPES = {"gcn-project-first": ("gcn", 4), "gcn-gather-first": ("gcn", 16), "gat": ("gat", 4),
                 "sage": ("sage", 4)}


@pytest.mark.parametrize("shape", sorted(SPARSE_SHAPES))
def test_sparse_features_equal_dense(shape):
    """Sparse X (CSR rows, dropout on the non-zeros only) gives the dense plan's loss, counts and
    weight gradients, interval by interval, and the reference's; so does the reference's own
    sparse path (torch CSR product). 10 input columns: GCN's layer 0 projects first (-> 4) or
    gathers first (-> 16, its PREP densifies)."""
    from dorylus.models.sparse import SparseRows

    arch, hidden = SPARSE_SHAPES[shape]
    config = TrainConfig(model=arch, layers=2, hidden=hidden, heads=3, out_heads=2, dropout=0.5, input_dropout=0.5,
                         attention_dropout=0.5)
    spec = ModelSpec.from_config(config, FEATURES, CLASSES)
    model = get_model(arch)
    adj, statics = _graph(seed=2)
    x = statics["X"]
    x[np.random.default_rng(3).random(x.shape) < 0.7] = 0.0  # ~30% non-zero
    x[2] = 0.0  # a vertex without features
    sparse_statics = {**statics, "X": SparseRows.from_dense(x)}
    split = statics["split"]
    train_count = int(((split & TRAIN) != 0).sum())
    params = spec.init_params(SEED)
    graph = whole_graph(adj)
    intervals = [(0, 2), (2, 5), (5, 7)]
    for training in (True, False):
        runs = [Interpreter(model, model.build_plan(spec), graph, s, params, intervals, train_count, SEED)
                .run(training, EPOCH) for s in (statics, sparse_statics)]
        (dense_meta, dense_grads), (sparse_meta, sparse_grads) = runs
        # float32 sums in another order (CSR rows vs BLAS): 1e-5 relative, as for the reference
        assert sparse_meta["loss"] == pytest.approx(dense_meta["loss"], rel=1e-5)
        assert sorted(sparse_grads) == sorted(dense_grads) == ([0, 1] if training else [])
        for l in dense_grads:  # a floor at the layer's scale, as in test_plan_equals_reference
            scale = max(np.abs(want).max() for want in dense_grads[l].values())
            for name, want in dense_grads[l].items():
                np.testing.assert_allclose(sparse_grads[l][name], want, rtol=1e-4, atol=1e-5 * scale,
                                           err_msg=f"layer {l} {name}")
        for name in () if training else ("correct_train", "correct_val", "correct_test"):
            assert abs(sparse_meta[name] - dense_meta[name]) <= 1, name
        if training:
            sparse_train_loss = sparse_meta["loss"]

    labels, train = torch.from_numpy(statics["labels"]), torch.from_numpy((split & TRAIN) != 0)
    results = []
    for features in (torch.from_numpy(x), sparse_statics["X"]):
        reference = ReferenceModel(spec, SEED)
        loss = masked_loss(reference(graph, features, EPOCH, training=True), labels, train)
        loss.backward()
        results.append((loss.item(), {name: p.grad.double().numpy() for name, p in reference.named_parameters()}))
    (dense_loss, dense_ref_grads), (sparse_loss, sparse_ref_grads) = results
    assert sparse_loss == pytest.approx(dense_loss, rel=1e-5)
    assert sparse_loss == pytest.approx(sparse_train_loss, rel=1e-5)
    scale = max(np.abs(want).max() for want in dense_ref_grads.values())
    for name, want in dense_ref_grads.items():
        np.testing.assert_allclose(sparse_ref_grads[name], want, rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=f"reference {name}")


@pytest.mark.parametrize("arch,train,evaluate", [
    ("gcn", 4 + 3 + 4 + 3, 4 + 3),                          # P0, P1 forward; dP0, dP1 backward
    ("sage", 4 + 3 + 4 + 3, 4 + 3),
    ("gat", (12 + 6) * 2 + (6 + 4) * 2, 12 + 6 + 6 + 4),    # P and scores E of 3 heads x 4, then 2 x 3
])
def test_ghost_columns_count_every_exchanged_buffer(arch, train, evaluate):
    plan = get_model(arch).build_plan(_spec(arch, 2, 0.5))
    assert (plan.ghost_columns(True), plan.ghost_columns(False)) == (train, evaluate)
