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

# A directed graph with a vertex (4) that has no in-neighbour and a duplicate edge (0 -> 3 twice).
SRC = np.array([0, 1, 2, 3, 0, 5, 2, 0, 1])
DST = np.array([1, 2, 3, 5, 3, 0, 0, 3, 3])


def _layer(in_dim: int = 6, out_dim: int = 4) -> LayerSpec:
    return LayerSpec(index=0, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation=None, weight_decay=0.0)


def test_reference_layer_matches_pyg_sageconv():
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the oracle for the SAGE layer")
    adj = gcn_normalize(SRC, DST, 6, symmetrize=False)
    layer = _layer()
    w = sage.init_weight(layer, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((6, 6)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))

    ours_x, ours_w = x.clone().requires_grad_(), torch.from_numpy(w).requires_grad_()
    ours = sage.reference_layer(layer, whole_graph(adj), ours_x, ours_w, (0, 1, 0), training=False)
    (ours * upstream).sum().backward()

    conv = pyg.SAGEConv(6, 4, aggr="mean", root_weight=True, bias=False)
    with torch.no_grad():
        conv.lin_r.weight.copy_(torch.from_numpy(w[:6].T))  # W_self acts on the vertex itself
        conv.lin_l.weight.copy_(torch.from_numpy(w[6:].T))  # W_neigh on the neighbours' mean
    edges = np.unique(np.stack([SRC, DST]), axis=1)  # the edge set: a duplicate counts once, as ours
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(edges))
    (theirs * upstream).sum().backward()

    # float32 sums of at most 3 neighbours and 6-term products: agreement to ~1e-6 relative.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours[4].abs().sum() > 0 and torch.allclose(ours[4], x[4] @ torch.from_numpy(w[:6]))  # no neighbour: root only
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w.grad[:6], conv.lin_r.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w.grad[6:], conv.lin_l.weight.grad.T, rtol=1e-5, atol=1e-6)


def test_weight_is_self_then_neighbour_halves():
    layer = _layer(5, 3)
    assert sage.weight_shape(layer) == (10, 3)
    w = sage.init_weight(layer, np.random.default_rng(0))
    assert w.shape == (10, 3) and w.dtype == np.float32
    assert np.abs(w).max() <= np.sqrt(6 / 8) and not np.allclose(w[:5], w[5:])


def test_av_projects_both_halves():
    rng = np.random.default_rng(2)
    src = rng.standard_normal((4, 5)).astype(np.float32)
    w = rng.standard_normal((10, 3)).astype(np.float32)
    args = {"dropout": 0.0, "act_in": "relu", "seed": 0, "epoch": 1, "training": True, "train_count": 1}
    p, s = sage.compute("AV", 1, [src, np.arange(4)], w, args).rows
    h = np.maximum(src, 0)
    np.testing.assert_allclose(p, h @ w[5:], rtol=1e-6)
    np.testing.assert_allclose(s, h @ w[:5], rtol=1e-6)


def test_compute_names_bad_input():
    args = {"seed": 0, "epoch": 1, "training": True, "train_count": 1}
    with pytest.raises(ValueError, match=r"\[2 in, out\]"):
        sage.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)], np.ones((5, 2), np.float32), args)
    with pytest.raises(ValueError, match="src has shape"):
        sage.compute("AV", 0, [np.ones((2, 4), np.float32), np.arange(2)], np.ones((6, 2), np.float32), args)
    with pytest.raises(ValueError, match="no task 'AE'"):
        sage.compute("AE", 0, [], None, args)
