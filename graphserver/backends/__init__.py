"""Where a graph server's FUNCTION stages run and where its rows live (DESIGN §7): one module
per backend. :func:`make_state` gives the partition state a backend computes on (host numpy;
the ``gpu`` backend's on a torch device, Gather and vertex stages included), and
:func:`make_backend` the backend.

A backend runs one stage on one interval: ``await backend.run(event, priority)`` returns once the
stage's result has been accepted by the graph server (``GraphServer.accept_result``) and its
gradient by the parameter server, or raises :class:`graphserver.invoker.TaskFailed`. ``event``
is the function's invoke payload (see :mod:`lambdas.handler`); ``priority`` orders calls waiting
for a slot (DESIGN §3: older epoch first, then stage order, then interval). ``concurrency`` may
change between epochs (autotuning); ``take_stats()`` returns and resets the counters
(invocations, relaunches, failed_calls, busy and waiting time); ``close()`` releases it.
"""

from __future__ import annotations

from typing import Any


class Backend:
    """What backends share: their calls wait for slots of ``self.limiter``
    (:class:`graphserver.limiter.PriorityLimiter`), whose capacity is the concurrency."""

    limiter: Any

    @property
    def concurrency(self) -> int:
        return self.limiter.capacity

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        self.limiter.capacity = value


def make_state(config, part, plan, *, parts: int):
    """The partition state of a graph server of ``config.backend`` (one of ``parts`` servers)."""
    if config.backend == "gpu":
        from graphserver.backends.gpu import DeviceState, open_device

        return DeviceState(part, plan, device=open_device(config, parts),
                           row_normalize_features=config.row_normalize_features, num_intervals=config.intervals)
    from graphserver.state import PartitionState

    return PartitionState(part, plan, row_normalize_features=config.row_normalize_features,
                          num_intervals=config.intervals, sparse_features=config.sparse_features)


def make_backend(name: str, server: Any, *, concurrency: int, lambda_endpoint: str | None, function_name: str,
                 region: str | None = None):
    if name == "cpu":
        from graphserver.backends.cpu import CpuBackend

        return CpuBackend(server, concurrency=concurrency)
    if name == "gpu":
        from graphserver.backends.gpu import GpuBackend

        return GpuBackend(server, concurrency=concurrency)
    if name == "lambda":
        from graphserver.backends.serverless import LambdaBackend

        return LambdaBackend(server.config, concurrency=concurrency, endpoint_url=lambda_endpoint,
                             function_name=function_name, region=region, server=server)
    raise ValueError(f"unknown backend {name!r}; known: cpu, gpu, lambda")
