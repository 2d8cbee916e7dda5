"""GraphSAGE-mean: the reference layer against PyG's SAGEConv (the oracle), and the vertex
functions' shapes and errors. The plan against the reference: tests/models/test_plans.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.models import sage
from dorylus.models.reference import whole_graph
from dorylus.models.spec import LayerSpec
from dorylus.normalize import gcn_normalize
from tests.graphs import oracle

# A directed graph with a vertex (4) that has no in-neighbour and a duplicate edge (0 -> 3 twice).
SRC = np.array([0, 1, 2, 3, 0, 5, 2, 0, 1])
DST = np.array([1, 2, 3, 5, 3, 0, 0, 3, 3])


def _layer(in_dim: int = 6, out_dim: int = 4) -> LayerSpec:
    return LayerSpec(index=0, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation=None, weight_decay=0.0)


def test_reference_layer_matches_pyg_sageconv():
    pyg = oracle("torch_geometric.nn", reason="PyG is the oracle for the SAGE layer")
    adj = gcn_normalize(SRC, DST, 6, symmetrize=False)
    layer = _layer()
    params = sage.init_params(layer, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    params["bias"] = rng.standard_normal(4).astype(np.float32)  # not zero: it must show
    x = torch.from_numpy(rng.standard_normal((6, 6)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))

    ours_x = x.clone().requires_grad_()
    ours_p = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    ours = sage.reference_layer(layer, whole_graph(adj), ours_x, ours_p, (0, 1, 0), training=False)
    (ours * upstream).sum().backward()

    conv = pyg.SAGEConv(6, 4, aggr="mean", root_weight=True)  # PyG's default bias=True: lin_l's
    assert conv.lin_r.bias is None
    with torch.no_grad():
        conv.lin_r.weight.copy_(torch.from_numpy(params["weight_self"].T))  # acts on the vertex itself
        conv.lin_l.weight.copy_(torch.from_numpy(params["weight_neigh"].T))  # on the neighbours' mean
        conv.lin_l.bias.copy_(torch.from_numpy(params["bias"]))
    edges = np.unique(np.stack([SRC, DST]), axis=1)  # the edge set: a duplicate counts once, as ours
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(edges))
    (theirs * upstream).sum().backward()

    # float32 sums of at most 3 neighbours and 6-term products (a few ulp each), summed in
    # another order: rtol 1e-5, atol 1e-6 for entries near 0.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    own = x[4] @ torch.from_numpy(params["weight_self"]) + torch.from_numpy(params["bias"])
    assert torch.allclose(ours[4], own)  # no in-neighbour: root and bias only (PyG: lin_l(0) = its bias)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight_self"].grad, conv.lin_r.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight_neigh"].grad, conv.lin_l.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["bias"].grad, conv.lin_l.bias.grad, rtol=1e-5, atol=1e-6)


def test_parameters_are_named():
    layer = _layer(5, 3)
    assert sage.params(layer) == {"weight_self": (5, 3), "weight_neigh": (5, 3), "bias": (3,)}
    params = sage.init_params(layer, np.random.default_rng(0))
    assert all(v.dtype == np.float32 for v in params.values()) and not params["bias"].any()
    assert np.abs(params["weight_self"]).max() <= np.sqrt(6 / 8)
    assert not np.allclose(params["weight_self"], params["weight_neigh"])


def _params(rng, fin=5, fout=3):
    return {"weight_self": rng.standard_normal((fin, fout)).astype(np.float32),
            "weight_neigh": rng.standard_normal((fin, fout)).astype(np.float32),
            "bias": rng.standard_normal(fout).astype(np.float32)}


def test_av_projects_both_and_its_backward_matches_autograd():
    rng = np.random.default_rng(2)
    src = rng.standard_normal((4, 5)).astype(np.float32)
    params = _params(rng)
    args = {"dropout": 0.0, "act_in": "relu", "seed": 0, "epoch": 1, "training": True, "train_count": 1}
    p, s = sage.compute("AV", 1, [src, np.arange(4)], params, args).rows
    h = np.maximum(src, 0)
    np.testing.assert_allclose(p, h @ params["weight_neigh"], rtol=1e-6)
    np.testing.assert_allclose(s, h @ params["weight_self"] + params["bias"], rtol=1e-6)

    grad_p, grad_y = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    src_t = torch.from_numpy(src).requires_grad_()
    t = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    h_t = torch.relu(src_t)
    ((h_t @ t["weight_neigh"] * torch.from_numpy(grad_p)).sum()
     + ((h_t @ t["weight_self"] + t["bias"]) * torch.from_numpy(grad_y)).sum()).backward()
    result = sage.compute("AV_BWD", 1, [grad_p, grad_y, src, np.arange(4)], params, args)
    for name in params:
        np.testing.assert_allclose(result.grads[name], t[name].grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(result.rows[0], src_t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_compute_names_bad_input():
    args = {"seed": 0, "epoch": 1, "training": True, "train_count": 1}
    params = _params(np.random.default_rng(0), fin=4, fout=2)
    with pytest.raises(ValueError, match="parameter shapes disagree"):
        sage.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)],
                     {**params, "weight_neigh": np.ones((5, 2), np.float32)}, args)
    with pytest.raises(ValueError, match="src has shape"):
        sage.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)], params, args)
    with pytest.raises(ValueError, match="no task 'AE'"):
        sage.compute("AE", 0, [], None, args)
