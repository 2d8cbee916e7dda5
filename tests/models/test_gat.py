"""GAT: the reference layer against PyG's GATConv (the oracle); the Gather's edge work and its
hand-written backward against torch autograd on a dense formulation, on a graph with ghost
columns; the vertex functions against autograd. The plan against the reference:
tests/models/test_plans.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.masks import keep_edge_mask
from dorylus.models import gat
from dorylus.models.graph import CsrGraph
from dorylus.models.reference import whole_graph
from dorylus.models.spec import LayerSpec
from dorylus.normalize import gcn_normalize
from tests.graphs import oracle

SRC = np.array([0, 1, 2, 3, 4, 0, 5, 2, 1])
DST = np.array([1, 2, 3, 4, 5, 3, 0, 0, 3])
SEED, EPOCH = 3, 7


def _layer(heads: int, concat: bool, in_dim: int = 6, out_dim: int = 4, attention_dropout: float = 0.0) -> LayerSpec:
    return LayerSpec(index=1, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation="elu" if concat else None,
                     weight_decay=0.0, heads=heads, concat=concat, attention_dropout=attention_dropout)


@pytest.mark.parametrize("heads,concat", [(3, True), (2, False), (1, False)])
def test_reference_layer_matches_pyg_gatconv(heads, concat):
    pyg = oracle("torch_geometric.nn", reason="PyG is the oracle for the GAT layer")
    adj = gcn_normalize(SRC, DST, 6, symmetrize=False)
    layer = _layer(heads, concat)
    params = gat.init_params(layer, np.random.default_rng(0))
    assert list(params) == ["weight", "att_src", "att_dst", "bias"] and not params["bias"].any()
    rng = np.random.default_rng(1)
    params["bias"] = rng.standard_normal(params["bias"].shape).astype(np.float32)  # not zero: it must show
    x = torch.from_numpy(rng.standard_normal((6, 6)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, layer.output_width)).astype(np.float32))

    ours_x = x.clone().requires_grad_()
    ours_p = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    ours = gat.reference_layer(layer, whole_graph(adj), ours_x, ours_p, (SEED, EPOCH, 1), training=False)
    (ours * upstream).sum().backward()

    # PyG's defaults: bias=True (added after the heads are concatenated or averaged)
    conv = pyg.GATConv(6, 4, heads=heads, concat=concat, negative_slope=0.2, add_self_loops=True)
    with torch.no_grad():
        conv.lin.weight.copy_(torch.from_numpy(params["weight"].T))
        conv.att_src.copy_(torch.from_numpy(params["att_src"]).view(1, heads, 4))
        conv.att_dst.copy_(torch.from_numpy(params["att_dst"]).view(1, heads, 4))
        conv.bias.copy_(torch.from_numpy(params["bias"]))
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(np.stack([SRC, DST])))
    (theirs * upstream).sum().backward()

    # float32 softmax over at most 4 entries and 6-term products (a few ulp each, ~1e-7
    # relative) summed in another order: rtol 1e-5 with an atol of 1e-6 for entries near 0.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["weight"].grad, conv.lin.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["att_src"].grad, conv.att_src.grad.view(heads, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["att_dst"].grad, conv.att_dst.grad.view(heads, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_p["bias"].grad, conv.bias.grad, rtol=1e-5, atol=1e-6)


def _local_graph() -> CsrGraph:
    """3 owned rows (global ids 10, 11, 12) over 5 local columns: 2 ghosts (global 20, 21)."""
    indptr = np.array([0, 3, 5, 8])
    indices = np.array([0, 1, 3, 1, 4, 2, 3, 4])  # every owned row has its self loop
    ids = np.array([10, 11, 12, 20, 21])
    return CsrGraph(indptr, indices, np.ones(3, np.float32), np.ones(5, np.float32), 5, ids[:3], ids)


def _dense_attention(graph: CsrGraph, projected, scores, heads, concat, keep_scale):
    """Independent oracle: per head a dense [rows, cols] score matrix, -inf off the edges."""
    width = projected.shape[1] // heads
    edges = graph.edges()
    outs = []
    for k in range(heads):
        logits = torch.full((graph.num_rows, graph.num_cols), -torch.inf)
        z = scores[edges.dst, k] + scores[edges.src, heads + k]
        logits = logits.index_put((torch.from_numpy(edges.dst), torch.from_numpy(edges.src)),
                                  torch.nn.functional.leaky_relu(z, 0.2))
        alpha = torch.softmax(logits, dim=1)
        if keep_scale is not None:
            dense_keep = torch.zeros(graph.num_rows, graph.num_cols).index_put(
                (torch.from_numpy(edges.dst), torch.from_numpy(edges.src)), keep_scale[:, k])
            alpha = alpha * dense_keep
        outs.append(alpha @ projected[:, k * width:(k + 1) * width])
    out = torch.stack(outs, dim=1)
    return out.reshape(graph.num_rows, -1) if concat else out.mean(dim=1)


@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("attention_dropout", [0.0, 0.5])
def test_gather_and_its_backward_match_autograd_with_ghost_columns(concat, attention_dropout):
    graph, heads, width = _local_graph(), 2, 3
    rng = np.random.default_rng(4)
    projected = rng.standard_normal((5, heads * width)).astype(np.float32)
    scores = rng.standard_normal((5, 2 * heads)).astype(np.float32)
    args = {"heads": heads, "concat": concat, "attention_dropout": attention_dropout, "seed": SEED,
            "epoch": EPOCH, "training": True}
    (out,) = gat.gather("GA", 1, graph, (0, 3), [projected, scores], args)
    halves = [gat.gather("GA", 1, graph, rows, [projected, scores], args)[0] for rows in ((0, 1), (1, 3))]

    keep_scale = None
    if attention_dropout:
        edges = graph.edges()
        keep = keep_edge_mask(SEED, EPOCH, 1, edges.dst_ids, edges.src_ids, heads, attention_dropout)
        assert keep.any() and not keep.all()
        keep_scale = torch.from_numpy(keep.astype(np.float32) / (1 - attention_dropout))
    p_t, s_t = torch.from_numpy(projected).requires_grad_(), torch.from_numpy(scores).requires_grad_()
    expected = _dense_attention(graph, p_t, s_t, heads, concat, keep_scale)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.vstack(halves), out, rtol=1e-6, atol=1e-7)  # row blocks = the whole

    grad_out = rng.standard_normal(out.shape).astype(np.float32)
    (expected * torch.from_numpy(grad_out)).sum().backward()
    grad_p, grad_s = gat.gather_backward("GA_BWD", 1, graph, [grad_out, projected, scores], args)
    assert grad_p.shape == (5, heads * width) and grad_s.shape == (5, 2 * heads)
    np.testing.assert_allclose(grad_p, p_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_s, s_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(grad_p[3:]).sum() > 0 and np.abs(grad_s[3:, heads:]).sum() > 0  # ghosts get their share
    assert not grad_s[3:, :heads].any()  # a ghost is never a destination here


@pytest.mark.parametrize("act_in,p", [(None, 0.0), ("elu", 0.5)])
def test_vertex_functions_match_autograd(act_in, p):
    heads, width, n = 2, 3, 5
    rng = np.random.default_rng(5)
    src = rng.standard_normal((n, 4)).astype(np.float32)
    ids = np.arange(100, 100 + n)
    params = {"weight": rng.standard_normal((4, heads * width)).astype(np.float32),
              "att_src": rng.standard_normal((heads, width)).astype(np.float32),
              "att_dst": rng.standard_normal((heads, width)).astype(np.float32),
              "bias": rng.standard_normal(heads * width).astype(np.float32)}
    args = {"dropout": p, "act_in": act_in, "heads": heads, "seed": SEED, "epoch": EPOCH, "training": True,
            "train_count": 1}
    projected, scores = gat.compute("AV", 1, [src, ids], params, args).rows

    src_t = torch.from_numpy(src).requires_grad_()
    t = {name: torch.from_numpy(value).requires_grad_() for name, value in params.items()}
    h = torch.nn.functional.elu(src_t) if act_in else src_t
    if p:
        from dorylus.masks import keep_mask

        h = h * torch.from_numpy(keep_mask(SEED, EPOCH, 1, ids, 4, p)) / (1 - p)
    p_t = h @ t["weight"]
    per_head = p_t.view(n, heads, width)
    s_t = torch.cat([(per_head * t["att_dst"]).sum(-1), (per_head * t["att_src"]).sum(-1)], 1)
    np.testing.assert_allclose(projected, p_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, s_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    gathered = rng.standard_normal((n, heads * width)).astype(np.float32)  # as if from GA
    (y,) = gat.compute("BIAS", 1, [gathered], params, args).rows
    np.testing.assert_allclose(y, gathered + params["bias"], rtol=1e-6)

    grad_p = rng.standard_normal(projected.shape).astype(np.float32)
    grad_s = rng.standard_normal(scores.shape).astype(np.float32)
    grad_y = rng.standard_normal((n, heads * width)).astype(np.float32)
    y_t = torch.from_numpy(gathered) + t["bias"]
    ((p_t * torch.from_numpy(grad_p)).sum() + (s_t * torch.from_numpy(grad_s)).sum()
     + (y_t * torch.from_numpy(grad_y)).sum()).backward()
    result = gat.compute("AV_BWD", 1, [grad_p, grad_s, grad_y, src, ids], params, args)
    assert list(result.grads) == list(params)
    for name in params:
        np.testing.assert_allclose(result.grads[name], t[name].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(result.rows[0], src_t.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert gat.compute("AV_BWD", 0, [grad_p, grad_s, grad_y, src, ids], params, {**args, "act_in": None}).rows == []


def test_parameters_are_named_and_bad_shapes_are_named():
    layer = _layer(heads=8, concat=True, in_dim=1433, out_dim=8)
    assert gat.params(layer) == {"weight": (1433, 64), "att_src": (8, 8), "att_dst": (8, 8), "bias": (64,)}
    assert gat.params(_layer(heads=2, concat=False))["bias"] == (4,)  # averaged heads: one head's width
    params = gat.init_params(layer, np.random.default_rng(0))
    assert {k: v.shape for k, v in params.items()} == gat.params(layer)
    assert np.abs(params["att_src"]).max() <= np.sqrt(6 / 16) and not params["bias"].any()
    args = {"heads": 3, "seed": 0, "epoch": 1, "training": True}
    bad = {"weight": np.ones((3, 4), np.float32), "att_src": np.ones((2, 2), np.float32),
           "att_dst": np.ones((2, 2), np.float32), "bias": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match="3 heads"):
        gat.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)], bad, args)
    with pytest.raises(ValueError, match=r"missing \['att_dst'\]"):
        gat.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)],
                    {k: v for k, v in bad.items() if k != "att_dst"}, {**args, "heads": 2})
