"""The GCN model module (dorylus.models.gcn): its plan and its torch-free vertex functions.

Micrograd-style: every task of ``gcn.compute`` is checked against torch autograd, the oracle,
on small random inputs; then the whole training plan runs through a tiny interpreter (dense
``A_hat``) and is checked against the single-process reference's autograd.

Tolerances. ``compute`` works in float32; the per-task oracle runs in float64 on the same
float32 inputs, so the difference is float32 rounding alone. Inputs are O(1) and every
reduction here has at most ~16 terms, so each result carries an error of a few ulp of the
terms it sums (2^-24 ~ 6e-8 relative per operation): rtol 1e-5 leaves two orders of magnitude
of room, and atol 1e-6 covers results that cancel to ~0 (where a relative bound means
nothing). Loss values are compared to 1e-5 relative (DESIGN §2). Never bit equality.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dorylus.masks import keep_mask
from dorylus.models import get_model
from dorylus.models import gcn, ops
from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, NEWEST, PIN, STASH, STATIC, VERTEX, Stage
from dorylus.models.gcn import build_plan, compute, projects_first
from dorylus.models.ops import TEST, TRAIN, VAL, encode_split
from dorylus.models.reference import ReferenceModel, masked_loss, whole_graph
from tests.models.interpreter import Interpreter
from dorylus.models.spec import LayerSpec, ModelSpec
from dorylus.normalize import gcn_normalize

SEED, EPOCH = 7, 3
RTOL, ATOL = 1e-5, 1e-6


def _close(ours: np.ndarray, oracle: torch.Tensor | np.ndarray, rtol: float = RTOL, atol: float = ATOL) -> None:
    """A float32 result of ``compute`` against the float64 oracle (see the module docstring)."""
    expected = oracle.detach().numpy() if isinstance(oracle, torch.Tensor) else np.asarray(oracle)
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float32, type(ours)
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=atol)


def _t(x: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=grad)


def _args(**kw) -> dict:
    """A stage's args as the graph server passes them (stage args + seed, epoch, training, train_count)."""
    return {"dropout": 0.0, "act_in": None, "project_first": True, "seed": SEED, "epoch": EPOCH,
            "training": True, "train_count": 1, **kw}


def _inputs(n: int = 9, fin: int = 6, fout: int = 4, seed: int = 0):
    """Rows of ``src`` (mixed signs, so ReLU matters), global ids (not 0..n-1) and the layer's
    parameters ``{"weight": W, "bias": b}`` (a bias that is not zero, so that it shows)."""
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((n, fin)).astype(np.float32)
    ids = rng.choice(10_000, n, replace=False).astype(np.int64)
    w = (rng.standard_normal((fin, fout)) * 0.5).astype(np.float32)
    return src, ids, {"weight": w, "bias": rng.standard_normal(fout).astype(np.float32)}


def _prepared(src_t: torch.Tensor, ids: np.ndarray, layer: int, p: float, act_in: str | None,
              training: bool = True) -> torch.Tensor:
    """Oracle of ``H = dropout(relu(src))``, the mask from dorylus.masks.keep_mask."""
    h = {"relu": torch.relu, "elu": torch.nn.functional.elu}[act_in](src_t) if act_in else src_t
    if training and p > 0:
        keep = torch.from_numpy(keep_mask(SEED, EPOCH, layer, ids, src_t.shape[1], p))
        h = h * keep / (1.0 - p)
    return h


CASES = [(act_in, p) for act_in in (None, "relu", "elu") for p in (0.0, 0.5)]


# ----------------------------------------------------------------------------- PREP / PREP_BWD


@pytest.mark.parametrize("act_in,p", CASES)
def test_prep_matches_torch(act_in, p):
    src, ids, _ = _inputs()
    (h,) = compute("PREP", 2, [src, ids], None, _args(dropout=p, act_in=act_in, project_first=False)).rows
    _close(h, _prepared(_t(src), ids, 2, p, act_in))
    if p > 0:  # the mask keyed by (seed, epoch, layer 2, global ids), not by row position or another layer
        keep = keep_mask(SEED, EPOCH, 2, ids, src.shape[1], p)
        assert np.array_equal(h != 0, keep & ((src > 0) if act_in == "relu" else (src != 0)))
        (other,) = compute("PREP", 1, [src, ids], None, _args(dropout=p, act_in=act_in)).rows
        assert not np.array_equal(other, h)


