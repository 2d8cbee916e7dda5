"""Models: one module per architecture (see :mod:`dorylus.models.base`). Torch-free; the
single-process reference (:mod:`dorylus.models.reference`) is imported on its own."""

from __future__ import annotations

import importlib
from types import ModuleType

MODELS = {"gcn": "dorylus.models.gcn", "gat": "dorylus.models.gat", "sage": "dorylus.models.sage",
          "gin": "dorylus.models.gin"}


def get_model(name: str) -> ModuleType:
    """The module of model ``name``: ``build_plan(spec)`` and ``compute(...)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return importlib.import_module(MODELS[name])
