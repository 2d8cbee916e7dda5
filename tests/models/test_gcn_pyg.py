"""GCN's reference layer against PyG's GCNConv (the oracle): forward and every gradient, bias
added after the aggregation, for a layer that projects first and one that gathers first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.models import gcn
from dorylus.models.reference import whole_graph
from dorylus.models.spec import LayerSpec
from dorylus.normalize import gcn_normalize
from tests.graphs import oracle

# A directed graph with a vertex (4) that has no in-neighbour; no duplicate edge (PyG would count
# a duplicate twice in the degree, ours once).
SRC = np.array([0, 1, 2, 3, 0, 5, 2, 1])
DST = np.array([1, 2, 3, 5, 3, 0, 0, 3])


@pytest.mark.parametrize("in_dim,out_dim", [(6, 4), (3, 5)])  # projects first; gathers first
def test_reference_layer_matches_pyg_gcnconv(in_dim, out_dim):
    pyg = oracle("torch_geometric.nn", reason="PyG is the oracle for the GCN layer")
    layer = LayerSpec(index=0, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation=None, weight_decay=0.0)
    assert gcn.projects_first(layer) == (in_dim > out_dim)
    adj = gcn_normalize(SRC, DST, 6, symmetrize=False)
    params = gcn.init_params(layer, np.random.default_rng(0))
    assert not params["bias"].any()  # PyG's GCNConv starts its bias at zero too
    rng = np.random.default_rng(1)
    params["bias"] = rng.standard_normal(out_dim).astype(np.float32)  # not zero: it must show
    x = torch.from_numpy(rng.standard_normal((6, in_dim)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, out_dim)).astype(np.float32))

    ours_x = x.clone().requires_grad_()
    ours_p = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    ours = gcn.reference_layer(layer, whole_graph(adj), ours_x, ours_p, (0, 1, 0), training=False)
    (ours * upstream).sum().backward()

    conv = pyg.GCNConv(in_dim, out_dim)  # self loops, symmetric normalization, bias=True
    with torch.no_grad():
        conv.lin.weight.copy_(torch.from_numpy(params["weight"].T))
        conv.bias.copy_(torch.from_numpy(params["bias"]))
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(np.stack([SRC, DST])))
    (theirs * upstream).sum().backward()

    # float32 sums of at most 4 terms and products of at most 6, in another order: a few ulp.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[4], x[4] @ torch.from_numpy(params["weight"]) + torch.from_numpy(params["bias"]))
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight"].grad, conv.lin.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["bias"].grad, conv.bias.grad, rtol=1e-5, atol=1e-6)
