"""GIN: the reference layer against PyG's GINConv (the oracle) with the same parameters, forward
and gradients, with eps fixed and learned; the vertex functions against torch autograd; the
parameters it declares. The plan against the reference: tests/models/test_plans.py (every
registered model); sync runs against the reference: tests/distributed/test_sync_exactness.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.config import TrainConfig
from dorylus.models import gin
from dorylus.models.reference import whole_graph
from dorylus.models.spec import LayerSpec, ModelSpec
from dorylus.normalize import gcn_normalize
from tests.graphs import oracle

# A directed graph with a vertex (4) without in-neighbours and a duplicate edge (0 -> 3 twice).
SRC = np.array([0, 1, 2, 3, 0, 5, 2, 0, 1])
DST = np.array([1, 2, 3, 5, 3, 0, 0, 3, 3])
SEED, EPOCH = 3, 2


def _layer(train_eps: bool, in_dim: int = 6, hidden: int = 5, out_dim: int = 4) -> LayerSpec:
    return LayerSpec(index=1, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation="relu", weight_decay=0.0,
                     options=(("hidden", hidden), ("gin_train_eps", train_eps)))


@pytest.mark.parametrize("train_eps", [False, True])
def test_reference_layer_matches_pyg_ginconv(train_eps):
    pyg = oracle("torch_geometric.nn", reason="PyG is the oracle for the GIN layer")
    layer = _layer(train_eps)
    params = gin.init_params(layer, np.random.default_rng(0))
    if train_eps:
        params["eps"] = np.array([0.3], np.float32)  # not zero, so that (1 + eps) shows
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((6, 6)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))

    ours_x = x.clone().requires_grad_()
    ours_p = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    graph = whole_graph(gcn_normalize(SRC, DST, 6, symmetrize=False))
    ours = gin.reference_layer(layer, graph, ours_x, ours_p, (SEED, EPOCH, 1), training=True)
    (ours * upstream).sum().backward()

    mlp = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    conv = pyg.GINConv(mlp, eps=0.3 if train_eps else 0.0, train_eps=train_eps)
    with torch.no_grad():
        mlp[0].weight.copy_(torch.from_numpy(params["weight_1"].T))
        mlp[0].bias.copy_(torch.from_numpy(params["bias_1"]))
        mlp[2].weight.copy_(torch.from_numpy(params["weight_2"].T))
        mlp[2].bias.copy_(torch.from_numpy(params["bias_2"]))
    edges = np.unique(np.stack([SRC, DST]), axis=1)  # the edge set: a duplicate counts once, as ours
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(edges))
    (theirs * upstream).sum().backward()

    # float32 sums of at most 4 rows and 6-term products (a few ulp each, ~1e-7 relative), in
    # another order (ours projects before it sums): rtol 1e-5, atol 1e-6 near 0.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight_1"].grad, mlp[0].weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["bias_1"].grad, mlp[0].bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight_2"].grad, mlp[2].weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["bias_2"].grad, mlp[2].bias.grad, rtol=1e-5, atol=1e-6)
    if train_eps:
        torch.testing.assert_close(ours_p["eps"].grad, conv.eps.grad.reshape(1), rtol=1e-5, atol=1e-6)
        assert ours_p["eps"].grad.abs().item() > 0


def _inputs(train_eps: bool, n: int = 7, seed: int = 2):
    rng = np.random.default_rng(seed)
    layer = _layer(train_eps, in_dim=6, hidden=5, out_dim=4)
    params = gin.init_params(layer, rng)
    if train_eps:
        params["eps"] = np.array([-0.2], np.float32)
    src = rng.standard_normal((n, 6)).astype(np.float32)
    ids = rng.choice(1000, n, replace=False).astype(np.int64)
    gathered = rng.standard_normal((n, 5)).astype(np.float32)  # as if from GA
    return layer, params, src, ids, gathered, rng


@pytest.mark.parametrize("train_eps", [False, True])
@pytest.mark.parametrize("act_in,p", [(None, 0.0), ("relu", 0.5)])
def test_vertex_functions_match_autograd(train_eps, act_in, p):
    """AV, MLP, MLP_BWD and AV_BWD, chained as the plan runs them on one interval, against torch
    autograd of the same formulas (the Gather's rows taken as given: GA_BWD's dQ is the input)."""
    layer, params, src, ids, gathered, rng = _inputs(train_eps)
    args = {"dropout": p, "act_in": act_in, "train_eps": train_eps, "seed": SEED, "epoch": EPOCH,
            "training": True, "train_count": 1}
    (projected,) = gin.compute("AV", 1, [src, ids], params, args).rows
    (y,) = gin.compute("MLP", 1, [gathered, projected], params, args).rows

    t = {name: torch.from_numpy(value).double().requires_grad_() for name, value in params.items()}
    src_t = torch.from_numpy(src).double().requires_grad_()
    h = torch.relu(src_t) if act_in else src_t
    if p:
        from dorylus.masks import keep_mask

        h = h * torch.from_numpy(keep_mask(SEED, EPOCH, 1, ids, 6, p)) / (1 - p)
    p_t = h @ t["weight_1"]
    g_t = torch.from_numpy(gathered).double().requires_grad_()  # stands for (A + I) P: its own leaf
    z_t = g_t + (t["eps"] * p_t if train_eps else 0) + t["bias_1"]
    y_t = torch.relu(z_t) @ t["weight_2"] + t["bias_2"]
    # float32 against float64 on O(1) inputs with at most 6-term sums: rtol 1e-5, atol 1e-6
    np.testing.assert_allclose(projected, p_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, y_t.detach().numpy(), rtol=1e-5, atol=1e-6)

    grad_y = rng.standard_normal(y.shape).astype(np.float32)
    grad_q = rng.standard_normal(projected.shape).astype(np.float32)  # (A + I)^T dZ, from GA_BWD
    (y_t * torch.from_numpy(grad_y).double()).sum().backward(retain_graph=True)
    (grad_z,) = gin.compute("MLP_BWD", 1, [gathered, projected, grad_y], params, args).rows
    np.testing.assert_allclose(grad_z, g_t.grad.numpy(), rtol=1e-5, atol=1e-6)  # dG = dZ
    # dP gets (A + I)^T dZ through the Gather besides eps dZ: add the Gather's share by hand
    (p_t * torch.from_numpy(grad_q).double()).sum().backward()
    result = gin.compute("AV_BWD", 1, [grad_q, gathered, projected, grad_y, src, ids], params, args)
    assert list(result.grads) == list(params)
    for name in params:
        np.testing.assert_allclose(result.grads[name], t[name].grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(result.rows[0], src_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert gin.compute("AV_BWD", 0, [grad_q, gathered, projected, grad_y, src, ids], params,
                       {**args, "act_in": None}).rows == []


def test_loss_fuses_the_mlp_the_loss_and_dz():
    layer, params, src, ids, gathered, rng = _inputs(True)
    projected = rng.standard_normal(gathered.shape).astype(np.float32)
    labels = rng.integers(0, 4, 7).astype(np.int64)
    split = np.array([1, 1, 2, 4, 1, 0, 1], np.uint8)
    args = {"train_eps": True, "seed": SEED, "epoch": EPOCH, "training": True, "train_count": 5}
    result = gin.compute("LOSS", 1, [gathered, projected, labels, split], params, args)
    grad_z, grad_y = result.rows
    (y,) = gin.compute("MLP", 1, [gathered, projected], params, args).rows
    logits = torch.from_numpy(y).double().requires_grad_()
    train = torch.from_numpy((split & 1) != 0)
    loss = torch.nn.functional.cross_entropy(logits[train], torch.from_numpy(labels)[train], reduction="sum") / 5
    loss.backward()
    assert result.meta["loss"] == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(grad_y, logits.grad.numpy(), rtol=1e-5, atol=1e-7)
    (expected_dz,) = gin.compute("MLP_BWD", 1, [gathered, projected, grad_y], params, args).rows
    np.testing.assert_allclose(grad_z, expected_dz, rtol=1e-6, atol=1e-7)
    evaluation = gin.compute("LOSS", 1, [gathered, projected, labels, split], params, {**args, "training": False})
    assert evaluation.rows == [] and list(result.meta) == ["loss"]
    assert evaluation.meta.pop("loss") == result.meta["loss"]
    predicted = y.argmax(axis=1)
    assert evaluation.meta == {f"correct_{name}": int(((predicted == labels) & ((split & bit) != 0)).sum())
                               for name, bit in (("train", 1), ("val", 2), ("test", 4))}


def test_parameters_follow_the_config():
    fixed = ModelSpec.from_config(TrainConfig(model="gin"), 10, 3)
    learned = ModelSpec.from_config(TrainConfig(model="gin", gin_train_eps=True), 10, 3)
    assert fixed.param_shapes()[0] == {"weight_1": (10, 64), "bias_1": (64,), "weight_2": (64, 64), "bias_2": (64,)}
    assert learned.param_shapes()[1] == {"weight_1": (64, 64), "bias_1": (64,), "weight_2": (64, 3), "bias_2": (3,),
                                         "eps": (1,)}
    params = learned.init_params(0)[0]
    assert not params["eps"].any() and np.abs(params["weight_1"]).max() <= 1 / np.sqrt(10)
    with pytest.raises(ValueError, match=r"missing \['eps'\]"):
        gin.compute("AV", 0, [np.ones((2, 10), np.float32), np.arange(2)], fixed.init_params(0)[0],
                    {"train_eps": True, "seed": 0, "epoch": 1, "training": True})
    with pytest.raises(ValueError, match="gin has no task 'AE'"):
        gin.compute("AE", 0, [], fixed.init_params(0)[0], {"seed": 0, "epoch": 1, "training": True})
