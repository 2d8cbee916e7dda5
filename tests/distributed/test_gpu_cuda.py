"""The gpu backend on a CUDA device (skipped without CUDA; the torch-CPU-device cases are in
test_sync_exactness.py): sync equals the single-process reference per epoch with TF32 off, and
four graph servers share one device, each within its memory budget (by default 1/4 of the device
less a CUDA context, graphserver.backends.gpu_device.memory_fraction)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_sync_exactness import _dataset, _reference, _run, assert_matches_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dataset_name, parts", [("cora", 2), ("synthetic-small", 1)])
def test_gpu_sync_on_cuda_equals_reference(tmp_path, tmp_path_factory, request, dataset_name, parts):
    dataset = _dataset(dataset_name, request)
    reference = _reference(tmp_path_factory, dataset, {})
    got = _run(tmp_path, dataset, "gpu", device="cuda", mode="sync", parts=parts, intervals=2)
    assert_matches_reference(reference, got, dataset)


@pytest.mark.timeout(600)
def test_four_graph_servers_share_one_cuda_device(tmp_path, tmp_path_factory, request):
    dataset = _dataset("synthetic-small", request)
    reference = _reference(tmp_path_factory, dataset, {})
    got = _run(tmp_path, dataset, "gpu", device="cuda", mode="pipe", parts=4, intervals=2)
    assert_matches_reference(reference, got, dataset)
    for i in range(4):
        log = (tmp_path / "gpu" / "logs" / f"graphserver-{i}.log").read_text()
        assert "TF32 off, memory budget" in log and "(1/4 less 512 MiB for the CUDA context)" in log, log
        assert "gpu backend: peak memory allocated" in log, log
