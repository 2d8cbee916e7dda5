"""The gpu backend's partition state (graphserver.backends.gpu_device.DeviceState) against the host
state every other backend uses: the same Gather and Gather backward (each model's torch twin on
the device), the same ghost rows in and out, and the device chosen and budgeted as configured.

Runs on torch's CPU device; the CUDA cases are skipped without CUDA. Tolerances: Gather sums at
most a few dozen float32 products per row in another order than the host kernel (GAT: the same
kernels), so rtol/atol 1e-5 (see tests/models/test_torch_ops.py); row copies and the backward
Scatter's additions are one float32 operation per element on both sides: equal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

import warnings

import numpy as np
import pytest
import torch

from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from dorylus.models import MODELS as REGISTERED_MODELS, get_model
from dorylus.models.base import GATHER, GATHER_BACKWARD
from dorylus.models.spec import ModelSpec
from dorylus.partition import assign_parts, open_store, write_store
from graphserver.backends import make_state
from graphserver.backends.gpu_device import DeviceState, open_device
from graphserver.state import PartitionState
from tests.graphs import random_graph

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]
NUM_NODES, NUM_FEATURES, NUM_CLASSES, NUM_PARTS = 60, 7, 3, 3
# Every registered model, small; GAT with 2 heads of 3 and attention dropout (its edge masks).
MODEL_OPTIONS = {"gat": dict(hidden=3, heads=2, attention_dropout=0.3)}
MODELS = {name: dict(model=name, **MODEL_OPTIONS.get(name, dict(hidden=4))) for name in REGISTERED_MODELS}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    graph = random_graph(num_nodes=NUM_NODES, num_edges=240, num_features=NUM_FEATURES, num_classes=NUM_CLASSES,
                         seed=5)
    path = tmp_path_factory.mktemp("store") / "s"
    write_store(graph, assign_parts(NUM_NODES, graph.src, graph.dst, NUM_PARTS, "random", seed=2), path,
                method="random", seed=2)
    return open_store(path)


def _states(store, part_id: int, config: TrainConfig, device: str):
    spec = ModelSpec.from_config(config, NUM_FEATURES, NUM_CLASSES)
    plan = get_model(config.model).build_plan(spec)
    part = store.load_part(part_id)
    host = PartitionState(part, plan, row_normalize_features=True, num_intervals=3)
    on_device = DeviceState(part, plan, device=torch.device(device), row_normalize_features=True, num_intervals=3)
    rng = np.random.default_rng(part_id)
    for name, buffer in host.buffers.items():  # the same random rows in both
        buffer[:] = rng.standard_normal(buffer.shape).astype(np.float32)
        on_device.buffers[name].copy_(torch.from_numpy(buffer))
    return plan, host, on_device


def _args(stage):
    return {**dict(stage.args), "seed": 1, "epoch": 4, "training": True, "train_count": 20}


def _close(got: torch.Tensor, want: np.ndarray) -> None:
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_device_state_gathers_as_the_host_state(store, model_name, device):
    config = TrainConfig(**MODELS[model_name])
    model = get_model(config.model)
    for part_id in range(NUM_PARTS):
        plan, host, on_device = _states(store, part_id, config, device)
        assert set(on_device.buffers) == set(host.buffers)
        for name, buffer in on_device.buffers.items():
            assert buffer.device.type == device and tuple(buffer.shape) == host.buffers[name].shape
        np.testing.assert_array_equal(on_device.static["X"].cpu().numpy(), host.static["X"])
        for name in ("ids", "labels", "split"):
            np.testing.assert_array_equal(on_device.static[name].cpu().numpy(), host.static[name])
        for stage in plan.train:
            if stage.kind == GATHER:
                for interval in range(len(host.intervals)):
                    host.gather(model, stage, interval, _args(stage))
                    on_device.gather(model, stage, interval, _args(stage))
                for name in stage.writes:
                    _close(on_device.buffers[name], host.buffers[name])
            elif stage.kind == GATHER_BACKWARD:
                want = host.gather_backward(model, stage, _args(stage))
                got = on_device.gather_backward(model, stage, _args(stage))
                assert len(got) == len(want) == len(stage.writes)
                for g, w in zip(got, want):
                    assert g.device.type == device
                    _close(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_device_state_moves_ghost_rows_as_the_host_state(store, device):
    config = TrainConfig(hidden=4)
    for part_id in range(NUM_PARTS):
        plan, host, on_device = _states(store, part_id, config, device)
        name = sorted(plan.ghosted)[0]
        owned_only = next(n for n in sorted(host.buffers) if n not in plan.ghosted)
        rng = np.random.default_rng(10 + part_id)
        contribution = rng.standard_normal(host.buffers[name].shape).astype(np.float32)
        peers = [j for j in range(NUM_PARTS) if j != part_id]
        sent = asyncio.run(on_device.rows_for_peers(name, peers))
        want = asyncio.run(host.rows_for_peers(name, peers))
        returned = asyncio.run(on_device.contributions_for_peers(torch.from_numpy(contribution).to(device), peers))
        assert sorted(sent) == sorted(returned) == peers
        for peer in peers:
            assert isinstance(sent[peer], np.ndarray) and isinstance(returned[peer], np.ndarray)
            np.testing.assert_array_equal(sent[peer], want[peer])
            np.testing.assert_array_equal(returned[peer], contribution[host.part.ghost_rows(peer)])
            ghosts = rng.standard_normal(returned[peer].shape).astype(np.float32)
            host.set_ghost_rows(name, peer, ghosts)
            on_device.set_ghost_rows(name, peer, ghosts)
        np.testing.assert_array_equal(on_device.buffers[name].cpu().numpy(), host.buffers[name])
        np.testing.assert_array_equal(on_device.host_rows(name, 1, 5), host.host_rows(name, 1, 5))

        host.set_owned_rows(owned_only, contribution)
        on_device.set_owned_rows(owned_only, torch.from_numpy(contribution).to(device))
        for peer in (j for j in range(NUM_PARTS) if j != part_id):
            returned = rng.standard_normal((len(host.part.send_rows(peer)), contribution.shape[1])).astype(np.float32)
            host.add_peer_contribution(owned_only, peer, returned)
            on_device.add_peer_contribution(owned_only, peer, returned)
        np.testing.assert_array_equal(on_device.buffers[owned_only].cpu().numpy(), host.buffers[owned_only])


def test_make_state_places_the_gpu_backend_on_its_device(store, caplog):
    caplog.set_level("INFO", logger="graphserver.backends.gpu_device")
    spec_config = dict(hidden=4)
    plan = get_model("gcn").build_plan(ModelSpec.from_config(TrainConfig(**spec_config), NUM_FEATURES, NUM_CLASSES))
    part = store.load_part(0)
    assert type(make_state(TrainConfig(backend="cpu", **spec_config), part, plan, parts=3)) is PartitionState
    state = make_state(TrainConfig(backend="gpu", device="cpu", **spec_config), part, plan, parts=3)
    assert isinstance(state, DeviceState) and state.device == torch.device("cpu")
    assert "device cpu" in caplog.text


def test_open_device_on_cpu_leaves_cuda_alone(monkeypatch):
    def refuse(*args):
        raise AssertionError("a memory budget was set for a CPU device")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refuse)
    assert open_device(TrainConfig(backend="gpu", device="cpu"), parts=4) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_asked_without_cuda_is_a_config_error(device):
    """Refused by the machine check before a local run writes anything, and by a graph server
    before it builds a state (its machine may not be the coordinator's)."""
    config = TrainConfig(backend="gpu", device=device)
    with pytest.raises(ConfigError, match=r"--device.*CUDA is not available"):
        config.check_machine()
    with pytest.raises(ConfigError, match=r"--device.*CUDA is not available"):
        make_state(config, None, None, parts=1)


@pytest.mark.parametrize("device", ["tpu", "cuda:", "CUDA", "cuda:x", "gpu"])
def test_unknown_device_is_a_config_error(device):
    with pytest.raises(ConfigError, match=r"--device"):
        TrainConfig(backend="gpu", device=device)


@CUDA
@pytest.mark.parametrize("fraction, parts", [(None, 4), (None, 1), (0.5, 4)])
def test_open_device_sets_the_memory_budget_and_tf32(monkeypatch, restore_tf32, fraction, parts):
    from graphserver.backends.gpu_device import memory_fraction

    budgets = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: budgets.append((f, index)))
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    device = open_device(TrainConfig(backend="gpu", device="cuda", gpu_memory_fraction=fraction), parts=parts)
    assert device.type == "cuda" and device.index is not None and torch.cuda.current_device() == device.index
    total = torch.cuda.get_device_properties(device).total_memory
    assert budgets == [(memory_fraction(fraction, parts, total), device.index)]
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and torch.backends.cudnn.conv.fp32_precision == "ieee"
    open_device(TrainConfig(backend="gpu", device="cuda", allow_tf32=True), parts=parts)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


