import numpy as np
import pytest

from dorylus.config import TrainConfig
from dorylus.masks import keep_mask
from dorylus.models.spec import ModelSpec
from dorylus.normalize import gcn_normalize, row_normalize
from dorylus.partition import assign_parts, open_store, write_store
from graphserver.state import PartitionState, split_intervals
from tests.graphs import random_graph


def test_split_intervals_cover_rows():
    assert split_intervals(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert split_intervals(2, 5) == [(0, 1), (1, 2)]
    assert split_intervals(0, 3) == [(0, 0)]


@pytest.fixture
def states(tmp_path):
    graph = random_graph(num_nodes=50, num_edges=160, num_features=6)
    write_store(graph, assign_parts(50, graph.src, graph.dst, 3, "random", seed=1), tmp_path / "s",
                method="random", seed=1)
    store = open_store(tmp_path / "s")
    config = TrainConfig(hidden=4, input_dropout=0.5)
    spec = ModelSpec.from_config(config, 6, graph.num_classes)
    parts = [PartitionState(store.load_part(i), spec, seed=3, row_normalize_features=True, num_intervals=2)
             for i in range(3)]
    return graph, parts


def dense_adjacency(graph):
    adj = gcn_normalize(graph.src, graph.dst, graph.num_nodes)
    dense = np.zeros((graph.num_nodes, graph.num_nodes))
    dense[adj.rows(), adj.indices] = adj.weights
    return dense


@pytest.mark.parametrize("training", [True, False])
def test_interval_gather_equals_dense_product(states, training):
    graph, parts = states
    a = dense_adjacency(graph)
    x = row_normalize(graph.features).astype(np.float64)
    if training:
        x = x * keep_mask(3, 7, 0, np.arange(graph.num_nodes), x.shape[1], 0.5) * 2
    expected = a @ x
    for s in parts:
        s.X[s.n_owned:] = row_normalize(graph.features)[s.part.ghosts]  # what the startup exchange fills in
        source = s.gather_input(0, epoch=7, training=training)
        for i in range(len(s.intervals)):
            s.gather(0, i, source)
        np.testing.assert_allclose(s.Z[0], expected[s.owned_ids], rtol=1e-5, atol=1e-6)


def test_backward_gather_spreads_to_ghost_rows(states):
    graph, parts = states
    a = dense_adjacency(graph)
    rng = np.random.default_rng(0)
    grad_z = rng.standard_normal((graph.num_nodes, 6)).astype(np.float32)
    total = np.zeros((graph.num_nodes, 6))
    for s in parts:
        s.GZ[0][:] = grad_z[s.owned_ids]
        np.add.at(total, s.global_ids, s.gather_backward(0))  # ghost rows belong to their owners
    np.testing.assert_allclose(total, a.T @ grad_z, rtol=1e-5, atol=1e-6)
