"""Where a graph server's FUNCTION stages run and where its rows live (DESIGN §7): one module per
backend, named in :data:`BACKENDS`, each exposing its :class:`Backend` subclass as ``BACKEND``.
:func:`backend_class` and :func:`make_backend` read the registry; nothing else names a backend.

A backend runs one stage on one interval: ``backend.run(event, priority)`` returns a future
resolved with the call's result (the stage's ``meta``: loss, accuracy counts, weight version and
lag) once its rows are in the graph server's buffers and its gradient (if any) has been accepted
by the parameter server, or failed with :class:`graphserver.invoker.TaskFailed`. ``event`` is the
function's invoke payload (see :mod:`lambdas.handler`); ``priority`` orders calls waiting for a
slot (DESIGN §3: older epoch first, then stage order, then interval). ``concurrency`` may change
between epochs (autotuning); ``take_stats()`` returns and resets the counters (invocations,
relaunches, failed_calls, busy and waiting time); ``await close()`` releases it.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
from typing import Any

# name -> module; modules are imported on first use (the gpu backend imports torch).
BACKENDS = {"lambda": "graphserver.backends.serverless", "cpu": "graphserver.backends.cpu",
            "gpu": "graphserver.backends.gpu"}


def call_key(event: dict[str, Any]) -> tuple:
    """What identifies a call's result: (pass, task, layer, epoch, interval)."""
    return event["pass"], event["task"], event["layer"], event["epoch"], event["interval"]


class Backend(abc.ABC):
    """A place where FUNCTION stages run. Subclasses implement :meth:`execute`, the
    ``concurrency`` property pair, :meth:`take_stats` and :meth:`close`."""

    @classmethod
    def create(cls, server: Any, *, concurrency: int, options: dict[str, Any]) -> Backend:
        """The backend of graph server ``server``. ``options`` are the graph server's backend
        options (``lambda_endpoint``, ``function_name``, ``region``); a backend reads its own."""
        return cls(server, concurrency=concurrency)

    @classmethod
    def make_state(cls, config, part, plan, *, parts: int):
        """The partition state this backend computes on: host numpy unless a backend says otherwise."""
        from graphserver.state import PartitionState

        return PartitionState(part, plan, row_normalize_features=config.row_normalize_features,
                              num_intervals=config.intervals, sparse_features=config.sparse_features)

    def run(self, event: dict[str, Any], priority: tuple = ()) -> asyncio.Future:
        """Start the call; the future resolves with its result meta (see the module doc)."""
        return asyncio.ensure_future(self.execute(event, priority))

    @abc.abstractmethod
    async def execute(self, event: dict[str, Any], priority: tuple) -> dict[str, Any]:
        """Run one call to its end: rows in the graph server's buffers, gradient accepted. Returns its meta."""

    def awaiting(self, key: tuple) -> asyncio.Future | None:
        """The unresolved future of a call whose result is pushed to the graph server (a
        function's PUSH) under ``key`` (:func:`call_key`), else None: a late duplicate, a push
        for a call never made, or a backend whose calls never push (the in-process ones)."""
        return None

    def retarget(self, **target: Any) -> None:
        """Cluster mode: the coordinator's word on where calls go (function name, region,
        endpoint). Only a backend that calls out has anything to change."""

    @property
    @abc.abstractmethod
    def concurrency(self) -> int:
        """Calls admitted at once; settable between epochs."""

    @concurrency.setter
    @abc.abstractmethod
    def concurrency(self, value: int) -> None: ...

    @abc.abstractmethod
    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call (invocations, relaunches, failed_calls, ...), reset."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release threads, clients and connections."""


class LimitedBackend(Backend):
    """A backend whose calls wait for slots of ``self.limiter``
    (:class:`graphserver.limiter.PriorityLimiter`), whose capacity is the concurrency."""

    limiter: Any

    @property
    def concurrency(self) -> int:
        return self.limiter.capacity

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        self.limiter.capacity = value


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND


def make_state(config, part, plan, *, parts: int):
    """The partition state of a graph server of ``config.backend`` (one of ``parts`` servers)."""
    return backend_class(config.backend).make_state(config, part, plan, parts=parts)


def make_backend(name: str, server: Any, *, concurrency: int, options: dict[str, Any] | None = None) -> Backend:
    return backend_class(name).create(server, concurrency=concurrency, options=dict(options or {}))