# ---------------------------------------------------------------------------------------------
# The CUDA paths of DeviceState, run on torch's CPU device through a recording stand-in for
# graphserver.backends.gpu_device.CudaRuntime: which copies are pinned, non-blocking and on the copy
# stream, what each stage waits for, and from which threads CUDA is touched.


class _FakeEvent:
    def __init__(self, cuda, stream):
        self.cuda, self.stream = cuda, stream

    def synchronize(self):
        self.cuda.check_thread("event.synchronize")
        self.cuda.waits.append(self.stream.name)


class _FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name
        self.waited_for: list[str] = []

    def wait_event(self, event):
        self.cuda.check_thread("stream.wait_event")
        self.waited_for.append(event.stream.name)

    def wait_stream(self, stream):  # a whole-stream dependency: what the fixed code no longer uses
        raise AssertionError(f"{self.name} stream waited for the whole {stream.name} stream")

    def synchronize(self):
        raise AssertionError(f"the host drained the {self.name} stream")


class FakeCuda:
    """graphserver.backends.gpu_device.CudaRuntime's interface over CPU tensors, recording what the
    state asks of it; every call checks that its thread made the device current first."""

    def __init__(self):
        self.copy_stream = _FakeStream(self, "copy")
        self.compute = _FakeStream(self, "compute")
        self.current = self.compute
        self.bound: set[int] = set()
        self.used_by: set[int] = set()
        self.pinned_ptrs: set[int] = set()
        self.waits: list[str] = []      # event.synchronize() calls, by the event's stream
        self.events: list[str] = []     # events recorded, by stream
        self.kept: list[str] = []

    def check_thread(self, what):
        ident = threading.get_ident()
        assert ident in self.bound, f"{what} from a thread whose CUDA device was never set"
        self.used_by.add(ident)

    def bind_thread(self):
        self.bound.add(threading.get_ident())

    def compute_stream(self):
        self.check_thread("current_stream")
        return self.compute

    @contextlib.contextmanager
    def on(self, stream):
        self.check_thread("torch.cuda.stream")
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def event(self, stream):
        self.check_thread("Event.record")
        self.events.append(stream.name)
        return _FakeEvent(self, stream)

    def pinned(self, shape, dtype):
        self.check_thread("pin_memory")
        tensor = torch.empty(shape, dtype=dtype)
        self.pinned_ptrs.add(tensor.data_ptr())
        return tensor

    def keep_for(self, tensor, stream):
        self.check_thread("record_stream")
        self.kept.append(stream.name)


