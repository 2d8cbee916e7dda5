"""The gpu backend's partition state (graphserver.backends.gpu.DeviceState) against the host
state every other backend uses: the same Gather and Gather backward (each model's torch twin on
the device), the same ghost rows in and out, and the device chosen and budgeted as configured.

Runs on torch's CPU device; the CUDA cases are skipped without CUDA. Tolerances: Gather sums at
most a few dozen float32 products per row in another order than the host kernel (GAT: the same
kernels), so rtol/atol 1e-5 (see tests/models/test_torch_ops.py); row copies and the backward
Scatter's additions are one float32 operation per element on both sides: equal.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from dorylus.models import get_model
from dorylus.models.base import GATHER, GATHER_BACKWARD
from dorylus.models.spec import ModelSpec
from dorylus.partition import assign_parts, open_store, write_store
from graphserver.backends import make_state
from graphserver.backends.gpu import DeviceState, open_device
from graphserver.state import PartitionState
from tests.graphs import random_graph

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]
NUM_NODES, NUM_FEATURES, NUM_CLASSES, NUM_PARTS = 60, 7, 3, 3
MODELS = {"gcn": dict(model="gcn", hidden=4), "gat": dict(model="gat", hidden=3, heads=2, attention_dropout=0.3),
          "sage": dict(model="sage", hidden=4)}


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


def test_make_state_places_the_gpu_backend_on_its_device(store, capsys):
    spec_config = dict(hidden=4)
    plan = get_model("gcn").build_plan(ModelSpec.from_config(TrainConfig(**spec_config), NUM_FEATURES, NUM_CLASSES))
    part = store.load_part(0)
    assert type(make_state(TrainConfig(backend="cpu", **spec_config), part, plan, parts=3)) is PartitionState
    state = make_state(TrainConfig(backend="gpu", device="cpu", **spec_config), part, plan, parts=3)
    assert isinstance(state, DeviceState) and state.device == torch.device("cpu")
    assert "device cpu" in capsys.readouterr().out


def test_open_device_on_cpu_leaves_cuda_alone(monkeypatch):
    def refuse(*args):
        raise AssertionError("a memory budget was set for a CPU device")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refuse)
    assert open_device(TrainConfig(backend="gpu", device="cpu"), parts=4) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_asked_without_cuda_is_a_config_error(device):
    with pytest.raises(ConfigError, match=r"--device.*CUDA is not available"):
        open_device(TrainConfig(backend="gpu", device=device), parts=1)


@pytest.mark.parametrize("device", ["tpu", "cuda:", "CUDA", "cuda:x", "gpu"])
def test_unknown_device_is_a_config_error(device):
    with pytest.raises(ConfigError, match=r"--device"):
        TrainConfig(backend="gpu", device=device)


@CUDA
@pytest.mark.parametrize("fraction, parts, expected", [(None, 4, 0.25), (None, 1, 1.0), (0.5, 4, 0.5)])
def test_open_device_sets_the_memory_budget_and_tf32(monkeypatch, fraction, parts, expected):
    budgets = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: budgets.append((f, index)))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    device = open_device(TrainConfig(backend="gpu", device="cuda", gpu_memory_fraction=fraction), parts=parts)
    assert device.type == "cuda" and device.index is not None
    assert budgets == [(expected, device.index)]
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    open_device(TrainConfig(backend="gpu", device="cuda", allow_tf32=True), parts=parts)
    assert torch.backends.cuda.matmul.allow_tf32 is True
