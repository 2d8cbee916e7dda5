"""Tests of the degree-corrected SBM generator: structure, homophily, degrees, determinism,
presets, error messages, and that the graph carries class signal a GCN can use."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dorylus.data import synthetic
from dorylus.data.synthetic import PRESETS, SyntheticSpec, generate, generate_preset, preset_names
from dorylus.errors import DatasetError
from dorylus.normalize import gcn_normalize, row_normalize

SMALL = SyntheticSpec(num_nodes=3000, num_edges=45_000, num_features=32, num_classes=6, name="t")


def edge_homophily(ds) -> float:
    return float((ds.labels[ds.src] == ds.labels[ds.dst]).mean())


def assert_simple_undirected(ds, spec: SyntheticSpec) -> None:
    """Exactly spec.num_edges int64 edges, ids in range, no self-loops, no duplicates, and the
    second half is the first half reversed (so every edge is present both ways)."""
    n, e = spec.num_nodes, spec.num_edges
    assert ds.src.dtype == ds.dst.dtype == np.int64
    assert ds.src.shape == ds.dst.shape == (e,)
    assert ds.src.min() >= 0 and ds.dst.min() >= 0 and ds.src.max() < n and ds.dst.max() < n
    assert not np.any(ds.src == ds.dst)
    keys = ds.src * n + ds.dst
    assert np.unique(keys).size == e
    np.testing.assert_array_equal(ds.src[e // 2 :], ds.dst[: e // 2])
    np.testing.assert_array_equal(ds.dst[e // 2 :], ds.src[: e // 2])
    assert not ds.directed


def test_structure_shapes_and_masks():
    ds = generate(SMALL, seed=3)
    assert_simple_undirected(ds, SMALL)
    assert ds.features.dtype == np.float32 and ds.features.shape == (3000, 32)
    assert ds.features.min() >= 0.0  # rectified, so row normalization is well defined
    assert 0.03 < (ds.features > 0).mean() < 0.15  # sparse, like bag-of-words
    assert ds.labels.dtype == np.int64 and ds.num_classes == 6
    sizes = np.bincount(ds.labels, minlength=6)
    assert sizes.size == 6 and sizes.min() > 0 and sizes.max() > sizes.min()  # sizes vary
    assert (ds.train_mask.sum(), ds.val_mask.sum(), ds.test_mask.sum()) == (150, 300, 900)
    overlap = ds.train_mask.astype(int) + ds.val_mask + ds.test_mask
    assert overlap.max() == 1
    assert ds.name == "t"


@pytest.mark.parametrize("homophily", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_measured_homophily_is_the_spec(homophily):
    ds = generate(dataclasses.replace(SMALL, homophily=homophily), seed=1)
    pairs = SMALL.num_edges // 2
    assert edge_homophily(ds) == pytest.approx(round(homophily * pairs) / pairs, abs=1e-12)


def test_target_draws_follow_the_model_probabilities():
    """Oracle: from a source in community c the other endpoint is v with probability
    theta_v / Theta_c inside c (intra pool) or theta_v / (Theta - Theta_c) outside (inter pool)."""
    labels = np.array([2, 0, 1, 1, 0, 1, 2], dtype=np.int64)
    theta = np.array([1.0, 3.0, 2.0, 0.5, 4.0, 1.5, 2.5])
    draws = 400_000
    line = synthetic._Line.build(labels, theta, 3)
    for c in range(3):
        inside = labels == c
        for own, allowed in ((True, inside), (False, ~inside)):
            expected = np.where(allowed, theta, 0.0) / theta[allowed].sum()
            sources = np.full(draws, c, dtype=np.int64)
            targets = synthetic._sample_targets(line, sources, own, np.random.default_rng(c))
            observed = np.bincount(targets, minlength=labels.size) / draws
            # 5 standard errors of a frequency near 0.5 over 400K draws is ~0.004.
            np.testing.assert_allclose(observed, expected, atol=0.004)


def test_degrees_are_heavy_tailed_and_follow_the_exponent():
    def degree_stats(exponent):
        ds = generate(dataclasses.replace(SMALL, degree_exponent=exponent), seed=4)
        deg = np.bincount(ds.src, minlength=ds.num_nodes)
        return np.median(deg), deg.max(), deg.std() / deg.mean()

    median, top, cv_heavy = degree_stats(2.1)
    assert top >= 10 * median
    _, _, cv_light = degree_stats(6.0)
    assert cv_heavy > 2 * cv_light


def test_same_seed_is_bit_identical_and_other_seeds_differ():
    a, b, c = generate(SMALL, seed=7), generate(SMALL, seed=7), generate(SMALL, seed=8)
    for field in ("src", "dst", "features", "labels", "train_mask", "val_mask", "test_mask"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), field
        assert not np.array_equal(x, getattr(c, field)), field


def test_many_chunks_and_top_up_rounds(monkeypatch):
    """Tiny chunks and a starved first round exercise chunking, top-ups and the final trim."""
    monkeypatch.setattr(synthetic, "_CHUNK_EDGES", 997)
    monkeypatch.setattr(synthetic, "_FEATURE_CHUNK_ROWS", 100)
    monkeypatch.setattr(synthetic, "_OVERSAMPLE", 0.3)
    messages = []
    ds = generate(SMALL, seed=5, progress=messages.append)
    assert_simple_undirected(ds, SMALL)
    assert sum("after round" in m for m in messages) >= 2
    assert sum("sources" in m for m in messages) > 20
    assert edge_homophily(ds) == pytest.approx(SMALL.homophily, abs=1e-4)
    # Chunked features follow the model: without signal x = max(0, Z - tau), Z ~ N(0, 1), so
    # P(x = 0) = Phi(tau) and E[x] = phi(tau) - tau * Phi(-tau).
    flat = generate(dataclasses.replace(SMALL, feature_snr=0.0), seed=5).features
    tau = synthetic._FEATURE_THRESHOLD
    cdf = 0.5 * (1 + math.erf(tau / math.sqrt(2)))
    pdf = math.exp(-tau * tau / 2) / math.sqrt(2 * math.pi)
    assert (flat == 0).mean() == pytest.approx(cdf, abs=0.002)
    assert flat.mean() == pytest.approx(pdf - tau * (1 - cdf), abs=0.001)


def test_features_carry_class_signal_scaled_by_snr():
    """Spread of the class means across classes: ~0 without signal, large with it."""

    def class_mean_spread(snr):
        ds = generate(dataclasses.replace(SMALL, feature_snr=snr), seed=6)
        means = np.stack([ds.features[ds.labels == c].mean(0) for c in range(ds.num_classes)])
        return means.std(0).mean()

    # Without signal the spread is sampling noise: std(max(0, Z - 1.5)) ~ 0.15 over ~500 vertices.
    assert class_mean_spread(0.0) < 0.012
    assert class_mean_spread(0.5) > 0.025


def test_progress_callback_and_silence(capsys):
    messages = []
    generate(SMALL, progress=messages.append)
    assert any("features" in m for m in messages)
    assert capsys.readouterr() == ("", "")


def test_too_dense_spec_fails_clearly():
    # Homophily 1 keeps every edge inside two communities of ~10: far fewer pairs than asked.
    spec = SyntheticSpec(num_nodes=20, num_edges=300, num_features=4, num_classes=2, homophily=1.0, name="dense")
    with pytest.raises(DatasetError, match="'dense'.*intra-class.*too dense"):
        generate(spec)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_edges=45_001), "num_edges"),
        (dict(num_nodes=3000.0), "num_nodes"),
        (dict(num_edges=3000 * 2999 + 2), "num_edges"),
        (dict(homophily=1.5), "homophily"),
        (dict(degree_exponent=1.0), "degree_exponent"),
        (dict(feature_snr=float("nan")), "feature_snr"),
        (dict(num_classes=1), "num_classes"),
        (dict(num_features=0), "num_features"),
        (dict(train_fraction=0.6, val_fraction=0.3, test_fraction=0.3), "fractions"),
        (dict(train_fraction=0.0001), "train_fraction"),
    ],
)
def test_bad_spec_names_the_field(change, field):
    with pytest.raises(DatasetError, match=f"synthetic spec 't'.*{field}"):
        dataclasses.replace(SMALL, **change)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed(seed):
    with pytest.raises(DatasetError, match="seed"):
        generate(SMALL, seed=seed)


def test_presets():
    assert preset_names() == ["synthetic-1m", "synthetic-reddit", "synthetic-small"]
    reddit = PRESETS["synthetic-reddit"]
    assert (reddit.num_nodes, reddit.num_features, reddit.num_classes) == (232_965, 602, 41)
    assert reddit.num_edges == pytest.approx(114.6e6, rel=0.01)
    fractions = (reddit.train_fraction, reddit.val_fraction, reddit.test_fraction)
    assert fractions == pytest.approx((0.66, 0.10, 0.24), abs=0.01)
    assert PRESETS["synthetic-1m"].num_edges == pytest.approx(1e6, rel=0.05)

    small = generate_preset("synthetic-small")
    spec = PRESETS["synthetic-small"]
    assert small.name == "synthetic-small"
    assert (small.num_nodes, small.num_features, small.num_classes) == (20_000, 128, 10)
    assert_simple_undirected(small, spec)
    assert edge_homophily(small) == pytest.approx(spec.homophily, abs=1e-5)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(DatasetError, match="'cora-xl'.*synthetic-1m, synthetic-reddit, synthetic-small"):
        generate_preset("cora-xl")


def kipf_accuracy(ds, use_graph: bool, epochs: int = 200, seed: int = 0) -> float:
    """Test accuracy of the Kipf & Welling 2-layer GCN (hidden 16, dropout 0.5, Adam lr 0.01,
    weight decay 5e-4 on the first layer, row-normalized features); ``use_graph=False`` sets
    ``A_hat = I``, which makes it an MLP on the features alone."""
    torch.manual_seed(seed)
    n = ds.num_nodes
    if use_graph:
        a = gcn_normalize(ds.src, ds.dst, n)
        index = torch.from_numpy(np.stack([a.rows(), a.indices]))
        adj = torch.sparse_coo_tensor(index, torch.from_numpy(a.weights), (n, n), check_invariants=True).coalesce()
        propagate = lambda h: torch.sparse.mm(adj, h)  # noqa: E731
    else:
        propagate = lambda h: h  # noqa: E731
    x = torch.from_numpy(row_normalize(ds.features))
    y = torch.from_numpy(ds.labels)
    train, test = torch.from_numpy(ds.train_mask), torch.from_numpy(ds.test_mask)
    w1 = torch.nn.init.xavier_uniform_(torch.empty(ds.num_features, 16)).requires_grad_()
    w2 = torch.nn.init.xavier_uniform_(torch.empty(16, ds.num_classes)).requires_grad_()
    b1 = torch.zeros(16, requires_grad=True)
    b2 = torch.zeros(ds.num_classes, requires_grad=True)
    optimizer = torch.optim.Adam([{"params": [w1, b1], "weight_decay": 5e-4}, {"params": [w2, b2]}], lr=0.01)

    def forward(training: bool) -> torch.Tensor:
        h = torch.nn.functional.dropout(x, 0.5, training)
        h = torch.relu(propagate(h @ w1) + b1)
        h = torch.nn.functional.dropout(h, 0.5, training)
        return propagate(h @ w2) + b2

    for _ in range(epochs):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(True)[train], y[train]).backward()
        optimizer.step()
    with torch.no_grad():
        return float((forward(False).argmax(1)[test] == y[test]).float().mean())


def test_graph_makes_the_task_learnable():
    """The synthetic-small recipe scaled to 3K vertices (150 training labels, 10 classes): the
    GCN is far above chance and clearly beats the same model without the graph."""
    spec = dataclasses.replace(PRESETS["synthetic-small"], num_nodes=3000, num_edges=45_000)
    ds = generate(spec, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: extra threads only contend on a shared machine
    try:
        gcn, mlp = kipf_accuracy(ds, use_graph=True), kipf_accuracy(ds, use_graph=False)
    finally:
        torch.set_num_threads(threads)
    assert gcn > 0.6, (gcn, mlp)
    assert mlp > 0.15, (gcn, mlp)  # features alone still say something
    assert gcn > mlp + 0.3, (gcn, mlp)