class _Copies:
    """Tensor.to / Tensor.copy_ calls made while the fake's copy stream is current."""

    def __init__(self, monkeypatch, cuda: FakeCuda):
        self.calls: list[dict] = []
        to, copy_ = torch.Tensor.to, torch.Tensor.copy_

        def record(kind, src, dst, non_blocking):
            if cuda.current is cuda.copy_stream:
                self.calls.append({"kind": kind, "non_blocking": non_blocking, "pinned_src":
                                   src.data_ptr() in cuda.pinned_ptrs, "pinned_dst": dst is not None and
                                   dst.data_ptr() in cuda.pinned_ptrs})

        def fake_to(self_, *args, **kwargs):
            record("to", self_, None, kwargs.get("non_blocking", False))
            return to(self_, *args, **kwargs)

        def fake_copy(self_, src, non_blocking=False):
            record("copy_", src, self_, non_blocking)
            return copy_(self_, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.Tensor, "to", fake_to)
        monkeypatch.setattr(torch.Tensor, "copy_", fake_copy)


@pytest.fixture
def no_host_reads(monkeypatch):
    """Fails on any read of a tensor's value into Python (each is a device synchronization on
    CUDA): .item(), int(), float(), bool(), .tolist()."""
    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a device value on the host")
        return read

    for name in ("item", "__int__", "__float__", "__bool__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def _fake_cuda_state(store, config, part_id=0):
    """A cpu DeviceState whose CUDA paths run on the fake, bound to this thread as open_device
    would have, and the host state beside it (the same rows)."""
    plan, host, state = _states(store, part_id, config, "cpu")
    state.cuda = FakeCuda()
    state.cuda.bind_thread()
    return plan, host, state


def _stage(plan, task, layer):
    return next(s for s in plan.train if s.task == task and s.layer == layer)


def _run_stage(state, model, stage, interval, params, args):
    a, b = state.intervals[interval]
    rows = [state.rows(name)[a:b] for name in stage.reads]
    return state.compute(model, stage.task, stage.layer, rows, params, args)


def _params(config, layer):
    spec = ModelSpec.from_config(config, NUM_FEATURES, NUM_CLASSES)
    return spec.init_params(seed=3)[layer]


def test_a_stage_uploads_its_parameters_pinned_non_blocking_on_the_copy_stream(store, monkeypatch, no_host_reads):
    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _fake_cuda_state(store, config)
    copies = _Copies(monkeypatch, state.cuda)
    stage, params = _stage(plan, "AV", 1), _params(config, 1)
    args = _args(stage)
    got = _run_stage(state, model, stage, 0, params, args)
    # one copy of all the layer's parameters (weight and bias), from pinned memory, not waited for
    assert copies.calls == [{"kind": "to", "non_blocking": True, "pinned_src": True, "pinned_dst": False}]
    assert state.cuda.compute.waited_for == ["copy"] and state.cuda.kept == ["compute"]
    assert state.cuda.waits == []  # a stage without gradients or scalars never waits
    a, b = host.intervals[0]
    want = model.compute(stage.task, stage.layer, [host.rows(n)[a:b] for n in stage.reads], params, args)
    _close(got.rows[0], want.rows[0])


def test_gradients_and_loss_come_back_in_one_event_ordered_copy(store, monkeypatch, no_host_reads):
    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _fake_cuda_state(store, config)
    copies = _Copies(monkeypatch, state.cuda)
    for task, layer in (("LOSS", 1), ("AV_BWD", 1)):
        stage, params = _stage(plan, task, layer), _params(config, layer)
        args = _args(stage)
        before_waits, before_copies = len(state.cuda.waits), len(copies.calls)
        got = _run_stage(state, model, stage, 0, params, args)
        a, b = host.intervals[0]
        want = model.compute(task, layer, [host.rows(n)[a:b] for n in stage.reads], params, args)
        # one wait, on the copy stream's event (never a stream drain, never a scalar read)
        assert state.cuda.waits[before_waits:] == ["copy"], task
        downloads = [c for c in copies.calls[before_copies:] if c["kind"] == "copy_"]
        n_out = len(want.grads or {}) + len(want.meta)
        assert len(downloads) == n_out and all(c["non_blocking"] and c["pinned_dst"] for c in downloads), task
        assert set(got.meta) == set(want.meta)
        for key, value in want.meta.items():
            assert type(got.meta[key]) is type(value) and got.meta[key] == pytest.approx(value, rel=1e-6), key
        assert (got.grads is None) == (want.grads is None)
        for name, grad in (want.grads or {}).items():
            assert isinstance(got.grads[name], np.ndarray)
            np.testing.assert_allclose(got.grads[name], grad, rtol=1e-5, atol=1e-6)
    # the copy stream waited for events recorded on the compute stream behind the producers
    assert state.cuda.copy_stream.waited_for == ["compute", "compute"]


def test_ghost_rows_wait_for_their_snapshot_and_skip_empty_copies(store, monkeypatch):
    config = TrainConfig(hidden=4)
    plan, host, state = _fake_cuda_state(store, config)
    copies = _Copies(monkeypatch, state.cuda)
    name = sorted(plan.ghosted)[0]
    peers = [1, 2]
    sent = asyncio.run(state.rows_for_peers(name, peers))
    want = asyncio.run(host.rows_for_peers(name, peers))
    for peer in peers:
        np.testing.assert_array_equal(sent[peer], want[peer])
    assert state.cuda.copy_stream.waited_for == ["compute"] and state.cuda.waits == ["copy"]
    assert all(c["non_blocking"] and c["pinned_dst"] for c in copies.calls) and len(copies.calls) == len(peers)
    # nothing to send: no event, no copy, no wait
    events, waits = len(state.cuda.events), len(state.cuda.waits)
    empty = asyncio.run(state._to_host({1: torch.zeros(0, 4), 2: torch.zeros(0, 4)}))
    assert {k: v.shape for k, v in empty.items()} == {1: (0, 4), 2: (0, 4)}
    assert len(state.cuda.events) == events and len(state.cuda.waits) == waits
    # received rows: pinned, copied on the copy stream; the compute stream waits for that copy only
    state.cuda.compute.waited_for.clear()
    owned_only = next(n for n in sorted(state.buffers) if n not in plan.ghosted)
    rows = np.random.default_rng(0).standard_normal((len(host.part.send_rows(1)), state.buffers[owned_only].shape[1]))
    state.add_peer_contribution(owned_only, 1, rows.astype(np.float32))
    assert state.cuda.compute.waited_for == ["copy"]


def test_every_thread_that_touches_cuda_sets_the_device_first(store):
    """Stages run in worker threads and copies are awaited in others: each sets the state's
    device before its first CUDA call (else it would open a context on GPU 0)."""
    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _fake_cuda_state(store, config)
    main = threading.get_ident()
    stage, params = _stage(plan, "AV_BWD", 1), _params(config, 1)

    async def exchange():  # the event loop's thread plus asyncio.to_thread's for the copy
        name = sorted(plan.ghosted)[0]
        await state.rows_for_peers(name, [1, 2])

    # The worker stays alive through the exchange: a finished thread's ident may be reused.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(_run_stage, state, model, stage, 0, params, _args(stage)).result()
        pool.submit(state.gather, model, _stage(plan, "GA", 0), 0, _args(_stage(plan, "GA", 0))).result()
        asyncio.run(exchange())
    assert len(state.cuda.used_by - {main}) >= 2  # a stage worker and a copy waiter, both bound
    assert state.cuda.used_by <= state.cuda.bound


def test_a_dropout_mask_is_hashed_once_per_epoch_layer_and_interval(store, monkeypatch):
    """The forward's AV (H = dropout(act(Y0))) and the backward's AV_BWD (H again for dW, and
    the mask for dL/dY0) read one mask; another epoch draws a new one."""
    from dorylus.models import torch_ops

    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _states(store, 0, config, "cpu")
    hashed = []
    keep_mask = torch_ops.keep_mask
    monkeypatch.setattr(torch_ops, "keep_mask", lambda *a: hashed.append(a[0]) or keep_mask(*a))
    forward, backward = _stage(plan, "AV", 1), _stage(plan, "AV_BWD", 1)
    params = _params(config, 1)
    for epoch in (4, 5):
        for interval in range(len(state.intervals)):
            for stage in (forward, backward):
                args = {**_args(stage), "epoch": epoch}
                got = _run_stage(state, model, stage, interval, params, args)
                a, b = host.intervals[interval]
                want = model.compute(stage.task, stage.layer, [host.rows(n)[a:b] for n in stage.reads], params, args)
                for g, w in zip(got.rows, want.rows):
                    _close(g, w)
    assert hashed == [(1, 4, 1)] * len(state.intervals) + [(1, 5, 1)] * len(state.intervals)


@pytest.mark.parametrize("kind", ["gcn", "mean"])
def test_the_transpose_is_built_on_the_device_as_the_host_builds_it(store, monkeypatch, kind):
    import dorylus.models.graph as graph_module
    from dorylus.models import kernels

    config = TrainConfig(hidden=4)
    for part_id in range(NUM_PARTS):
        plan, host, state = _states(store, part_id, config, "cpu")
        graph = state.graph
        want = graph_module.CsrGraph.transpose(graph, kind)  # the host's (stable sort on the CPU)
        with monkeypatch.context() as m:  # nothing sorted or coalesced on the host now
            m.setattr(np, "argsort", lambda *a, **k: pytest.fail("host argsort"))
            m.setattr(graph_module.CsrGraph, "transposed_pattern", lambda *a, **k: pytest.fail("host transpose"),
                      raising=False)
            m.setattr(kernels, "transpose_csr", lambda *a, **k: pytest.fail("host transpose"))
            m.setattr(torch.Tensor, "coalesce", lambda *a, **k: pytest.fail("COO coalesce"))
            got = graph.transpose(kind)
        assert got.layout == torch.sparse_csr and got.shape == want.shape
        np.testing.assert_array_equal(got.crow_indices().numpy(), want.crow_indices().numpy())
        np.testing.assert_array_equal(got.col_indices().numpy(), want.col_indices().numpy())
        np.testing.assert_array_equal(got.values().numpy(), want.values().numpy())
        assert graph.transpose(kind) is got  # made once


@pytest.fixture
def restore_tf32():
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_tf32_is_set_through_the_fp32_precision_api(restore_tf32):
    from graphserver.backends.gpu_device import set_tf32

    set_tf32(True)
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
    set_tf32(False)
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")


def test_open_device_on_a_faked_second_gpu(monkeypatch, caplog, restore_tf32):
    """cuda:1 on a machine faked to have two 80 GiB GPUs: the device is made current before
    anything else, TF32 goes through fp32_precision, and the budget is 1/parts less a context."""
    from graphserver.backends.gpu_device import CONTEXT_RESERVE_BYTES

    caplog.set_level("INFO", logger="graphserver.backends.gpu_device")

    calls = []
    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: calls.append(("properties",)) or type("P", (), {"name": "Fake", "total_memory": total}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append(("budget", f, i)))
    device = open_device(TrainConfig(backend="gpu", device="cuda:1"), parts=4)
    assert device == torch.device("cuda", 1)
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    assert calls[-1] == ("budget", pytest.approx(0.25 - CONTEXT_RESERVE_BYTES / total), 1)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert "TF32 off, memory budget 0.244 of 80.0 GiB (1/4 less 512 MiB for the CUDA context)" in caplog.text
    calls.clear()
    open_device(TrainConfig(backend="gpu", device="cuda:1", allow_tf32=True, gpu_memory_fraction=0.5), parts=4)
    assert calls[-1] == ("budget", 0.5, 1) and torch.backends.cuda.matmul.fp32_precision == "tf32"


def test_the_default_budget_leaves_room_for_every_context():
    from graphserver.backends.gpu_device import CONTEXT_RESERVE_BYTES, memory_fraction

    total = 16 * 2**30
    for parts in (1, 2, 4, 8):
        fraction = memory_fraction(None, parts, total)
        assert parts * (fraction * total + CONTEXT_RESERVE_BYTES) == pytest.approx(total)
    assert memory_fraction(0.3, 4, total) == 0.3
    with pytest.raises(ConfigError, match="cannot share a device"):
        memory_fraction(None, 40, 16 * 2**30)


@CUDA
def test_no_stage_synchronizes_the_device_implicitly(store):
    """On CUDA, torch's sync debug mode raises on every implicit synchronization (.item(),
    nonzero, a pageable copy): a whole training pass's vertex stages of one interval run under it;
    the one explicit wait per stage with gradients or scalars is an event's."""
    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _states(store, 0, config, "cuda")
    stages = [s for s in plan.train if s.kind not in (GATHER, GATHER_BACKWARD)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for stage in stages:
            params = _params(config, stage.layer) if stage.weights else None
            result = _run_stage(state, model, stage, 0, params, _args(stage))
            for name, values in zip(stage.writes, result.rows):
                state.write(name, 0, values)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_worker_threads_compute_on_the_configured_device(store):
    """cuda:1: a stage run in a fresh thread leaves that thread on device 1 (it would have opened
    a context on device 0 otherwise)."""
    config = TrainConfig(hidden=4)
    model = get_model("gcn")
    plan, host, state = _states(store, 0, config, "cuda:1")
    stage = _stage(plan, "AV_BWD", 1)

    def run():
        _run_stage(state, model, stage, 0, _params(config, 1), _args(stage))
        return torch.cuda.current_device()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(run).result() == 1


def test_received_ghost_rows_are_read_only_frames_and_are_only_read(store):
    """The graph server keeps a received frame's rows as they came (read-only, no copy): the
    device state takes them as ghost rows and as peer contributions without a warning, without
    writing them, and with the host state's result."""
    config = TrainConfig(hidden=4)
    plan, host, state = _states(store, 0, config, "cpu")
    name = sorted(plan.ghosted)[0]
    peer = next(p for p in range(store.meta.num_parts) if p != 0 and len(host.part.send_rows(p)))
    rng = np.random.default_rng(5)
    n_ghost = len(range(*host.part.ghost_rows(peer).indices(host.part.n_local)))
    rows = rng.standard_normal((n_ghost, plan.widths[name])).astype(np.float32)
    contribution = rng.standard_normal((len(host.part.send_rows(peer)), plan.widths[name])).astype(np.float32)
    for array in (rows, contribution):
        array.flags.writeable = False
    before = (rows.copy(), contribution.copy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.set_ghost_rows(name, peer, rows)
        state.add_peer_contribution(name, peer, contribution)
    host.set_ghost_rows(name, peer, rows)
    host.add_peer_contribution(name, peer, contribution)
    np.testing.assert_allclose(state.buffers[name].numpy(), host.buffers[name], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(rows, before[0])
    np.testing.assert_array_equal(contribution, before[1])
