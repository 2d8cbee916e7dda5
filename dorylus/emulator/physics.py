"""How the Lambda emulator's calls behave in time: latency, cold starts, bandwidth, CPU share.

A :class:`Physics` is a set of figures the emulator applies to every call (see
:mod:`dorylus.emulator.server` for where each one acts and whether it is billed). The default
``Physics()`` changes nothing: calls run as fast as this machine runs them. :data:`AWS_LIKE`
holds figures measured on AWS Lambda; :class:`NetPhysics` and :data:`AWS_NET_LIKE` do the same for
the network between graph servers and their compute.
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


@dataclass(frozen=True)
class NetPhysics:
    """The network between graph servers (and to the parameter server) and the variability of a
    graph server's own compute, as a local run emulates them (:mod:`graphserver.server` applies
    them; the default ``NetPhysics()`` changes nothing).

    * ``latency_ms``: one-way delay of every message a graph server sends to a peer graph server
      or the parameter server, and of every reply it receives from one.
    * ``bandwidth_mbps``: per link (one connection), megabits/s; a message of ``b`` bytes holds
      its link ``8 b / bandwidth`` longer; 0 = unlimited.
    * ``compute_jitter``: sigma of a seeded log-normal slowdown of each graph-server stage
      (Gather, vertex, backward Gather): one that ran ``d`` seconds lasts ``d * exp(sigma * |z|)``,
      ``z`` standard normal drawn per (seed, part, pass, epoch, stage, interval). Never faster:
      the emulation can only add time. 0 = none.

    Each delay is an asyncio sleep on the graph server's event loop: the server keeps serving
    and scheduling meanwhile, as a real server does while its bytes are on the wire.
    """

    latency_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    compute_jitter: float = 0.0

    def __post_init__(self) -> None:
        for field in ("latency_ms", "bandwidth_mbps", "compute_jitter"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"network physics: {field} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"network physics: {field} must be a finite number >= 0, got {value!r}")

    @property
    def network(self) -> bool:
        """Whether messages are delayed at all."""
        return bool(self.latency_ms or self.bandwidth_mbps)

    def transfer_s(self, nbytes: int) -> float:
        """Seconds one message of ``nbytes`` tensor bytes takes on a link."""
        seconds = self.latency_ms / 1000
        if self.bandwidth_mbps:
            seconds += nbytes * 8 / (self.bandwidth_mbps * 1e6)
        return seconds

    def slowdown(self, *key: int) -> float:
        """The jitter factor (>= 1) of the stage named by ``key`` (non-negative integers, the
        run's seed first): the same key, the same factor, in every process."""
        if not self.compute_jitter:
            return 1.0
        import numpy as np

        z = np.random.default_rng([int(k) for k in key]).standard_normal()
        return math.exp(self.compute_jitter * abs(z))


# Figures measured on EC2, rounded, for graph servers on c5/c5n instances in one availability zone:
# * latency_ms 0.1: round trips between current-generation instances in one availability zone
#   measure about 0.1-0.5 ms with ping or netperf TCP_RR (ENA enhanced networking; lower still in a
#   cluster placement group); one way is half a ~0.2 ms round trip, and ZeroMQ's own per-message
#   cost is paid for real by the run on top.
# * bandwidth_mbps 5000: one TCP flow between EC2 instances outside a cluster placement group is
#   limited to 5 Gbit/s (EC2 User Guide, "Amazon EC2 instance network bandwidth"); each link here
#   is one ZeroMQ connection, one flow. c5n.2xlarge bursts to 25 Gbit/s (10 sustained) in total,
#   c5.2xlarge to 10 (2.5 sustained): per flow, 5 is the tighter bound on either.
# * compute_jitter 0.1: CPU-bound benchmarks on the same EC2 instance type vary by a coefficient
#   of variation of a few percent up to ~10% across instances and over time (Leitner and Cito,
#   "Patterns in the Chaos", ACM TOIT 2016; Schad et al., "Runtime Measurements in the Cloud",
#   VLDB 2010, saw more on older instance types); sigma 0.1 gives a median slowdown of 7% and 1 in
#   20 stages 22% or more slower.
AWS_NET_LIKE = NetPhysics(latency_ms=0.1, bandwidth_mbps=5000.0, compute_jitter=0.1)
