"""The planner's graph-server memory against what a graph server really holds.

Oracle: ``tracemalloc``'s count of the bytes a :class:`graphserver.state.PartitionState` keeps
allocated (numpy reports its buffers to it) after one forward and one backward Gather, for a
part of a generated graph written as a format-3 store and loaded into memory (a graph server maps
the store's files instead; mapped pages are resident once read, but no allocator counts them). The planner sees only the part's counts (:func:`store_shape`'s figures).
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import replace

import pytest

from dorylus.config import TrainConfig
from dorylus.data.synthetic import SyntheticSpec, generate
from dorylus.models import get_model
from dorylus.models.spec import ModelSpec
from dorylus.partition import assign_parts, open_store, write_store
from dorylus.plan.model import Setup, Shape, graph_bytes, server_memory, server_memory_bytes
from graphserver.state import PartitionState

INTERVALS, HIDDEN = 2, 16
WITHIN = 0.20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    data = generate(SyntheticSpec(num_nodes=8_000, num_edges=160_000, num_features=32, num_classes=4,
                                  name="plan-memory"), seed=0)
    parts = assign_parts(data.num_nodes, data.src, data.dst, 2, "random", seed=0)
    path = tmp_path_factory.mktemp("plan-memory") / "store"
    write_store(data, parts, path, method="random", seed=0, sparse_features="off", vertex_order="none")
    return open_store(path)


def held_bytes(store, part_id: int, plan) -> tuple[int, PartitionState]:
    """Bytes allocated and still held once the part's state has gathered forward and backward."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state = PartitionState(store.load_part(part_id, mmap=False), plan, row_normalize_features=True,
                               num_intervals=INTERVALS, sparse_features="off")
        model = get_model("gcn")
        forward = next(s for s in plan.train if s.kind == "gather")
        backward = next(s for s in plan.train if s.kind == "gather_backward")
        for interval in range(len(state.intervals)):
            state.gather(model, forward, interval, {})
        state.gather_backward(model, backward, {})  # its result is a temporary
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, state
    finally:
        tracemalloc.stop()


def part_shape(store, part_id: int) -> Shape:
    part = store.load_part(part_id, mmap=True)
    meta = store.meta
    return Shape(vertices=meta.num_nodes, parts=store.num_parts, owned=part.n_owned, nnz=part.nnz,
                 ghosts=part.n_ghost, send=int(part.send_offsets[-1]), features=meta.num_features,
                 classes=meta.num_classes)


def test_server_memory_is_within_20_percent_of_a_graph_servers_allocations(store, monkeypatch):
    # the kernels a graph server at scale runs (its backward Gather holds no transpose); this
    # small part's products would otherwise run on torch, over a transpose (4 B per entry)
    monkeypatch.setenv("DORYLUS_GATHER_KERNEL", "numba")
    spec = ModelSpec.from_config(TrainConfig(model="gcn", hidden=HIDDEN), store.meta.num_features,
                                 store.meta.num_classes)
    plan = get_model("gcn").build_plan(spec)
    held_bytes(store, 1, plan)  # the first state imports the kernels and warms their caches
    measured, state = held_bytes(store, 0, plan)

    shape = part_shape(store, 0)
    setup = Setup(backend="cpu", graph_server="c5.2xlarge", parts=shape.parts, intervals=INTERVALS,
                  functions=INTERVALS, hidden=HIDDEN)
    predicted = server_memory_bytes(shape, setup)
    assert predicted == pytest.approx(measured, rel=WITHIN), server_memory(shape, setup)

    # The graph structures alone (what bytes per entry and per vertex size), against the
    # allocations less the state's own feature and buffer arrays.
    rows = state.static["X"].nbytes + sum(b.nbytes for b in state.buffers.values())
    per_entry, per_vertex = graph_bytes(shape, setup)
    structures = per_entry * shape.nnz + per_vertex * shape.owned
    assert structures == pytest.approx(measured - rows, rel=WITHIN)
    assert per_entry == 4  # the int32 column id: no per-entry weight in format 3, no transpose on the host


def test_a_lambda_graph_server_holds_no_features(store):
    """The lambda backend leaves dense features in the store (graphserver.state.StoredRows): the
    planner counts none for its servers, and the state measures none."""
    shape = part_shape(store, 0)
    cpu = Setup(backend="cpu", graph_server="c5.2xlarge", parts=shape.parts, intervals=INTERVALS,
                functions=INTERVALS, hidden=HIDDEN)
    on_cpu, on_lambda = server_memory(shape, cpu), server_memory(shape, replace(cpu, backend="lambda"))
    assert on_cpu["features"] == 4 * shape.owned * shape.features > 0 and on_lambda["features"] == 0
    assert {k: v for k, v in on_lambda.items() if k != "features"} == {k: v for k, v in on_cpu.items()
                                                                        if k != "features"}
    spec = ModelSpec.from_config(TrainConfig(model="gcn", hidden=HIDDEN), store.meta.num_features,
                                 store.meta.num_classes)
    from graphserver.backends import make_state

    state = make_state(TrainConfig(backend="lambda", intervals=INTERVALS, sparse_features="off"), store.load_part(0),
                       get_model("gcn").build_plan(spec), parts=shape.parts)
    assert state.memory["bytes"]["features"] == 0


def test_gpu_memory_counts_values_per_entry_on_the_device():
    shape = Shape(vertices=1000, parts=1, owned=1000, nnz=20_000, ghosts=0, send=0, features=8, classes=2)
    gpu = Setup(backend="gpu", graph_server="p3.2xlarge", parts=1, intervals=1, functions=1, hidden=8)
    per_entry, _ = graph_bytes(shape, gpu)
    assert per_entry == 16  # (int32 column + float32 value) for A_hat and for its transpose
