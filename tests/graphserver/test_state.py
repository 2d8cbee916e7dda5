"""PartitionState: the plan's buffers, per-interval Gather, its backward, and the static inputs."""

import dataclasses

import numpy as np
import pytest

from dorylus.config import TrainConfig
from dorylus.models import get_model, kernels
from dorylus.models.base import GATHER, GATHER_BACKWARD, STATIC
from dorylus.models.gcn import build_plan
from dorylus.models.ops import TEST, TRAIN, VAL
from dorylus.models.spec import ModelSpec
from dorylus.normalize import gcn_normalize, row_normalize
from dorylus.partition import assign_parts, open_store, write_store
from graphserver.state import PartitionState, split_intervals
from tests.graphs import random_graph

NUM_NODES, NUM_FEATURES, NUM_CLASSES, NUM_PARTS = 40, 6, 3, 3


# ----------------------------------------------------------------------------- split_intervals


def test_split_intervals_examples():
    assert split_intervals(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert split_intervals(10, 1) == [(0, 10)]
    assert split_intervals(2, 5) == [(0, 1), (1, 2)]
    assert split_intervals(0, 3) == [(0, 0)]
    assert split_intervals(5, 0) == [(0, 5)]


@pytest.mark.parametrize("rows", [*range(0, 25), 97, 1000])
def test_split_intervals_cover_rows_contiguously_and_evenly(rows):
    for count in range(1, 30):
        intervals = split_intervals(rows, count)
        assert len(intervals) == max(1, min(count, rows))
        assert intervals[0][0] == 0 and intervals[-1][1] == rows
        for (_, stop), (start, _) in zip(intervals[:-1], intervals[1:]):
            assert stop == start
        sizes = [b - a for a, b in intervals]
        assert max(sizes) - min(sizes) <= 1
        if rows:
            assert min(sizes) >= 1  # fewer intervals than asked, never an empty one
        assert all(isinstance(a, int) and isinstance(b, int) for a, b in intervals)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def graph():
    return random_graph(num_nodes=NUM_NODES, num_edges=120, num_features=NUM_FEATURES, num_classes=NUM_CLASSES,
                        seed=4)


@pytest.fixture(scope="module")
def store(graph, tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "s"
    parts = assign_parts(NUM_NODES, graph.src, graph.dst, NUM_PARTS, "random", seed=1)
    write_store(graph, parts, path, method="random", seed=1)
    return open_store(path)


@pytest.fixture(scope="module")
def dense_adjacency(graph):
    adj = gcn_normalize(graph.src, graph.dst, graph.num_nodes)
    dense = np.zeros((graph.num_nodes, graph.num_nodes))
    dense[adj.rows(), adj.indices] = adj.weights
    return dense


# hidden 4 < 6 features: every layer projects first (P/Y/dY/dP); hidden 8: layer 0 gathers first
# (H/Z); three layers of 8 -> gather first, then gather first, then project first (8 > 3 classes).
CONFIGS = {
    "project-first": dict(hidden=4, layers=2),
    "mixed": dict(hidden=8, layers=2),
    "three-layers": dict(hidden=8, layers=3),
}


def make_plan(name):
    spec = ModelSpec.from_config(TrainConfig(**CONFIGS[name]), NUM_FEATURES, NUM_CLASSES)
    return build_plan(spec)


def local_dense(part, dense):
    """A_hat restricted to the part's owned rows and [owned; ghost] columns, from the global matrix."""
    return dense[np.ix_(part.owned, part.global_ids())]


# ----------------------------------------------------------------------------- buffers


def test_project_first_buffer_names():
    plan = make_plan("project-first")
    assert plan.ghosted == {"P0", "P1"}
    state_names = {n for s in (*plan.train, *plan.evaluate) for n in (*s.reads, *s.writes)} - set(STATIC)
    # G: the gathered rows before the bias (BIAS makes Y of a hidden layer; LOSS reads G of the last)
    assert state_names == {"P0", "G0", "Y0", "dY0", "dP0", "P1", "G1", "dY1", "dP1"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_buffers_are_exactly_the_plans_names(store, config):
    plan = make_plan(config)
    used = {n for s in (*plan.train, *plan.evaluate) for n in (*s.reads, *s.writes)}
    expected = used - set(STATIC)
    assert expected and expected <= set(plan.widths)
    for i in range(NUM_PARTS):
        part = store.load_part(i)
        state = PartitionState(part, plan, row_normalize_features=True, num_intervals=3)
        assert set(state.buffers) == expected
        assert not set(state.buffers) & set(STATIC)
        assert set(state.static) == set(STATIC)
        ghosted = {s.reads[0] for s in (*plan.train, *plan.evaluate) if s.kind == GATHER}
        assert ghosted == plan.ghosted and ghosted <= expected
        # a backward Gather run as a Gather (symmetric, on this undirected store) reads ghost rows too
        assert part.undirected
        ghosted |= {s.reads[0] for s in plan.train if s.kind == GATHER_BACKWARD and s.symmetric}
        for name, buf in state.buffers.items():
            rows = part.n_local if name in ghosted else part.n_owned
            assert buf.shape == (rows, plan.widths[name]), name
            assert buf.dtype == np.float32 and buf.flags.c_contiguous and buf.flags.writeable
            assert buf.ctypes.data % kernels.CACHE_LINE == 0, name  # rows Gather reads start on a line
            assert not buf.any()
            assert state.rows(name) is buf
        for name in STATIC:
            assert state.rows(name) is state.static[name]
        with pytest.raises(KeyError):
            state.rows("no-such-buffer")


def test_parts_have_ghosts(store):
    # The Gather tests below are only meaningful if ghost columns exist.
    assert all(store.load_part(i).n_ghost > 0 for i in range(NUM_PARTS))


# ----------------------------------------------------------------------------- Gather


def test_local_adjacency_is_the_global_rows(store, dense_adjacency):
    """The partition's local A_hat carries each owned row's every entry (nothing lost to the cut)."""
    for i in range(NUM_PARTS):
        part = store.load_part(i)
        local = local_dense(part, dense_adjacency)
        np.testing.assert_allclose(local.sum(axis=1), dense_adjacency[part.owned].sum(axis=1), rtol=1e-6)
        from_store = np.zeros((part.n_owned, part.n_local))
        rows = np.repeat(np.arange(part.n_owned), np.diff(part.indptr))
        from_store[rows, part.indices] = part.norm[rows].astype(np.float64) * part.norm[part.indices]
        np.testing.assert_allclose(from_store, local, rtol=1e-6, atol=1e-7)


def _gather(state: PartitionState, src: str, dst: str, interval: int) -> None:
    """GCN's GA of one interval, as the graph server runs it."""
    a, b = state.intervals[interval]
    state.buffers[dst][a:b] = state.graph.aggregate("gcn", state.buffers[src], (a, b))


def _gather_backward(state: PartitionState, src: str) -> np.ndarray:
    return state.graph.aggregate_transpose("gcn", state.buffers[src][: state.n_owned])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("num_intervals", [1, 3, 1000])
def test_interval_gather_equals_dense_product(store, dense_adjacency, config, num_intervals):
    plan = make_plan(config)
    rng = np.random.default_rng(7)
    pairs = sorted({(s.reads[0], s.writes[0]) for s in plan.train if s.kind == GATHER})
    assert pairs
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        state = PartitionState(part, plan, row_normalize_features=False, num_intervals=num_intervals)
        assert len(state.intervals) == min(num_intervals, part.n_owned)
        a = local_dense(part, dense_adjacency)
        for src, dst in pairs:
            state.buffers[src][:] = rng.standard_normal(state.buffers[src].shape).astype(np.float32)
            sentinel = np.float32(-12345.0)
            state.buffers[dst][:] = sentinel
            expected = a @ state.buffers[src].astype(np.float64)
            src_before = state.buffers[src].copy()
            for k, (lo, hi) in enumerate(state.intervals):
                _gather(state, src, dst, k)
                out = state.buffers[dst]
                np.testing.assert_allclose(out[lo:hi], expected[lo:hi], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(out[:hi], expected[:hi], rtol=1e-5, atol=1e-5)  # earlier kept
                assert (out[hi:] == sentinel).all(), f"interval {k} wrote rows beyond {hi}"
            np.testing.assert_array_equal(state.buffers[src], src_before)
            assert state.buffers[dst].dtype == np.float32


def test_gather_reads_ghost_rows(store, dense_adjacency):
    """Changing only the ghost rows of the source changes Gather's result by A_local[:, ghosts]."""
    plan = make_plan("project-first")
    part = store.load_part(0)
    state = PartitionState(part, plan, row_normalize_features=False, num_intervals=2)
    a = local_dense(part, dense_adjacency)
    state.buffers["P0"][: part.n_owned] = 0.0
    state.buffers["P0"][part.n_owned:] = 1.0
    for k in range(len(state.intervals)):
        _gather(state, "P0", "Y0", k)
    np.testing.assert_allclose(state.buffers["Y0"][:, 0], a[:, part.n_owned:].sum(axis=1), rtol=1e-5, atol=1e-6)
    assert state.buffers["Y0"].any()


# ----------------------------------------------------------------------------- Gather backward


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gather_backward_equals_dense_transpose(store, dense_adjacency, config):
    plan = make_plan(config)
    rng = np.random.default_rng(11)
    sources = sorted({s.reads[0] for s in plan.train if s.kind == GATHER_BACKWARD})
    assert sources
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        state = PartitionState(part, plan, row_normalize_features=False, num_intervals=3)
        a = local_dense(part, dense_adjacency)
        for src in sources:
            buf = state.buffers[src]
            buf[:] = rng.standard_normal(buf.shape).astype(np.float32)
            before = buf.copy()
            out = _gather_backward(state, src)
            assert out.shape == (part.n_local, plan.widths[src]) and out.dtype == np.float32
            np.testing.assert_allclose(out, a.T @ buf[: part.n_owned].astype(np.float64), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(buf, before)


def test_gather_backward_uses_owned_rows_of_a_ghosted_buffer(store, dense_adjacency):
    plan = make_plan("project-first")
    part = store.load_part(1)
    state = PartitionState(part, plan, row_normalize_features=False, num_intervals=2)
    buf = state.buffers["P0"]  # ghosted: n_local rows; the ghost rows must be ignored
    buf[: part.n_owned] = np.arange(part.n_owned * buf.shape[1], dtype=np.float32).reshape(part.n_owned, -1)
    buf[part.n_owned:] = 1e6
    a = local_dense(part, dense_adjacency)
    np.testing.assert_allclose(_gather_backward(state, "P0"), a.T @ buf[: part.n_owned], rtol=1e-5, atol=1e-4)


def test_gather_backward_sums_to_the_global_transpose(store, dense_adjacency):
    """Each part's ghost-row contributions, summed at their owners, give A_hat^T · G globally."""
    plan = make_plan("project-first")
    grad = np.random.default_rng(3).standard_normal((NUM_NODES, plan.widths["dY0"])).astype(np.float32)
    total = np.zeros(grad.shape)
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        state = PartitionState(part, plan, row_normalize_features=False, num_intervals=2)
        state.buffers["dY0"][: part.n_owned] = grad[part.owned]
        np.add.at(total, part.global_ids(), _gather_backward(state, "dY0"))
    np.testing.assert_allclose(total, dense_adjacency.T @ grad, rtol=1e-5, atol=1e-5)


def _spec(model: str) -> ModelSpec:
    return ModelSpec.from_config(TrainConfig(model=model, hidden=8, layers=2), NUM_FEATURES, NUM_CLASSES)


@pytest.mark.parametrize("model", ["gcn", "gin"])
def test_a_pulled_backward_gather_is_the_global_transpose_on_owned_rows(store, model):
    """A symmetric backward Gather on an undirected part: with its input's ghost rows filled as
    the Scatter fills them (the owners' rows), ``gather`` of each interval gives ``M^T · g`` on
    the owned rows, against the dense global matrix (float64) as the oracle."""
    module = get_model(model)
    plan = module.build_plan(_spec(model))
    stages = [s for s in plan.train if s.kind == GATHER_BACKWARD]
    assert stages and all(s.symmetric for s in stages)
    full = store.load_part(0)
    n = store.meta.num_nodes
    m = np.zeros((n, n))  # M: A_hat (gcn) or A + I (gin), from the parts' own rows
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        ids = part.global_ids()
        for r in range(part.n_owned):
            cols = part.indices[part.indptr[r]:part.indptr[r + 1]]
            m[ids[r], ids[cols]] = part.norm[r] * part.norm[cols] if model == "gcn" else 1.0
    assert full.undirected and np.array_equal(m, m.T)
    rng = np.random.default_rng(11)
    for stage in stages:
        name, out = stage.reads[0], stage.writes[0]
        grad = rng.standard_normal((n, plan.widths[name])).astype(np.float32)
        expected = m.T @ grad.astype(np.float64)
        for p in range(NUM_PARTS):
            part = store.load_part(p)
            state = PartitionState(part, plan, row_normalize_features=False, num_intervals=3)
            assert state.pulls(stage)
            state.buffers[name][:] = grad[part.global_ids()]  # owned rows, and ghost rows as Scatter fills them
            for i in range(len(state.intervals)):
                state.gather(module, stage, i, {})
            np.testing.assert_allclose(state.buffers[out], expected[part.owned], rtol=1e-5, atol=1e-5)


def test_only_symmetric_backward_gathers_on_undirected_parts_are_pulled(store):
    part = store.load_part(0)
    for model, pulled in (("gcn", True), ("gin", True), ("sage", False), ("gat", False)):
        plan = get_model(model).build_plan(_spec(model))
        stages = [s for s in plan.train if s.kind == GATHER_BACKWARD]
        state = PartitionState(part, plan, row_normalize_features=False, num_intervals=2)
        assert [state.pulls(s) for s in stages] == [pulled] * len(stages), model
        directed = PartitionState(dataclasses.replace(part, undirected=False), plan, row_normalize_features=False,
                                  num_intervals=2)
        assert not any(directed.pulls(s) for s in stages)
        for s in stages:  # the push path's input holds the owned rows only
            assert directed.buffers[s.reads[0]].shape[0] == (part.n_local if s.reads[0] in plan.ghosted
                                                             else part.n_owned)


# ----------------------------------------------------------------------------- static inputs


@pytest.mark.parametrize("normalize", [True, False])
def test_static_inputs(store, graph, normalize):
    plan = make_plan("mixed")
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        state = PartitionState(part, plan, row_normalize_features=normalize, num_intervals=2)
        x = state.static["X"]
        assert x.shape == (part.n_owned, NUM_FEATURES) and x.dtype == np.float32
        features = graph.features[part.owned]
        np.testing.assert_allclose(x, row_normalize(features) if normalize else features, rtol=1e-6)
        if normalize:
            sums = x.sum(axis=1)
            np.testing.assert_allclose(sums[np.abs(features.sum(axis=1)) > 1e-6], 1.0, rtol=1e-4)
        ids = state.static["ids"]
        np.testing.assert_array_equal(ids, part.owned)
        np.testing.assert_array_equal(ids, state.global_ids[: part.n_owned])
        assert ids.shape == (part.n_owned,)
        labels = state.static["labels"]
        assert labels.dtype == np.int64
        np.testing.assert_array_equal(labels, graph.labels[part.owned])
        split = state.static["split"]
        assert split.dtype == np.uint8 and split.shape == (part.n_owned,)
        np.testing.assert_array_equal((split & TRAIN) != 0, graph.train_mask[part.owned])
        np.testing.assert_array_equal((split & VAL) != 0, graph.val_mask[part.owned])
        np.testing.assert_array_equal((split & TEST) != 0, graph.test_mask[part.owned])
        assert not (split & ~np.uint8(TRAIN | VAL | TEST)).any()
        for name in STATIC:
            assert state.static[name].flags.c_contiguous
        # One copy of the features per process: normalized rows replace the store's memory map.
        assert state.part.features is x or np.shares_memory(state.part.features, x)
        if normalize:
            assert not isinstance(state.part.features, np.memmap)
        else:
            assert np.shares_memory(x, part.features)  # the store's rows, not a copy


def test_global_ids_are_owned_then_ghosts(store):
    part = store.load_part(2)
    state = PartitionState(part, make_plan("mixed"), row_normalize_features=True, num_intervals=4)
    np.testing.assert_array_equal(state.global_ids, np.concatenate([part.owned, part.ghosts]))
    assert state.n_owned == part.n_owned


def test_mean_aggregation_averages_over_whole_graph_in_neighbours(store, graph):
    """SAGE's mean on a partition: every owned row's in-neighbours (some of them ghosts) count,
    the self loop does not, so each row equals the global graph's row."""
    adj = gcn_normalize(graph.src, graph.dst, graph.num_nodes)
    mean = np.zeros((graph.num_nodes, graph.num_nodes))
    for v in range(graph.num_nodes):
        neighbours = [u for u in adj.indices[adj.indptr[v]:adj.indptr[v + 1]] if u != v]
        mean[v, neighbours] = 1.0 / len(neighbours) if neighbours else 0.0
    rng = np.random.default_rng(5)
    plan = make_plan("project-first")
    for p in range(NUM_PARTS):
        part = store.load_part(p)
        state = PartitionState(part, plan, row_normalize_features=False, num_intervals=2)
        a = local_dense(part, mean)
        assert part.n_ghost > 0 and np.abs(a[:, part.n_owned:]).sum() > 0
        x = rng.standard_normal((part.n_local, 3)).astype(np.float32)
        np.testing.assert_allclose(state.graph.aggregate("mean", x), a @ x, rtol=1e-5, atol=1e-6)
        lo, hi = state.intervals[1]
        np.testing.assert_allclose(state.graph.aggregate("mean", x, (lo, hi)), (a @ x)[lo:hi], rtol=1e-5, atol=1e-6)
        g = rng.standard_normal((part.n_owned, 3)).astype(np.float32)
        np.testing.assert_allclose(state.graph.aggregate_transpose("mean", g), a.T @ g, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sparse features


@pytest.mark.parametrize("store_mode", ["on", "off"])
@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_static_features_in_the_configured_layout(tmp_path, store_mode, mode):
    """Whatever layout the store has, X is SparseRows when sparse_features picks it (auto: these
    features are ~20% non-zero, so dense), with the dense path's row-normalized values, bitwise."""
    from dorylus.models.sparse import SparseRows

    sparse_graph = random_graph(num_nodes=NUM_NODES, num_edges=120, num_features=NUM_FEATURES,
                                num_classes=NUM_CLASSES, seed=4)
    keep = np.random.default_rng(8).random(sparse_graph.features.shape) < 0.2
    sparse_graph.features = np.where(keep, np.abs(sparse_graph.features), 0).astype(np.float32)
    parts = assign_parts(NUM_NODES, sparse_graph.src, sparse_graph.dst, 2, "random", seed=1)
    write_store(sparse_graph, parts, tmp_path / "s", method="random", seed=1, sparse_features=store_mode)
    store = open_store(tmp_path / "s")
    plan = make_plan("project-first")
    for p in range(2):
        part = store.load_part(p)
        assert isinstance(part.features, SparseRows) == (store_mode == "on")
        for normalize in (True, False):
            state = PartitionState(part, plan, row_normalize_features=normalize, num_intervals=2,
                                   sparse_features=mode)
            x = state.static["X"]
            assert isinstance(x, SparseRows) == (mode == "on")
            features = sparse_graph.features[part.owned]
            want = row_normalize(features) if normalize else features
            np.testing.assert_array_equal(x.toarray() if isinstance(x, SparseRows) else x, want)
            a, b = state.intervals[1]  # what the cpu backend and a PULL read
            rows = state.rows("X")[a:b]
            np.testing.assert_array_equal(rows.toarray() if isinstance(rows, SparseRows) else rows, want[a:b])


@pytest.mark.parametrize("normalize", [True, False])
def test_features_left_in_the_store_read_as_the_resident_ones(store, normalize):
    """``features_stored`` (the lambda backend): X holds no rows, and every row range a PULL or
    the fallback reads equals the resident state's, bitwise (the same per-row normalization)."""
    from graphserver.state import StoredRows

    plan = make_plan("project-first")
    for p in range(NUM_PARTS):
        resident = PartitionState(store.load_part(p), plan, row_normalize_features=normalize, num_intervals=3)
        stored = PartitionState(store.load_part(p), plan, row_normalize_features=normalize, num_intervals=3,
                                features_stored=True)
        assert isinstance(stored.static["X"], StoredRows) and stored.static["X"].shape == resident.static["X"].shape
        assert stored.memory["bytes"]["features"] == 0 < resident.memory["bytes"]["features"]
        for interval in range(3):
            a, b = stored.intervals[interval]
            rows = stored.interval_rows("X", interval)
            assert rows.dtype == np.float32 and rows.flags.c_contiguous and not isinstance(rows, np.memmap)
            np.testing.assert_array_equal(rows, resident.interval_rows("X", interval))
            np.testing.assert_array_equal(stored.host_rows("X", a, b), resident.host_rows("X", a, b))
        np.testing.assert_array_equal(stored.rows("X")[1:], resident.rows("X")[1:])
        assert stored.rows("X")[5:2].shape == (0, NUM_FEATURES)
        with pytest.raises(TypeError, match="contiguous row ranges"):
            stored.rows("X")[np.array([0, 2])]


def test_features_stay_resident_when_sparse_or_not_memory_mapped(store):
    """``features_stored`` keeps the layout sparse_features asks for, and a part loaded into memory
    (not a memory map) as it is."""
    from dorylus.models.sparse import SparseRows

    plan = make_plan("project-first")
    sparse = PartitionState(store.load_part(0), plan, row_normalize_features=True, num_intervals=2,
                            sparse_features="on", features_stored=True)
    assert isinstance(sparse.static["X"], SparseRows)
    loaded = PartitionState(store.load_part(0, mmap=False), plan, row_normalize_features=True, num_intervals=2,
                            features_stored=True)
    assert isinstance(loaded.static["X"], np.ndarray) and loaded.memory["bytes"]["features"] > 0


# ----------------------------------------------------------------------------- lean state


def test_indices_are_memory_mapped_not_copied(store):
    """The graph keeps the store's int32 indices as they are mapped: one copy, the page cache's."""
    plan = make_plan("mixed")
    part = store.load_part(1)
    state = PartitionState(part, plan, row_normalize_features=True, num_intervals=2)
    assert part.indices.dtype == np.int32 and isinstance(part.indices, np.memmap)
    assert state.graph.indices is part.indices
    assert np.shares_memory(state.graph.col_norm, part.norm) and np.shares_memory(state.graph.row_norm, part.norm)
    x = np.random.default_rng(0).standard_normal((part.n_local, 3)).astype(np.float32)
    state.graph.aggregate("gcn", x, state.intervals[1])
    state.graph.aggregate_transpose("gcn", x[:part.n_owned])
    assert state.graph.indices is part.indices  # the products did not swap in a copy
    assert state.graph.memory()["values"] == 0  # no per-entry float on the host path


def test_gather_of_kinds_equals_dense_oracle(store, graph, dense_adjacency):
    """gcn and mean from per-vertex scales only, forward and transposed, against float64 oracles."""
    rng = np.random.default_rng(3)
    adj = gcn_normalize(graph.src, graph.dst, graph.num_nodes)
    pattern = np.zeros((graph.num_nodes, graph.num_nodes))
    pattern[adj.rows(), adj.indices] = 1.0
    np.fill_diagonal(pattern, 0.0)
    mean = pattern / np.maximum(pattern.sum(axis=1, keepdims=True), 1)
    for i in range(NUM_PARTS):
        part = store.load_part(i)
        state = PartitionState(part, make_plan("mixed"), row_normalize_features=True, num_intervals=2)
        x = rng.standard_normal((part.n_local, 4)).astype(np.float32)
        g = rng.standard_normal((part.n_owned, 4)).astype(np.float32)
        for kind, dense in (("gcn", dense_adjacency), ("mean", mean)):
            local = local_dense(part, dense)
            got = np.concatenate([state.graph.aggregate(kind, x, rows) for rows in state.intervals])
            np.testing.assert_allclose(got, local @ x, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state.graph.aggregate_transpose(kind, g), local.T @ g, rtol=1e-5, atol=1e-6)


def test_bytes_per_edge_of_a_hand_built_part():
    """A part of 3 owned vertices and 2 ghosts, 8 entries (3 self loops), 2 features."""
    from dorylus.partition import Partition
    from graphserver.state import format_memory, memory_figures

    indptr = np.array([0, 3, 5, 8])
    indices = np.array([0, 1, 3, 0, 1, 2, 3, 4], dtype=np.int32)
    part = Partition(part_id=0, num_parts=2, owned=np.array([5, 2, 7]), ghosts=np.array([1, 9]),
                     ghost_offsets=np.array([0, 0, 2]), indptr=indptr, indices=indices,
                     norm=np.full(5, 0.5, np.float32), features=np.zeros((3, 2), np.float32),
                     labels=np.zeros(3, np.int64), train_mask=np.ones(3, bool), val_mask=np.zeros(3, bool),
                     test_mask=np.zeros(3, bool), send_indices=np.array([0, 2]), send_offsets=np.array([0, 0, 2]))
    buffers = {"H": np.zeros((5, 4), np.float32), "Y": np.zeros((3, 4), np.float32)}
    fig = memory_figures(part, buffers=buffers)
    assert fig["bytes"] == {"indices": 32, "indptr": 32, "norm": 20, "global_ids": 40,
                            "features": 24, "labels_masks": 24 + 9, "exchange": 16 + 16 + 24 + 24,
                            "buffers": 80 + 48, "ghost_rows": 32}
    assert fig["per_edge"]["indices"] == 4.0
    assert fig["per_vertex"]["norm"] == 20 / 3
    assert fig["total_bytes"] == sum(v for k, v in fig["bytes"].items() if k != "ghost_rows")
    assert fig["total_per_edge"] == fig["total_bytes"] / 8
    assert "B per entry" in format_memory(fig)


def test_a_pull_of_sums_answers_one_row_per_summed_name():
    """A function's PULL with ``meta["sums"]`` (a stage's ``summed`` reads, the bias gradient's
    dY) gets the float32 sum of the interval's rows of those names, one row each, and the rows of
    the others; the ROWS reply says which are sums, and decodes with one row for them."""
    from types import SimpleNamespace

    from dorylus import protocol
    from dorylus.protocol import Header, Op
    from graphserver.server import GraphServer

    rng = np.random.default_rng(3)
    buffers = {"dP0": rng.standard_normal((9, 4)).astype(np.float32),
               "dY0": rng.standard_normal((9, 4)).astype(np.float32)}
    state = SimpleNamespace(static={}, buffers=buffers, host_rows=lambda name, a, b: buffers[name][a:b])
    fake = SimpleNamespace(state=state)
    pull = Header(Op.PULL, task="AV_BWD", epoch=1, layer=0, interval=1, rows=(3, 8), names=("dP0", "dY0"),
                  meta={"sums": "dY0"})
    rows = GraphServer._read_rows(fake, pull)
    np.testing.assert_array_equal(rows[0], buffers["dP0"][3:8])
    assert rows[1].shape == (1, 4) and rows[1].dtype == np.float32
    np.testing.assert_allclose(rows[1][0], buffers["dY0"][3:8].astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
    header, tensors = protocol.decode(protocol.encode(*protocol.rows_reply(pull, rows)))
    assert header.meta["sums"] == "dY0" and [t.shape for t in tensors] == [(5, 4), (1, 4)]
    with pytest.raises(protocol.ProtocolError, match="row_count"):  # a sum must be one row
        protocol.decode(protocol.encode(protocol.reply_to(pull, Op.ROWS, meta={"sums": "dY0"}),
                                        [rows[0], buffers["dY0"][3:8]]))
