"""Scheduler modes (DESIGN §3) and the config's staleness rules."""

import dataclasses

import pytest

from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from graphserver.modes import MODES, Mode, get_mode


def test_known_modes():
    assert set(MODES) == {"sync", "pipe", "async"}


def _rules(mode, epoch=5):
    """A mode's answers to the scheduler's questions at ``epoch``."""
    return {"name": mode.name, "barrier": mode.barrier_after_stage(),
            "may_start": [e for e in range(epoch, epoch + 9) if mode.may_start(e, min_epoch=epoch)],
            "ghosts": mode.oldest_ghosts(epoch, "train"), "weights": mode.oldest_weights(epoch, "train"),
            "eval_ghosts": mode.oldest_ghosts(epoch, "eval"), "eval_weights": mode.oldest_weights(epoch, "eval")}


def test_sync_has_a_stage_barrier_and_no_staleness():
    mode = get_mode("sync")
    assert isinstance(mode, Mode) and mode.staleness == 0
    assert _rules(mode) == {"name": "sync", "barrier": True, "may_start": list(range(5, 14)), "ghosts": 5,
                            "weights": 4, "eval_ghosts": 5, "eval_weights": 5}
    assert get_mode("sync", 0) == mode


def test_pipe_has_no_stage_barrier_and_no_staleness():
    mode = get_mode("pipe")
    assert _rules(mode) == {"name": "pipe", "barrier": False, "may_start": list(range(5, 14)), "ghosts": 5,
                            "weights": 4, "eval_ghosts": 5, "eval_weights": 5}
    assert get_mode("pipe", 0) == mode and mode != get_mode("sync")


@pytest.mark.parametrize("staleness", [0, 1, 2, 7])
def test_async_gates_epochs_with_its_staleness(staleness):
    mode = get_mode("async", staleness)
    # the gate: epoch e starts only when e <= min_epoch + S; training never computes with stale
    # weights (a stale version on top of stale ghost rows cost 13 points of accuracy), and
    # evaluation is exact: what it reports is the model after epoch e's step
    assert _rules(mode) == {"name": "async", "barrier": False, "may_start": list(range(5, 5 + staleness + 1)),
                            "ghosts": 5 - staleness, "weights": 4, "eval_ghosts": 5, "eval_weights": 5}


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
