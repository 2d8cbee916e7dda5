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

SRC = np.array([0, 1, 2, 3, 4, 0, 5, 2, 1])
DST = np.array([1, 2, 3, 4, 5, 3, 0, 0, 3])
SEED, EPOCH = 3, 7


def _layer(heads: int, concat: bool, in_dim: int = 6, out_dim: int = 4, attention_dropout: float = 0.0) -> LayerSpec:
    return LayerSpec(index=1, in_dim=in_dim, out_dim=out_dim, dropout=0.0, activation="elu" if concat else None,
                     weight_decay=0.0, heads=heads, concat=concat, attention_dropout=attention_dropout)


@pytest.mark.parametrize("heads,concat", [(3, True), (2, False), (1, False)])
def test_reference_layer_matches_pyg_gatconv(heads, concat):
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the oracle for the GAT layer")
    adj = gcn_normalize(SRC, DST, 6, symmetrize=False)
    layer = _layer(heads, concat)
    w = gat.init_weight(layer, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((6, 6)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((6, layer.output_width)).astype(np.float32))

    ours_x, ours_w = x.clone().requires_grad_(), torch.from_numpy(w).requires_grad_()
    ours = gat.reference_layer(layer, whole_graph(adj), ours_x, ours_w, (SEED, EPOCH, 1), training=False)
    (ours * upstream).sum().backward()

    conv = pyg.GATConv(6, 4, heads=heads, concat=concat, negative_slope=0.2, add_self_loops=True, bias=False)
    with torch.no_grad():
        conv.lin.weight.copy_(torch.from_numpy(w[:-2].T))
        conv.att_dst.copy_(torch.from_numpy(w[-2].reshape(1, heads, 4)))
        conv.att_src.copy_(torch.from_numpy(w[-1].reshape(1, heads, 4)))
    theirs_x = x.clone().requires_grad_()
    theirs = conv(theirs_x, torch.from_numpy(np.stack([SRC, DST])))
    (theirs * upstream).sum().backward()

    # float32 softmax over at most 4 entries and 6-term products: ~1e-6 relative.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w.grad[:-2], conv.lin.weight.grad.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w.grad[-2], conv.att_dst.grad.reshape(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w.grad[-1], conv.att_src.grad.reshape(-1), rtol=1e-5, atol=1e-6)


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
    w = rng.standard_normal((6, heads * width)).astype(np.float32)
    args = {"dropout": p, "act_in": act_in, "heads": heads, "seed": SEED, "epoch": EPOCH, "training": True,
            "train_count": 1}
    projected, scores = gat.compute("AV", 1, [src, ids], w, args).rows

    src_t, w_t = torch.from_numpy(src).requires_grad_(), torch.from_numpy(w).requires_grad_()
    h = torch.nn.functional.elu(src_t) if act_in else src_t
    if p:
        from dorylus.masks import keep_mask

        h = h * torch.from_numpy(keep_mask(SEED, EPOCH, 1, ids, 4, p)) / (1 - p)
    p_t = h @ w_t[:-2]
    per_head = p_t.view(n, heads, width)
    s_t = torch.cat([(per_head * w_t[-2].view(heads, width)).sum(-1), (per_head * w_t[-1].view(heads, width)).sum(-1)], 1)
    np.testing.assert_allclose(projected, p_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, s_t.detach().numpy(), rtol=1e-5, atol=1e-6)

    grad_p = rng.standard_normal(projected.shape).astype(np.float32)
    grad_s = rng.standard_normal(scores.shape).astype(np.float32)
    ((p_t * torch.from_numpy(grad_p)).sum() + (s_t * torch.from_numpy(grad_s)).sum()).backward()
    result = gat.compute("AV_BWD", 1, [grad_p, grad_s, src, ids], w, args)
    np.testing.assert_allclose(result.grad_w, w_t.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result.rows[0], src_t.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert gat.compute("AV_BWD", 0, [grad_p, grad_s, src, ids], w, {**args, "act_in": None}).rows == []


def test_weight_packs_attention_vectors_and_names_bad_shapes():
    layer = _layer(heads=8, concat=True, in_dim=1433, out_dim=8)
    assert gat.weight_shape(layer) == (1435, 64)
    w = gat.init_weight(layer, np.random.default_rng(0))
    assert w.shape == (1435, 64) and np.abs(w[-2:]).max() <= np.sqrt(6 / 16)
    args = {"heads": 3, "seed": 0, "epoch": 1, "training": True}
    with pytest.raises(ValueError, match="3 heads"):
        gat.compute("AV", 0, [np.ones((2, 3), np.float32), np.arange(2)], np.ones((5, 4), np.float32), args)
