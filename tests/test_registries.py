"""The registries are the one list of models and modes: every registered model and mode is a
CLI choice (every mode described in train's and plan's --mode help), passes the config's
validation, is a choice of the planner, and is met by the test matrices (issue 20 item 3). A new
model or mode that one of them misses fails here."""

from __future__ import annotations

import importlib

import pytest

from dorylus.cli import build_parser
from dorylus.config import TrainConfig, config_from_args, staleness_modes
from dorylus.errors import ConfigError
from dorylus.models import MODELS
from graphserver.modes import MODES, mode_class


def _option(parser, *path: str, dest: str):
    """Option ``dest`` of subcommand ``path`` (its argparse action)."""
    for name in path:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return next(a for a in parser._actions if a.dest == dest)


def _choices(parser, *path: str, dest: str) -> tuple:
    """The choices of option ``dest`` of subcommand ``path``."""
    return tuple(_option(parser, *path, dest=dest).choices)


def _help(parser, *path: str, dest: str) -> str:
    """The help of option ``dest`` of subcommand ``path``, its whitespace collapsed."""
    return " ".join(_option(parser, *path, dest=dest).help.split())


def _test_module(name: str):
    return importlib.import_module(f"tests.{name}")


def test_the_cli_offers_every_model_and_mode():
    parser = build_parser()
    assert _choices(parser, "train", dest="model") == tuple(MODELS)
    assert _choices(parser, "train", dest="mode") == tuple(MODES)
    assert _choices(parser, "plan", dest="model") == tuple(MODELS)
    assert _choices(parser, "plan", dest="mode") == tuple(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_the_mode_help_of_train_and_plan_describes_every_mode(mode):
    parser = build_parser()
    line = f"'{mode}' = {' '.join(mode_class(mode).description.split())}"
    assert line in _help(parser, "train", dest="mode")
    assert line in _help(parser, "plan", dest="mode")


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_by_name_from_the_command_line(model):
    config = config_from_args(build_parser().parse_args(["train", "--model", model]))
    assert config.model == model


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_passes_validation_and_its_staleness_rule_is_its_class(mode):
    config = config_from_args(build_parser().parse_args(["train", "--mode", mode]))
    assert config.mode == mode and config.staleness == 0
    cls = mode_class(mode)
    assert cls.name == mode and cls.description
    assert (mode in staleness_modes()) == cls.bounded_staleness
    if cls.bounded_staleness:
        assert TrainConfig(mode=mode, staleness=2, stale_correction=True).staleness == 2
    else:
        with pytest.raises(ConfigError, match="staleness applies to --mode"):
            TrainConfig(mode=mode, staleness=2)
        with pytest.raises(ConfigError, match="stale_correction needs --mode"):
            TrainConfig(mode=mode, stale_correction=True)


def test_the_exactness_matrix_meets_every_model_and_exact_mode():
    exactness = _test_module("distributed.test_sync_exactness")
    shape_models = {exactness.SHAPES[s].get("model", TrainConfig.model): s for s in exactness.MODEL_SHAPES}
    assert set(shape_models) == set(MODELS)
    exact = {name for name in MODES if mode_class(name).exact}
    assert exact and set(exactness.EXACT_MODES) == exact
    for model, shape in shape_models.items():
        for mode in exact:
            assert any(c[1:3] == (shape, mode) for c in exactness.MATRIX), (model, mode)
        assert any(c[1] == shape for c in exactness.CASES), model  # and the default suite runs it


def test_the_other_model_lists_of_the_tests_are_the_registry():
    assert set(_test_module("distributed.test_modes").MODEL_RECIPES) <= set(MODELS)
    assert set(_test_module("graphserver.test_gpu_backend").MODELS) == set(MODELS)


@pytest.mark.parametrize("mode", MODES)
def test_the_planner_prices_every_mode_by_its_stage_barrier(mode):
    """A mode with a barrier after every stage sums the stages (sync); one without overlaps the
    graph servers' work with the functions' as pipe does (async too: its run-ahead is not
    modelled). Hand-made rates (tests/plan), so the figures are exact."""
    from dorylus.plan.model import MODES as PLANNED

    from tests.plan.test_model import local, setup

    assert mode in PLANNED
    barrier = mode_class(mode)().barrier_after_stage()
    like = "sync" if barrier else "pipe"
    assert local(setup(backend="lambda", mode=mode)).epoch_s == local(setup(backend="lambda", mode=like)).epoch_s