@pytest.mark.parametrize("act_in,p", CASES)
def test_prep_in_evaluation_has_no_dropout(act_in, p):
    src, ids, _ = _inputs()
    (h,) = compute("PREP", 1, [src, ids], None, _args(dropout=p, act_in=act_in, training=False)).rows
    _close(h, _prepared(_t(src), ids, 1, 0.0, act_in))


@pytest.mark.parametrize("act_in,p", CASES)
def test_prep_backward_matches_autograd(act_in, p):
    src, ids, _ = _inputs()
    grad_h = np.random.default_rng(1).standard_normal(src.shape).astype(np.float32)
    src_t = _t(src, grad=True)
    _prepared(src_t, ids, 2, p, act_in).backward(_t(grad_h))
    (grad_src,) = compute("PREP_BWD", 2, [grad_h, src, ids], None, _args(dropout=p, act_in=act_in)).rows
    _close(grad_src, src_t.grad)
    assert np.any(grad_src != 0)


# ----------------------------------------------------------------------------- AV and AV_BWD


@pytest.mark.parametrize("act_in,p", CASES)
@pytest.mark.parametrize("training", [True, False])
def test_av_project_first_matches_torch(act_in, p, training):
    """Project-first AV is ``H W`` alone: the bias is added after Gather (BIAS, or LOSS)."""
    src, ids, params = _inputs(fin=6, fout=4)
    args = _args(dropout=p, act_in=act_in, project_first=True, training=training)
    result = compute("AV", 1, [src, ids], params, args)
    assert result.grads is None and len(result.rows) == 1
    _close(result.rows[0], _prepared(_t(src), ids, 1, p, act_in, training) @ _t(params["weight"]))


def test_bias_adds_the_bias_after_gather():
    g, _, params = _inputs(fin=4, fout=4)
    (y,) = compute("BIAS", 1, [g], params, _args()).rows
    _close(y, _t(g) + _t(params["bias"]))


def test_av_gather_first_is_the_product_and_bias_only():
    """Gather-first AV multiplies the gathered rows and adds the bias; ReLU and dropout happened in PREP."""
    z, _, params = _inputs(fin=4, fout=6)
    for args in (_args(project_first=False), _args(project_first=False, act_in="relu", dropout=0.5)):
        result = compute("AV", 1, [z], params, args)
        assert result.grads is None and len(result.rows) == 1
        _close(result.rows[0], _t(z) @ _t(params["weight"]) + _t(params["bias"]))


@pytest.mark.parametrize("act_in,p", CASES)
@pytest.mark.parametrize("layer", [0, 1])
def test_av_backward_project_first_matches_autograd(act_in, p, layer):
    """``Y = A (H W) + b``: from ``dP = A^T dY`` and ``dY``, the gradients of W, b and src."""
    src, ids, params = _inputs(fin=6, fout=4)
    rng = np.random.default_rng(2)
    a_hat = (rng.random((9, 9)) * (rng.random((9, 9)) < 0.5)).astype(np.float32)
    grad_y = rng.standard_normal((src.shape[0], 4)).astype(np.float32)
    src_t, w_t, b_t = _t(src, grad=True), _t(params["weight"], grad=True), _t(params["bias"], grad=True)
    (_t(a_hat) @ (_prepared(src_t, ids, layer, p, act_in) @ w_t) + b_t).backward(_t(grad_y))

    grad_p = (a_hat.T @ grad_y).astype(np.float32)
    args = _args(dropout=p, act_in=act_in, project_first=True)
    result = compute("AV_BWD", layer, [grad_p, grad_y, src, ids], params, args)
    assert list(result.grads) == ["weight", "bias"]
    _close(result.grads["weight"], w_t.grad)
    _close(result.grads["bias"], b_t.grad)
    # dY is the stage's ``summed`` read: a function pulls the one row of its sum instead
    summed = compute("AV_BWD", layer, [grad_p, grad_y.sum(0, keepdims=True), src, ids], params, args)
    _close(summed.grads["bias"], b_t.grad)
    _close(summed.grads["weight"], w_t.grad)
    with pytest.raises(ValueError, match=r"dY has shape \(2, 4\), expected \(9, 4\)"):
        compute("AV_BWD", layer, [grad_p, grad_y[:2], src, ids], params, args)
    if layer == 0:  # no gradient flows into the input features
        assert result.rows == []
    else:
        (grad_src,) = result.rows
        _close(grad_src, src_t.grad)
        assert np.any(grad_src != 0)


