"""Scheduler modes (DESIGN §3) and the config's staleness rules."""

import dataclasses

import pytest

from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from graphserver.modes import MODES, Mode, get_mode


def test_known_modes():
    assert set(MODES) == {"sync", "pipe", "async"}


def test_sync_has_a_stage_barrier_and_no_staleness():
    mode = get_mode("sync")
    assert mode == Mode("sync", staleness=0, stage_barrier=True, gate_epochs=False)
    assert get_mode("sync", 0) == mode


def test_pipe_has_no_stage_barrier_and_no_staleness():
    mode = get_mode("pipe")
    assert mode == Mode("pipe", staleness=0, stage_barrier=False, gate_epochs=False)
    assert get_mode("pipe", 0) == mode


@pytest.mark.parametrize("staleness", [0, 1, 2, 7])
def test_async_gates_epochs_with_its_staleness(staleness):
    mode = get_mode("async", staleness)
    assert mode == Mode("async", staleness=staleness, stage_barrier=False, gate_epochs=True)


def test_async_default_staleness_is_zero():
    assert get_mode("async").staleness == 0


def test_modes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_mode("async", 1).staleness = 3


@pytest.mark.parametrize("name", ["", "Sync", "asynchronous", "bogus"])
def test_unknown_mode_raises(name):
    with pytest.raises(ValueError, match="unknown mode"):
        get_mode(name)


@pytest.mark.parametrize("name", ["sync", "pipe"])
@pytest.mark.parametrize("staleness", [1, 3])
def test_exact_modes_refuse_staleness(name, staleness):
    with pytest.raises(ValueError, match="staleness"):
        get_mode(name, staleness)


def test_async_refuses_negative_staleness():
    with pytest.raises(ValueError, match="staleness"):
        get_mode("async", -1)


# ----------------------------------------------------------------------------- TrainConfig


@pytest.mark.parametrize("mode", ["sync", "pipe"])
def test_config_refuses_staleness_without_async(mode):
    with pytest.raises(ConfigError, match="staleness applies to --mode async only"):
        TrainConfig(mode=mode, staleness=2)


@pytest.mark.parametrize("mode", ["sync", "pipe", "async"])
def test_config_refuses_negative_staleness(mode):
    with pytest.raises(ConfigError, match="staleness must be >= 0"):
        TrainConfig(mode=mode, staleness=-1)


def test_config_refuses_unknown_mode():
    with pytest.raises(ConfigError, match="mode"):
        TrainConfig(mode="bogus")


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("pipe", 0), ("async", 0), ("async", 3)])
def test_config_accepts_valid_modes_and_get_mode_agrees(mode, staleness):
    config = TrainConfig(mode=mode, staleness=staleness)
    assert get_mode(config.mode, config.staleness).staleness == staleness
