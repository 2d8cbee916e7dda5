"""Models: one module per architecture (see :mod:`dorylus.models.base`). Torch-free; the
single-process reference (:mod:`dorylus.models.reference`) is imported on its own."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

MODELS = {"gcn": "dorylus.models.gcn", "gat": "dorylus.models.gat", "sage": "dorylus.models.sage",
          "gin": "dorylus.models.gin"}


def get_model(name: str) -> ModuleType:
    """The module of model ``name``: ``build_plan(spec)`` and ``compute(...)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return importlib.import_module(MODELS[name])


def stage_cost(model: str, task: str, args: dict[str, Any], layer, rows: float, training: bool):
    """The :class:`~dorylus.models.base.Work` of stage ``task`` of ``layer`` (its
    :class:`~dorylus.models.spec.LayerSpec`) of ``model`` on ``rows`` rows, with ``args`` the
    stage's (or a call's event's): the model module's ``stage_work`` with the layer input's
    preparation priced as the stage runs it (dropout's mask regenerated while training, else the
    activation alone). None for a task the model gives no formula."""
    # Not at the top: the CLI imports this package (MODELS) before its Ctrl-C handling is in place,
    # so it must not load numpy (tests/test_cli_errors.py).
    from dorylus.models.base import Work

    dropout = training and float(args.get("dropout", 0.0)) > 0
    activation = args.get("act_in", args.get("relu_in")) not in (None, False)
    i = layer.in_dim
    prepare = Work(dropout=rows * i) if dropout else Work(elementwise=rows * i if activation else 0.0)
    return get_model(model).stage_work(task, args, layer, rows, training, prepare)