@pytest.mark.parametrize("act_in,p", [(None, 0.5), ("relu", 0.5), ("elu", 0.0)])
def test_projection_in_row_blocks_matches_autograd(monkeypatch, act_in, p):
    """An interval longer than a block (three blocks of 4 rows, the last partial): the blocked
    ``H W`` and ``H^T dP`` equal the whole-matrix oracle, each block's rows masked by their own ids."""
    monkeypatch.setattr(ops, "PROJECT_BLOCK_ROWS", 4)
    src, ids, params = _inputs(n=11, fin=6, fout=4)
    args = _args(dropout=p, act_in=act_in, project_first=True)
    src_t, w_t = _t(src, grad=True), _t(params["weight"], grad=True)
    p_t = _prepared(src_t, ids, 1, p, act_in) @ w_t
    _close(compute("AV", 1, [src, ids], params, args).rows[0], p_t)
    grad_p = np.random.default_rng(3).standard_normal((11, 4)).astype(np.float32)
    p_t.backward(_t(grad_p))
    result = compute("AV_BWD", 1, [grad_p, grad_p, src, ids], params, args)
    _close(result.grads["weight"], w_t.grad)
    _close(result.rows[0], src_t.grad)


@pytest.mark.parametrize("act_in,p", CASES)
@pytest.mark.parametrize("layer", [0, 1])
def test_av_backward_gather_first_matches_autograd(act_in, p, layer):
    """AV_BWD gives dW and dZ; chained with A_hat^T (GA_BWD) and PREP_BWD it gives d src through
    ReLU and dropout. Layer 0's AV_BWD writes nothing."""
    rng = np.random.default_rng(3)
    src, ids, params = _inputs(n=7, fin=4, fout=6)
    a_hat = rng.random((7, 7)).astype(np.float32) * (rng.random((7, 7)) < 0.5)
    grad_y = rng.standard_normal((7, 6)).astype(np.float32)
    src_t, w_t, b_t = _t(src, grad=True), _t(params["weight"], grad=True), _t(params["bias"], grad=True)
    z_t = _t(a_hat) @ _prepared(src_t, ids, layer, p, act_in)
    z_t.retain_grad()
    (z_t @ w_t + b_t).backward(_t(grad_y))

    args = _args(dropout=p, act_in=act_in, project_first=False)
    (h,) = compute("PREP", layer, [src, ids], None, args).rows
    z = a_hat @ h
    result = compute("AV_BWD", layer, [z, grad_y], params, args)
    _close(result.grads["weight"], w_t.grad)
    _close(result.grads["bias"], b_t.grad)
    if layer == 0:
        assert result.rows == []
        return
    (grad_z,) = result.rows
    _close(grad_z, z_t.grad)
    (grad_src,) = compute("PREP_BWD", layer, [a_hat.T @ grad_z, src, ids], None, args).rows
    _close(grad_src, src_t.grad)


# ----------------------------------------------------------------------------- LOSS and AV_LOSS


def _loss_inputs(n: int = 40, classes: int = 5, seed: int = 4):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, classes)) * 2).astype(np.float32)
    split = rng.choice(np.array([0, TRAIN, VAL, TEST], dtype=np.uint8), n)
    labels = rng.integers(0, classes, n).astype(np.int64)
    labels[split == 0] = -1  # rows in no split may carry any label
    return logits, labels, split


def _torch_loss(logits_t: torch.Tensor, labels: np.ndarray, split: np.ndarray, train_count: int) -> torch.Tensor:
    train = torch.from_numpy((split & TRAIN) != 0)
    return F.cross_entropy(logits_t[train], torch.from_numpy(labels)[train], reduction="sum") / train_count


def _expected_counts(logits: np.ndarray, labels: np.ndarray, split: np.ndarray) -> dict[str, int]:
    predicted = torch.from_numpy(logits).argmax(dim=1).numpy()
    return {f"correct_{name}": int(((predicted == labels) & ((split & bit) != 0)).sum())
            for name, bit in (("train", TRAIN), ("val", VAL), ("test", TEST))}


def _no_bias(classes: int = 5) -> dict:
    """A last layer's parameters whose bias is zero: LOSS then sees the logits as given."""
    return {"weight": np.zeros((3, classes), np.float32), "bias": np.zeros(classes, np.float32)}


