"""The torch twin of the models' vertex functions: ``compute(..., ops=torch_ops)`` against the
numpy ``compute`` every other role runs, task by task, for every model (values, the gradients
each backward task returns, and ``grads``), and the device dropout mask against the numpy one.

Runs on torch's CPU device; on CUDA too where present.

Tolerances. Both sides compute in float32 from the same float32 inputs; they differ only in the
order their products and reductions add (BLAS vs torch kernels). Inputs are O(1) and every
reduction here has at most ~64 terms, so a result differs by at most a few tens of float32 ulp
(2^-24 ~ 6e-8) of the largest term it sums: rtol 1e-5 with atol 1e-5 x the result's largest
magnitude leaves an order of magnitude of room, and covers results that cancel to ~0. The
dropout masks and the split codes are integers: they must be equal, bit for bit. Accuracy counts
are argmaxes of random logits (no ties at this size): equal. Loss: 1e-5 relative (DESIGN §2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus import masks
from dorylus.config import TrainConfig
from dorylus.models import MODELS, get_model, torch_ops
from dorylus.models.base import FUNCTION, VERTEX
from dorylus.models.ops import encode_split
from dorylus.models.sparse import SparseRows
from dorylus.models.spec import ModelSpec

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="CUDA is not available on this machine"))]
NUM_FEATURES, NUM_CLASSES, ROWS = 24, 5, 40
# gcn "hidden 32": layer 0 gathers first (PREP, AV, AV_BWD, PREP_BWD), layer 1 fuses (AV_LOSS);
# gcn "hidden 8": both layers project first (AV, AV_BWD, LOSS).
CONFIGS = {
    "gcn-gather-first": dict(model="gcn", hidden=32),
    "gcn-project-first": dict(model="gcn", hidden=8, layers=3),
    "gat": dict(model="gat", hidden=4, heads=3, out_heads=2),
    "sage": dict(model="sage", hidden=8),
}


def _close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    got = got.cpu().numpy()
    assert got.dtype == np.float32 and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max(initial=0))),
                               err_msg=what)


def _stage_inputs(plan, stage, spec, rng, sparse: bool):
    """Rows for every name the stage reads, on the host: random buffers, static inputs of ROWS vertices."""
    ids = rng.choice(10_000, ROWS, replace=False).astype(np.int64)  # global ids, not 0..n-1
    split_of = rng.integers(0, 4, ROWS)
    rows = {
        "X": (rng.random((ROWS, NUM_FEATURES)) < 0.3) * rng.standard_normal((ROWS, NUM_FEATURES)),
        "ids": ids,
        "labels": rng.integers(0, NUM_CLASSES, ROWS).astype(np.int64),
        "split": encode_split(split_of == 1, split_of == 2, split_of == 3),
    }
    rows["X"] = rows["X"].astype(np.float32)
    host = []
    for name in stage.reads:
        value = rows[name] if name in rows else rng.standard_normal((ROWS, plan.widths[name])).astype(np.float32)
        host.append(value)
    device = [torch.from_numpy(value) for value in host]
    if sparse and "X" in stage.reads:  # what the cpu backend holds for sparse features; the device holds X dense
        x = host[stage.reads.index("X")]
        indptr = np.concatenate([[0], np.cumsum((x != 0).sum(axis=1))]).astype(np.int64)
        host[stage.reads.index("X")] = SparseRows(x[x != 0], np.nonzero(x)[1].astype(np.int32), indptr, x.shape)
    return host, device


def test_the_twin_has_every_op_the_models_call():
    """A model's ``compute`` calls ``ops.NAME`` on the module it is handed, numpy's or this twin."""
    import inspect
    import re

    for name in MODELS:
        called = set(re.findall(r"\bops\.(\w+)", inspect.getsource(get_model(name))))
        assert called, name
        missing = sorted(op for op in called if not hasattr(torch_ops, op))
        assert not missing, f"{name} calls ops.{missing} that dorylus.models.torch_ops lacks"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-x", "sparse-x"])
def test_compute_twin_equals_numpy(config, sparse, device):
    spec = ModelSpec.from_config(TrainConfig(**CONFIGS[config], dropout=0.4, input_dropout=0.3), NUM_FEATURES,
                                 NUM_CLASSES)
    model = get_model(spec.arch)
    plan = model.build_plan(spec)
    params = spec.init_params(seed=3)
    rng = np.random.default_rng(11)
    seen = set()
    for pass_, stages in (("train", plan.train), ("eval", plan.evaluate)):
        for stage in stages:
            if stage.kind not in (FUNCTION, VERTEX):
                continue
            host, rows = _stage_inputs(plan, stage, spec, rng, sparse)
            layer_params = params[stage.layer] if stage.weights else None
            args = {**dict(stage.args), "seed": 5, "epoch": 2, "training": pass_ == "train", "train_count": 17}
            want = model.compute(stage.task, stage.layer, host, layer_params, args)
            on_device = None if layer_params is None else {
                name: torch.from_numpy(value).to(device) for name, value in layer_params.items()}
            got = model.compute(stage.task, stage.layer, [r.to(device) for r in rows], on_device, args, ops=torch_ops)
            what = f"{config} {pass_} {stage.task} layer {stage.layer}"
            assert len(got.rows) == len(want.rows) == (len(stage.writes) if pass_ == "train" or stage.task not in
                                                       ("LOSS", "AV_LOSS") else 0), what
            for name, g, expected in zip(stage.writes, got.rows, want.rows):
                assert g.device.type == device
                _close(g, np.asarray(expected), f"{what}: {name}")
            assert (got.grads is None) == (want.grads is None), what
            if want.grads is not None:
                assert list(got.grads) == list(want.grads), what
                for name, grad in want.grads.items():
                    assert got.grads[name].device.type == device
                    _close(got.grads[name], grad, f"{what}: {name}")
            assert set(got.meta) == set(want.meta), what
            for key, value in want.meta.items():
                assert got.meta[key] == pytest.approx(value, rel=1e-5), (what, key)
            seen.add(stage.task)
    # every kind of vertex function of the model was compared
    assert seen == {s.task for s in (*plan.train, *plan.evaluate) if s.kind in (FUNCTION, VERTEX)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 3, 4, 17, 64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_device_keep_mask_is_the_numpy_mask(device, width, p):
    """The splitmix64 hash in int64 arithmetic gives the same bits as numpy's uint64 one, for ids
    whose products overflow 64 bits."""
    ids = np.concatenate([np.arange(50), np.array([2**31 - 1, 2**40 + 7, 2**62 + 3])]).astype(np.int64)
    for key in ((0, 0, 0), (7, 3, 1), (2**31 - 1, 10_000, 5)):
        want = masks.keep_mask(*key, ids, width, p)
        got = torch_ops.keep_mask(key, torch.from_numpy(ids).to(device), width, p)
        np.testing.assert_array_equal(got.cpu().numpy(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("p", [0.1, 0.6])
def test_device_edge_mask_is_the_numpy_mask(device, width, p):
    """GAT's attention-dropout mask hashed on the device equals the numpy one, edge by edge,
    for ids whose products overflow 64 bits."""
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.arange(40), np.array([2**31 - 1, 2**40 + 7, 2**62 + 3])]).astype(np.int64)
    dst, src = rng.choice(ids, 200), rng.choice(ids, 200)
    for key in ((0, 0, 0), (7, 3, 1), (2**31 - 1, 10_000, 5)):
        want = masks.keep_edge_mask(*key, dst, src, width, p)
        got = torch_ops.keep_edge_mask(key, torch.from_numpy(dst).to(device), torch.from_numpy(src).to(device),
                                       width, p)
        np.testing.assert_array_equal(got.cpu().numpy(), want)
    with pytest.raises(ValueError, match="one length"):
        torch_ops.keep_edge_mask((0, 0, 0), torch.from_numpy(dst), torch.from_numpy(src[:-1]), width, p)


def test_device_ops_refuse_what_numpy_refuses():
    with pytest.raises(ValueError, match="dropout probability"):
        torch_ops.keep_mask((0, 0, 0), torch.arange(3), 4, 1.0)
    with pytest.raises(ValueError, match="float32"):
        torch_ops.as_float32(torch.zeros(3, 2, dtype=torch.float64), "rows")
    with pytest.raises(ValueError, match="columns"):
        torch_ops.matmul(torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="activation"):
        torch_ops.prepare(torch.zeros(3, 2), torch.arange(3), (0, 0, 0), 0.0, "tanh", True)
    split = torch.from_numpy(encode_split(np.ones(3, bool), np.zeros(3, bool), np.zeros(3, bool)))
    with pytest.raises(ValueError, match="train_count"):
        torch_ops.softmax_cross_entropy(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), split, 2, True)
