"""How the Lambda emulator's calls behave in time: latency, cold starts, bandwidth, CPU share.

A :class:`Physics` is a set of figures the emulator applies to every call (see
:mod:`dorylus.emulator.server` for where each one acts and whether it is billed). The default
``Physics()`` changes nothing: calls run as fast as this machine runs them. :data:`AWS_LIKE`
holds figures measured on AWS Lambda.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MB_PER_VCPU = 1769  # Lambda gives one vCPU per 1,769 MB of memory ...
MAX_VCPUS = 6.0  # ... up to 6 vCPUs (at 10,240 MB)


@dataclass(frozen=True)
class Physics:
    """Figures that make emulated calls take as long as Lambda calls.

    * ``start_latency_ms``: sleep before every call, modelling the invoke path (frontend,
      placement); not billed.
    * ``cold_start_ms``: extra latency of a call that lands on a worker that has not run the
      function within ``keep_warm_s`` (its first call of the function included); billed and
      reported as ``Init Duration``, as Lambda bills the INIT phase.
    * ``keep_warm_s``: how long after its last call of a function a worker stays warm for it.
    * ``bandwidth_mbps``: cap, in megabits/s, on each call's own network traffic; 0 = none. The
      handler enforces it, reading ``context.bandwidth_bytes_per_s``.
    * ``cpu_share``: give each call the CPU its memory buys on Lambda, ``memory_mb / 1769``
      vCPUs (at most 6): a call whose CPU time exceeds that share is stretched, after its handler
      returns, to the time it would take at that share; the stretch is billed.
    """

    start_latency_ms: float = 0.0
    cold_start_ms: float = 0.0
    keep_warm_s: float = 600.0
    bandwidth_mbps: float = 0.0
    cpu_share: bool = False

    def __post_init__(self) -> None:
        for field in ("start_latency_ms", "cold_start_ms", "keep_warm_s", "bandwidth_mbps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"physics: {field} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"physics: {field} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.cpu_share, bool):
            raise ValueError(f"physics: cpu_share must be True or False, got {self.cpu_share!r}")

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """``bandwidth_mbps`` in bytes/s, or None when unlimited."""
        return self.bandwidth_mbps * 1e6 / 8 if self.bandwidth_mbps else None

    def vcpus(self, memory_mb: int) -> float | None:
        """The vCPUs a call at ``memory_mb`` gets on Lambda, or None when ``cpu_share`` is off."""
        return min(memory_mb / MB_PER_VCPU, MAX_VCPUS) if self.cpu_share else None


def cpu_stretch_s(cpu_s: float, wall_s: float, vcpus: float | None) -> float:
    """Seconds to add to a handler run that used ``cpu_s`` of CPU (all threads) in ``wall_s``
    so that it lasts as long as with ``vcpus`` vCPUs: CPU work at a share below one vCPU takes
    ``1 / vcpus`` times as long (``cpu_s * (1 / vcpus - 1)`` more), and work spread over more
    threads than ``vcpus`` cannot finish before ``cpu_s / vcpus``. None or a share the run did not
    exceed: 0."""
    if not vcpus or cpu_s <= 0:
        return 0.0
    return max(0.0, cpu_s * (1 / vcpus - 1), cpu_s / vcpus - wall_s)


# Figures measured on AWS Lambda (x86_64, Python runtime), rounded:
# * start_latency_ms 25: median warm-start invoke latency on AWS about 25 ms (Wang et al.,
#   "Peeking Behind the Curtains of Serverless Platforms", USENIX ATC 2018); warm invoke
#   overheads of 10-30 ms are reported generally.
# * cold_start_ms 600: a Python function whose package pulls in numpy and pyzmq starts cold in
#   roughly 300-1000 ms (sandbox, runtime init, imports); Wang et al. report cold starts of a
#   few hundred ms for small functions, more with larger packages.
# * keep_warm_s 600: idle sandboxes are reclaimed after about 10 minutes (measurements by
#   M. Shilkov, mikhail.io, 2019: a fixed 10-minute idle lifetime since July 2019; earlier
#   studies saw 5-60 minutes).
# * bandwidth_mbps 540: per-function network throughput on the order of 500-600 Mbit/s (Wang
#   et al. 2018; the Dorylus paper, Thorpe et al., OSDI 2021, works with Lambda's limited
#   per-function bandwidth in the same range).
# * cpu_share: Lambda allocates CPU in proportion to memory, one vCPU per 1,769 MB, up to 6
#   (AWS Lambda documentation, "Configuring Lambda function memory").
AWS_LIKE = Physics(start_latency_ms=25.0, cold_start_ms=600.0, keep_warm_s=600.0,
                   bandwidth_mbps=540.0, cpu_share=True)