def test_loss_matches_torch_cross_entropy():
    logits, labels, split = _loss_inputs()
    train_count = int(((split & TRAIN) != 0).sum()) + 11  # global count: other intervals hold 11 more
    logits_t = _t(logits, grad=True)
    loss_t = _torch_loss(logits_t, labels, split, train_count)
    loss_t.backward()

    result = compute("LOSS", 1, [logits, labels, split], _no_bias(), _args(train_count=train_count))
    assert result.grads is None
    assert isinstance(result.meta["loss"], float)
    assert result.meta["loss"] == pytest.approx(loss_t.item(), rel=1e-5)
    (grad,) = result.rows
    _close(grad, logits_t.grad)
    assert np.all(grad[(split & TRAIN) == 0] == 0)
    assert list(result.meta) == ["loss"]  # accuracy is counted by the evaluation pass only

    evaluation = compute("LOSS", 1, [logits, labels, split], _no_bias(), _args(train_count=train_count,
                                                                                 training=False))
    assert evaluation.rows == [] and evaluation.grads is None
    assert evaluation.meta.pop("loss") == result.meta["loss"]
    assert evaluation.meta == _expected_counts(logits, labels, split)
    assert all(type(v) is int for v in evaluation.meta.values())
    assert 0 < sum(evaluation.meta.values()) < len(labels)


def test_loss_adds_the_bias_to_the_gathered_rows():
    """The logits of a last layer that projects first are ``G + b``; dY is d(logits)."""
    gathered, labels, split = _loss_inputs()
    params = {**_no_bias(), "bias": np.random.default_rng(9).standard_normal(5).astype(np.float32)}
    logits_t = _t(gathered, grad=True) + _t(params["bias"])
    logits_t.retain_grad()
    loss_t = _torch_loss(logits_t, labels, split, 40)
    loss_t.backward()
    result = compute("LOSS", 1, [gathered, labels, split], params, _args(train_count=40))
    assert result.meta["loss"] == pytest.approx(loss_t.item(), rel=1e-5)
    _close(result.rows[0], logits_t.grad)


def test_loss_is_stable_for_large_logits():
    logits, labels, split = _loss_inputs()
    logits = logits * np.float32(1e4)  # exp overflows float32 without the max shift
    result = compute("LOSS", 1, [logits, labels, split], _no_bias(), _args(train_count=100))
    assert np.isfinite(result.meta["loss"]) and np.all(np.isfinite(result.rows[0]))
    logits_t = _t(logits, grad=True)
    loss_t = _torch_loss(logits_t, labels, split, 100)
    loss_t.backward()
    assert result.meta["loss"] == pytest.approx(loss_t.item(), rel=1e-5)
    _close(result.rows[0], logits_t.grad)


def test_split_codes():
    train = np.array([1, 0, 0, 0, 1], bool)
    val = np.array([0, 1, 0, 0, 0], bool)
    test = np.array([0, 0, 1, 0, 1], bool)
    codes = encode_split(train, val, test)
    assert codes.dtype == np.uint8
    assert codes.tolist() == [TRAIN, VAL, TEST, 0, TRAIN | TEST]


@pytest.mark.parametrize("layer", [0, 2])
def test_av_loss_fused_matches_autograd(layer):
    logits, labels, split = _loss_inputs(n=30, classes=5)
    rng = np.random.default_rng(5)
    z = rng.standard_normal((30, 6)).astype(np.float32)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    params = {"weight": w, "bias": rng.standard_normal(5).astype(np.float32)}
    train_count = int(((split & TRAIN) != 0).sum()) + 4
    z_t, w_t, b_t = _t(z, grad=True), _t(w, grad=True), _t(params["bias"], grad=True)
    logits_t = z_t @ w_t + b_t
    loss_t = _torch_loss(logits_t, labels, split, train_count)
    loss_t.backward()

    args = _args(project_first=False, act_in="relu" if layer > 0 else None, dropout=0.5, train_count=train_count)
    result = compute("AV_LOSS", layer, [z, labels, split], params, args)
    assert result.meta["loss"] == pytest.approx(loss_t.item(), rel=1e-5)
    _close(result.grads["weight"], w_t.grad)
    _close(result.grads["bias"], b_t.grad)
    if layer == 0:
        assert result.rows == []
    else:
        (grad_z,) = result.rows
        _close(grad_z, z_t.grad)
    assert list(result.meta) == ["loss"]

    evaluation = compute("AV_LOSS", layer, [z, labels, split], params, {**args, "training": False})
    assert evaluation.rows == [] and evaluation.grads is None
    # the train rows' logits alone in training, every row's evaluating: other BLAS shapes
    assert evaluation.meta.pop("loss") == pytest.approx(result.meta["loss"], rel=1e-6)
    assert evaluation.meta == _expected_counts(z @ w + params["bias"], labels, split)


