"""Seeded fault injection for the Lambda emulator.

A :class:`FaultPlan` picks, for each invocation, whether it fails and how. The draw is a pure
function of the seed and the call's event payload (SHA-256), so a run repeats its faults exactly,
and a relaunched call, whose payload differs (its ``attempt`` field, say), gets a draw of its own.

Kinds, each played in the worker process around the real handler:

* ``raise``: the call is a function error of type ``InjectedFault``; the handler does not run.
* ``crash``: the worker process exits (``os._exit``) before the handler runs: the call is a
  ``Runtime.ExitError`` and the worker is replaced.
* ``hang``: the call sleeps past its timeout: ``Sandbox.Timedout``, the worker is replaced.
* ``straggle``: the handler runs, then the call sleeps ``straggle_factor - 1`` times the
  handler's duration before it returns the result (billed, as a slow call is).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

FAULT_KINDS = ("raise", "crash", "hang", "straggle")


@dataclass(frozen=True)
class FaultPlan:
    """Fractions of calls that get each fault (each in [0, 1], summing to at most 1),
    the slowdown of a straggler (>= 1) and the seed of the draw."""

    raise_fraction: float = 0.0
    crash_fraction: float = 0.0
    hang_fraction: float = 0.0
    straggle_fraction: float = 0.0
    straggle_factor: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        fractions = self.fractions()
        for kind, value in zip(FAULT_KINDS, fractions):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value <= 1.0:
                raise ValueError(f"fault plan: {kind}_fraction must be a number in [0, 1], "
                                 f"got {value!r}")
        if sum(fractions) > 1.0 + 1e-9:
            raise ValueError(f"fault plan: the fault fractions sum to {sum(fractions):g}, "
                             "more than 1")
        factor = self.straggle_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"fault plan: straggle_factor must be a finite number >= 1, "
                             f"got {factor!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"fault plan: seed must be an integer, got {self.seed!r}")

    def fractions(self) -> tuple[float, float, float, float]:
        """The fractions in the order of :data:`FAULT_KINDS`."""
        return (self.raise_fraction, self.crash_fraction, self.hang_fraction,
                self.straggle_fraction)

    @property
    def active(self) -> bool:
        """Whether any call can get a fault."""
        return any(self.fractions())

    def draw(self, payload: bytes) -> float:
        """The call's uniform draw in [0, 1): SHA-256 of the seed and the payload."""
        digest = hashlib.sha256(b"dorylus-fault:%d:" % self.seed + payload).digest()
        return int.from_bytes(digest[:8], "big") / 2.0 ** 64

    def choose(self, payload: bytes) -> str | None:
        """The fault for a call with this event payload: one of :data:`FAULT_KINDS`, or None."""
        if not self.active:
            return None
        u, edge = self.draw(payload), 0.0
        for kind, fraction in zip(FAULT_KINDS, self.fractions()):
            edge += fraction
            if u < edge:
                return kind
        return None
