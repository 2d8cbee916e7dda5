"""Scheduler modes (DESIGN §3): one module each, read by :mod:`graphserver.scheduler`.

A mode is a policy over the same stages: where intervals wait for each other and how stale the
rows and weights they read may be. ``staleness`` S bounds three things at once: an interval
starts epoch ``e`` only when ``e <= min_epoch + S`` (``min_epoch``: the oldest epoch some graph
server has not finished, published by the coordinator), Gather reads ghost rows produced in
epoch ``e - S`` or later, and a forward pass of epoch ``e`` computes with weight version
``e - 1 - S`` or newer. With S = 0 those are the synchronous rules.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

MODES = {"sync": "graphserver.modes.sync", "pipe": "graphserver.modes.pipe", "async": "graphserver.modes.asynchronous"}


@dataclass(frozen=True)
class Mode:
    name: str
    staleness: int = 0
    stage_barrier: bool = False  # every interval finishes a stage before any interval starts the next
    gate_epochs: bool = False    # epoch starts wait for the coordinator's min_epoch


def get_mode(name: str, staleness: int = 0) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    return importlib.import_module(MODES[name]).mode(staleness)