@pytest.mark.parametrize("block_rows", [1, 7, 30, 64])
def test_softmax_regression_in_row_blocks_matches_autograd(block_rows):
    """The blocked loss (AV_LOSS of an interval larger than a block) equals autograd's for any
    block size, including blocks with no train row and a last block shorter than the others."""
    from dorylus.models import ops

    _, labels, split = _loss_inputs(n=30, classes=5)
    rng = np.random.default_rng(6)
    z = rng.standard_normal((30, 6)).astype(np.float32)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    train_count = int(((split & TRAIN) != 0).sum()) + 2
    z_t, w_t, b_t = _t(z, grad=True), _t(w, grad=True), _t(b, grad=True)
    loss_t = _torch_loss(z_t @ w_t + b_t, labels, split, train_count)
    loss_t.backward()
    meta, grad_z, grad_w, grad_b = ops.softmax_regression(z, w, b, labels, split, train_count, True, block_rows)
    assert meta["loss"] == pytest.approx(loss_t.item(), rel=1e-5)
    assert list(meta) == ["loss"]
    for ours, oracle in ((grad_z, z_t.grad), (grad_w, w_t.grad), (grad_b, b_t.grad)):
        assert ours.dtype == np.float32
        _close(ours, oracle)
    assert np.all(grad_z[(split & TRAIN) == 0] == 0)
    evaluation, *grads = ops.softmax_regression(z, w, b, labels, split, train_count, False, block_rows)
    assert grads == [None, None, None]
    assert evaluation.pop("loss") == pytest.approx(loss_t.item(), rel=1e-5)
    assert evaluation == _expected_counts(z @ w + b, labels, split)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_named_value_errors():
    src, ids, w = _inputs(fin=6, fout=4)
    logits, labels, split = _loss_inputs(n=10)
    nb = _no_bias()
    bad = [
        (lambda: compute("AV", 1, [src, ids], {**w, "weight": w["weight"][:5]}, _args()), "w has 5 rows"),
        (lambda: compute("AV", 1, [src[:, :5]], w, _args(project_first=False)), "w has 6 rows"),
        (lambda: compute("AV", 1, [src[0], ids[:1]], w, _args()), "src must be a 2-D matrix"),
        (lambda: compute("AV", 1, [src, ids[:-1]], w, _args()), "ids has shape"),
        (lambda: compute("AV", 1, [src, ids], None, _args()), "needs the layer's parameters"),
        (lambda: compute("AV", 1, [src, ids], {"weight": w["weight"]}, _args()), r"missing \['bias'\]"),
        (lambda: compute("AV", 1, [src, ids], {**w, "att": w["bias"]}, _args()), r"unknown \['att'\]"),
        (lambda: compute("AV", 1, [src, ids], {**w, "bias": w["bias"][:3]}, _args()), "bias has 3 entries"),
        (lambda: compute("AV", 1, [src, ids], {**w, "bias": w["weight"]}, _args()), "parameter bias has shape"),
        (lambda: compute("PREP", 1, [src, ids[:, None]], None, _args()), "ids has shape"),
        (lambda: compute("AV_LOSS", 1, [src[:, :5], labels[:9], split[:9]], w, _args(train_count=9)),
         "w has 6 rows"),
        (lambda: compute("BIAS", 1, [src], w, _args()), "G has shape"),
        (lambda: compute("LOSS", 1, [logits, labels[:-1], split], nb, _args(train_count=9)), "labels must be"),
        (lambda: compute("LOSS", 1, [logits, labels.astype(np.float32), split], nb, _args(train_count=9)),
         "labels must be"),
        (lambda: compute("LOSS", 1, [logits, labels, split.astype(np.int64)], nb, _args(train_count=9)),
         "split must be uint8"),
        (lambda: compute("LOSS", 1, [logits[0], labels, split], nb, _args(train_count=9)),
         "G must be a 2-D matrix"),
        (lambda: compute("LOSS", 1, [logits, np.where(split != 0, 99, labels), split], nb, _args(train_count=99)),
         "has label 99"),
        (lambda: compute("LOSS", 1, [logits, labels, split], nb, _args(train_count=0)), "train_count"),
        (lambda: compute("AE", 1, [src], w, _args()), "gcn has no task 'AE'"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("case", ["av_bwd_z_width", "prep_bwd_grad_rows", "prep_bwd_src_rows", "prep_bwd_ids"])
def test_mismatched_backward_shapes_are_value_errors(case):
    src, ids, w = _inputs(n=5, fin=6, fout=4)
    grad_h = np.ones((5, 6), np.float32)
    relu_drop = _args(act_in="relu", dropout=0.5, project_first=False)
    calls = {
        # Z has 5 columns, W 6 rows: dW comes back [5, 4] instead of an error
        "av_bwd_z_width": lambda: compute("AV_BWD", 1, [src[:, :5], np.ones((5, 4), np.float32)], w, relu_drop),
        "prep_bwd_grad_rows": lambda: compute("PREP_BWD", 1, [grad_h[:1], src, ids], None, relu_drop),
        "prep_bwd_src_rows": lambda: compute("PREP_BWD", 1, [grad_h, src[:1], ids], None, relu_drop),
        "prep_bwd_ids": lambda: compute("PREP_BWD", 1, [grad_h, src, ids[:1]], None, relu_drop),
    }
    with pytest.raises(ValueError):
        calls[case]()


def test_get_model_finds_gcn():
    assert get_model("gcn") is gcn
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        get_model("nope")


# ----------------------------------------------------------------------------- the plan


def make_spec(dims: tuple[int, ...], dropout: float = 0.0) -> ModelSpec:
    last = len(dims) - 2
    return ModelSpec("gcn", tuple(
        LayerSpec(index=i, in_dim=dims[i], out_dim=dims[i + 1], dropout=dropout,
                  activation=None if i == last else "relu", weight_decay=0.0)
        for i in range(len(dims) - 1)))


F_, G_, GB, V_ = FUNCTION, GATHER, GATHER_BACKWARD, VERTEX
# (kind, task, layer) of every training stage, in order; the evaluation pass is the forward part.
SHAPES = {
    "1433-16-7": ((1433, 16, 7), [
        (F_, "AV", 0), (G_, "GA", 0), (F_, "BIAS", 0), (F_, "AV", 1), (G_, "GA", 1), (F_, "LOSS", 1),
        (GB, "GA_BWD", 1), (F_, "AV_BWD", 1), (GB, "GA_BWD", 0), (F_, "AV_BWD", 0)]),
    "8-16-7": ((8, 16, 7), [
        (V_, "PREP", 0), (G_, "GA", 0), (F_, "AV", 0), (F_, "AV", 1), (G_, "GA", 1), (F_, "LOSS", 1),
        (GB, "GA_BWD", 1), (F_, "AV_BWD", 1), (F_, "AV_BWD", 0)]),
    "16-16-16-16": ((16, 16, 16, 16), [
        (V_, "PREP", 0), (G_, "GA", 0), (F_, "AV", 0), (V_, "PREP", 1), (G_, "GA", 1), (F_, "AV", 1),
        (V_, "PREP", 2), (G_, "GA", 2), (F_, "AV_LOSS", 2),
        (GB, "GA_BWD", 2), (V_, "PREP_BWD", 2), (F_, "AV_BWD", 1), (GB, "GA_BWD", 1), (V_, "PREP_BWD", 1),
        (F_, "AV_BWD", 0)]),
    "8-4-7": ((8, 4, 7), [
        (F_, "AV", 0), (G_, "GA", 0), (F_, "BIAS", 0), (V_, "PREP", 1), (G_, "GA", 1), (F_, "AV_LOSS", 1),
        (GB, "GA_BWD", 1), (V_, "PREP_BWD", 1), (GB, "GA_BWD", 0), (F_, "AV_BWD", 0)]),
}
FORWARD_TASKS = {"PREP", "GA", "AV", "BIAS", "LOSS", "AV_LOSS"}


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_stages(shape):
    dims, expected = SHAPES[shape]
    plan = build_plan(make_spec(dims))
    assert [(s.kind, s.task, s.layer) for s in plan.train] == expected
    forward = [s for s in expected if s[1] in FORWARD_TASKS]
    assert [(s.kind, s.task, s.layer) for s in plan.evaluate] == forward
    assert plan.function_calls_per_interval(True) == sum(k == FUNCTION for k, _, _ in expected)
    assert plan.function_calls_per_interval(False) == sum(k == FUNCTION for k, _, _ in forward)
    assert all(s.task in ("LOSS", "AV_LOSS") for s in plan.train if s.layer == len(dims) - 2 and "LOSS" in s.task)


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_projects_first_exactly_when_input_is_wider(shape):
    dims, _ = SHAPES[shape]
    spec = make_spec(dims)
    plan = build_plan(spec)
    for layer in spec.layers:
        wide = layer.in_dim > layer.out_dim
        assert projects_first(layer) is wide
        stages = [s for s in (*plan.train, *plan.evaluate) if s.layer == layer.index]
        assert all(dict(s.args)["project_first"] is wide for s in stages if s.args)
        assert all(dict(s.args)["act_in"] == ("relu" if layer.index > 0 else None) for s in stages if s.args)
        assert all(dict(s.args)["dropout"] == layer.dropout for s in stages if s.args)
        (ga,) = [s for s in plan.train if s.key == ("GA", layer.index)]
        # Gather and the ghost rows run at the narrow width
        assert plan.widths[ga.reads[0]] == plan.widths[ga.writes[0]] == min(layer.in_dim, layer.out_dim)
        assert any(s.kind == VERTEX for s in stages) is (not wide)  # PREP only where Gather comes first
    assert plan.ghosted == {s.reads[0] for s in plan.train if s.kind == GATHER}


def _check_chain(stages: tuple[Stage, ...], widths: dict[str, int]) -> None:
    available = set(STATIC)
    written: list[str] = []
    for i, stage in enumerate(stages):
        missing = [r for r in stage.reads if r not in available]
        assert not missing, f"stage {i} {stage.task}{stage.layer} reads {missing} before any stage writes them"
        assert stage.kind in (GATHER, GATHER_BACKWARD) or not (set(stage.writes) & set(STATIC))
        if stage.kind in (GATHER, GATHER_BACKWARD):
            assert len(stage.reads) == 1 and len(stage.writes) == 1 and stage.weights is None
        for name in stage.writes:
            assert name not in STATIC and name in widths, name
            assert name not in written, f"{name} written twice"
            written.append(name)
        available |= set(stage.writes)
    unread = [n for n in written if not any(n in s.reads for s in stages)]
    assert not unread, f"written but never read: {unread}"


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_reads_and_writes_chain(shape):
    dims, _ = SHAPES[shape]
    spec = make_spec(dims)
    plan = build_plan(spec)
    _check_chain(plan.train, plan.widths)
    _check_chain(plan.evaluate, plan.widths)
    # every buffer's width is the width of what flows through it
    for layer in spec.layers:
        l = layer.index
        if projects_first(layer):
            assert all(plan.widths[f"{b}{l}"] == layer.out_dim for b in ("P", "G", "dY", "dP"))
        else:
            assert all(plan.widths[f"{b}{l}"] == layer.in_dim for b in ("H", "Z", "dZ", "dH"))
            assert plan.widths[f"Y{l}"] == plan.widths[f"dY{l}"] == layer.out_dim


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_gradients(shape):
    """One gradient push per layer; forward pins, backward uses the stash; no gradient for the features."""
    dims, _ = SHAPES[shape]
    plan = build_plan(make_spec(dims))
    layers = len(dims) - 1
    grads = Counter(s.layer for s in plan.train if s.grad)
    assert grads == {l: 1 for l in range(layers)}
    for s in plan.train:
        if s.grad:
            assert s.kind == FUNCTION and s.weights in (STASH, PIN)
        if s.kind in (FUNCTION, VERTEX) and s.task in FORWARD_TASKS:
            assert not s.backward
            assert s.weights == (PIN if s.task in ("AV", "AV_LOSS", "BIAS", "LOSS") else None)
        if s.task == "AV_BWD":
            assert s.weights == STASH and s.backward
        if s.layer == 0 and s.kind in (FUNCTION, VERTEX) and s.task not in ("PREP", "AV", "GA", "BIAS"):
            assert s.writes == (), f"layer 0's {s.task} writes {s.writes}: no gradient flows into the features"
    names = {n for s in plan.train for n in (*s.reads, *s.writes)}
    assert "dX" not in names and not any(n.startswith("d") and n[1:] in STATIC for n in names)


@pytest.mark.parametrize("shape", SHAPES)
def test_evaluation_plan_pins_nothing_and_writes_no_gradients(shape):
    dims, _ = SHAPES[shape]
    plan = build_plan(make_spec(dims, dropout=0.5))
    for s in plan.evaluate:
        assert s.weights in (NEWEST, None) and not s.grad and not s.backward
        assert not any(n.startswith("d") for n in s.writes), s
        if s.task in ("LOSS", "AV_LOSS"):
            assert s.writes == ()
    assert {s.layer for s in plan.evaluate if s.weights == NEWEST} == set(range(len(dims) - 1))


# ----------------------------------------------------------------------------- end to end


def _tiny_graph(num_features: int, num_classes: int, seed: int = 0):
    """6 vertices, a directed edge set (so A_hat is not symmetric and the backward needs A_hat^T)."""
    adj = gcn_normalize(np.array([0, 1, 2, 3, 4, 0, 5]), np.array([1, 2, 3, 4, 5, 3, 0]), 6, symmetrize=False)
    a_hat = np.zeros((6, 6), np.float32)
    a_hat[adj.rows(), adj.indices] = adj.weights
    assert not np.allclose(a_hat, a_hat.T)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, num_features)).astype(np.float32)
    split = np.array([TRAIN, TRAIN, VAL, TRAIN, TEST, 0], np.uint8)
    labels = rng.integers(0, num_classes, 6).astype(np.int64)
    labels[5] = -1
    statics = {"X": x, "ids": np.arange(6, dtype=np.int64), "labels": labels, "split": split}
    return adj, a_hat, statics


