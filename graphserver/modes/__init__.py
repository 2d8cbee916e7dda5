"""Scheduler modes (DESIGN §3): one module each, named in :data:`MODES`, each exposing its
:class:`Mode` subclass as ``MODE``. The scheduler (:mod:`graphserver.scheduler`) runs the same
stages in every mode and asks the mode five questions:

* :meth:`Mode.may_start`: may an interval start epoch ``e`` while ``min_epoch`` (the oldest epoch
  some graph server has not finished, published by the coordinator) is what it is?
* :meth:`Mode.barrier_after_stage`: must every interval of the partition finish a stage before
  any starts the next?
* :meth:`Mode.oldest_ghosts`: the oldest epoch whose peer rows a Scatter of epoch ``e`` may use
  in a pass (older ones are waited for).
* :meth:`Mode.oldest_weights`: the oldest weight version a pass of epoch ``e`` may compute with.
* :meth:`Mode.evaluates_beside_training`: may an interval's evaluation pass of epoch ``e`` run
  while the same interval trains epoch ``e + 1``? Then the evaluation pass has buffers of its
  own (:func:`evaluation_apart`).

A mode also states three facts as class attributes, which the configuration, the planner and
the tests read without a graph server (:func:`mode_class`): ``description`` (its line in
``--mode``'s help), ``exact`` (it reproduces the single-process reference epoch by epoch: the
exactness tests run it) and ``bounded_staleness`` (it takes ``--staleness S``, and
``--stale-correction`` with S >= 1; every other mode refuses a non-zero S). :data:`MODES` is the
one list of the modes: ``--mode``'s choices, the config's checks, the planner's modes and the
test matrices all come from it.

``staleness`` S bounds the gate and the training pass's ghost rows in every mode: an interval
starts epoch ``e`` only when ``e <= min_epoch + S``, and trains on rows produced in epoch
``e - S`` or later. Weights are not stale: a training pass of epoch ``e`` computes with version
``e - 1`` (the previous epoch's step), in every mode. An evaluation pass is exact in every mode:
version ``e`` and the peers' rows of epoch ``e``, so that the accuracies reported are the
model's. The server's epoch window (:func:`dorylus.protocol.check_epoch`) reads S too. With
S = 0 those are the synchronous rules.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, replace

from dorylus.models.base import STATIC, Plan

MODES = {"sync": "graphserver.modes.sync", "pipe": "graphserver.modes.pipe", "async": "graphserver.modes.asynchronous"}


@dataclass(frozen=True)
class Mode(abc.ABC):
    staleness: int = 0
    # each mode's own, class attributes (not fields)
    name = ""
    description = ""  # one line: what it waits for (``--mode``'s help)
    exact = False  # equals the reference epoch by epoch
    bounded_staleness = False  # takes --staleness S (and --stale-correction with S >= 1)

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.staleness and not self.bounded_staleness:
            raise ValueError(f"{self.name} mode has no staleness")

    @abc.abstractmethod
    def may_start(self, epoch: int, min_epoch: int) -> bool:
        """Whether an interval may start ``epoch`` now."""

    @abc.abstractmethod
    def barrier_after_stage(self) -> bool:
        """Whether every interval finishes each stage before any interval starts the next."""

    def oldest_ghosts(self, epoch: int, pass_: str) -> int:
        # Evaluation reads the peers' rows of its own epoch: what it reports is the model after
        # the step, not rows left over from older weights (docs/modes.md).
        return epoch - self.staleness if pass_ == "train" else epoch

    def oldest_weights(self, epoch: int, pass_: str) -> int:
        # Training's forward of epoch e: the weights after epoch e-1's step, in every mode. A stale
        # version on top of stale ghost rows feeds the step a gradient two epochs old, and that
        # cost async S=1 13 points of test accuracy on synthetic-1m (docs/modes.md).
        # Evaluation of epoch e: the weights after e's step, exactly.
        return epoch - 1 if pass_ == "train" else epoch

    def evaluates_beside_training(self) -> bool:
        return False


@dataclass(frozen=True)
class ExactMode(Mode):
    """A mode that reproduces the reference epoch by epoch: no staleness, and no gate of its own
    (the wait for the previous epoch's weights already holds every interval back)."""

    exact = True

    def may_start(self, epoch: int, min_epoch: int) -> bool:
        return True


EVAL_SUFFIX = ".eval"


def evaluation_apart(plan: Plan) -> Plan:
    """``plan`` with the evaluation pass on buffers of its own (``<name>.eval``, same widths), so
    that it can run beside the next epoch's training pass without either overwriting the
    other's rows. Static inputs stay shared: nobody writes them."""
    def own(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n if n in STATIC else n + EVAL_SUFFIX for n in names)

    evaluate = tuple(replace(s, reads=own(s.reads), writes=own(s.writes)) for s in plan.evaluate)
    used = {n for s in plan.evaluate for n in (*s.reads, *s.writes) if n not in STATIC}
    return replace(plan, evaluate=evaluate, widths={**plan.widths, **{n + EVAL_SUFFIX: plan.widths[n] for n in used}})


def calls_at_once(mode: Mode, intervals: int, functions: int | None = None) -> int:
    """The most function calls one graph server of ``mode`` with ``intervals`` intervals has in
    flight at once, relaunched attempts aside: a stage of every interval, twice as many when the
    evaluation pass runs beside the next epoch's training (:meth:`Mode.evaluates_beside_training`).
    That is the autotuner's top and the cap on ``--functions`` (``functions``, when given, capped).

    A local Lambda emulator needs a worker for each of these calls on every graph server (plus
    one per server for relaunches): with fewer it answers 429, and botocore's retry of a throttled
    Invoke sleeps up to a second (``throttling_base_scale`` 1 s) on the epoch's critical path."""
    most = intervals * (2 if mode.evaluates_beside_training() else 1)
    return most if functions is None else min(functions, most)


def mode_class(name: str) -> type[Mode]:
    """The class of mode ``name``: its facts (``description``, ``exact``, ``bounded_staleness``)
    without an instance."""
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    return importlib.import_module(MODES[name]).MODE


def get_mode(name: str, staleness: int = 0) -> Mode:
    return mode_class(name)(staleness)
