"""The emulated network and compute jitter between graph servers only delay: sync and pipe with
them on still reproduce the single-process reference per epoch (Cora, cpu backend, 2 parts,
whose weights and gradients go through the delayed parameter-server link too)."""

from __future__ import annotations

import pytest

from tests.distributed.test_sync_exactness import DEFAULT_EPOCHS, _reference, _run, assert_matches_reference

PHYSICS = {"net_latency_ms": 2.0, "net_bandwidth_mbps": 200.0, "compute_jitter": 0.5}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "pipe"])
def test_exact_modes_with_physics_on_match_the_reference(tmp_path, tmp_path_factory, cora, mode):
    reference = _reference(tmp_path_factory, cora, {}, DEFAULT_EPOCHS)
    metrics = _run(tmp_path, cora, "cpu", DEFAULT_EPOCHS, mode=mode, parts=2, intervals=2, **PHYSICS)
    assert_matches_reference(reference, metrics, cora, DEFAULT_EPOCHS)