@pytest.mark.parametrize("intervals", [[(0, 2), (2, 6)], [(0, 3), (3, 6)]], ids=["2+4", "3+3"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES)
def test_training_plan_matches_reference_autograd(shape, dropout, intervals):
    dims, _ = SHAPES[shape]
    spec = make_spec(dims, dropout=dropout)
    plan = build_plan(spec)
    adj, a_hat, statics = _tiny_graph(dims[0], dims[-1])
    split = statics["split"]
    train_count = int(((split & TRAIN) != 0).sum())
    model = ReferenceModel(spec, SEED)
    with torch.no_grad():  # biases that are not zero, so that the forward shows where each is added
        for layer in model.layers:
            layer["bias"].copy_(torch.linspace(-0.5, 0.5, layer["bias"].shape[0]))
    params = [{name: p.detach().numpy().copy() for name, p in layer.items()} for layer in model.layers]
    interp = Interpreter(gcn, plan, whole_graph(adj), statics, params, intervals, train_count, SEED)

    meta, grads = interp.run(training=True, epoch=EPOCH)

    # the oracle: the reference model (sparse A_hat, torch autograd), same order, same masks
    sparse = whole_graph(adj)
    features = torch.from_numpy(statics["X"])
    labels_t = torch.from_numpy(statics["labels"])
    masks = {name: torch.from_numpy((split & bit) != 0) for name, bit in (("train", TRAIN), ("val", VAL),
                                                                          ("test", TEST))}
    logits = model(sparse, features, EPOCH, training=True)
    loss = masked_loss(logits, labels_t, masks["train"])
    loss.backward()
    # Both sides are float32 with different summation orders (1433-term products on one side in
    # torch's kernels, numpy's on the other): loss to 1e-5 relative (DESIGN §2), gradients to
    # 1e-4 relative with an absolute floor at 1e-5 of each gradient's scale.
    assert meta["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert sorted(grads) == list(range(len(spec.layers)))
    for l, layer in enumerate(model.layers):
        for name, param in layer.items():
            expected = param.grad.double().numpy()
            np.testing.assert_allclose(grads[l][name], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max(),
                                       err_msg=f"layer {l} {name}")
            assert np.abs(expected).max() > 0
    predicted = logits.argmax(dim=1)
    for name, mask in masks.items():
        want = int((predicted[mask] == labels_t[mask]).sum())
        assert abs(meta[f"correct_{name}"] - want) <= 1, name  # within one vertex (DESIGN §2)

    eval_meta, eval_grads = interp.run(training=False, epoch=EPOCH)
    assert eval_grads == {}
    with torch.no_grad():
        eval_logits = model(sparse, features, EPOCH, training=False)
    assert eval_meta["loss"] == pytest.approx(masked_loss(eval_logits, labels_t, masks["train"]).item(), rel=1e-5)
    if dropout == 0:
        assert eval_meta["loss"] == pytest.approx(meta["loss"], rel=1e-6)


@pytest.mark.parametrize("shape", ["8-16-7", "8-4-7"])
def test_results_do_not_depend_on_intervals(shape):
    """Masks are keyed by global vertex id: one interval or three give the same loss and dW."""
    dims, _ = SHAPES[shape]
    spec = make_spec(dims, dropout=0.5)
    plan = build_plan(spec)
    adj, _, statics = _tiny_graph(dims[0], dims[-1], seed=1)
    params = spec.init_params(SEED)
    runs = [Interpreter(gcn, plan, whole_graph(adj), statics, params, cut, 3, SEED).run(True, EPOCH)
            for cut in ([(0, 6)], [(0, 1), (1, 4), (4, 6)])]
    (meta_a, grads_a), (meta_b, grads_b) = runs
    assert meta_a["loss"] == pytest.approx(meta_b["loss"], rel=1e-6)
    for l in grads_a:
        for name in grads_a[l]:
            np.testing.assert_allclose(grads_a[l][name], grads_b[l][name], rtol=1e-5, atol=1e-7)
