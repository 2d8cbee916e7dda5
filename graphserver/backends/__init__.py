"""What ``--backend NAME`` means (DESIGN §7): one module per backend, named in :data:`BACKENDS`,
each exposing its class as ``BACKEND``. :func:`backend_class` reads the registry; nothing else
names a backend.

Every backend is a :class:`RunBackend`: what a run asks of it before and around training, all
class-level, so that the coordinator, the config and the planner ask it without a graph server:

* :meth:`~RunBackend.check_config`: the options it owns and the combinations it refuses, called
  by :meth:`dorylus.config.TrainConfig.validate` for the run's backend;
* :meth:`~RunBackend.check_machine`: what must hold on this machine before anything is written
  (the lambda backend's handler imports and its emulator workers fit; the gpu backend's device
  exists);
* :meth:`~RunBackend.local_services`: what a local run starts beside its roles (the lambda
  backend's emulator) and the arguments the graph servers get to reach it;
* :meth:`~RunBackend.cluster_target`: cluster mode's word to the graph servers on where calls go;
* pricing: :attr:`~RunBackend.graph_server_instance`, :attr:`~RunBackend.calls_functions`,
  :attr:`~RunBackend.device`, :attr:`~RunBackend.scale_instance` and
  :meth:`~RunBackend.scale_intervals`, read by :mod:`dorylus.cost` and :mod:`dorylus.plan`;
* :attr:`~RunBackend.graph_servers`: False for the one backend that trains in the coordinator's
  process (``reference``): no partition store, parameter server or cluster mode.

A backend with graph servers is also a :class:`Backend`, where a graph server's FUNCTION stages
run. ``backend.run(event, priority)`` returns a future resolved with the call's result (the
stage's ``meta``: loss, accuracy counts, weight version and lag) once its rows are in the graph
server's buffers and its gradient (if any) has been accepted by the parameter server, or failed
with :class:`graphserver.invoker.TaskFailed`. ``event`` is the function's invoke payload (see
:mod:`lambdas.handler`); ``priority`` orders calls waiting for a slot (DESIGN §3: older epoch
first, then stage order, then interval). ``concurrency`` may change between epochs
(autotuning); ``take_stats()`` returns and resets the counters (invocations, relaunches,
failed_calls, busy and waiting time); ``await close()`` releases it.

A backend's module is imported when the config names it: it loads nothing heavy at import
(torch is imported where a graph server first needs it; the gpu backend's device side is a
module of its own, :mod:`graphserver.backends.gpu_device`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

# name -> module, in the order `--backend` and `dorylus plan` list them.
BACKENDS = {"lambda": "graphserver.backends.serverless", "cpu": "graphserver.backends.cpu",
            "gpu": "graphserver.backends.gpu", "reference": "graphserver.backends.reference"}


def call_key(event: dict[str, Any]) -> tuple:
    """What identifies a call's result: (pass, task, layer, epoch, interval)."""
    return event["pass"], event["task"], event["layer"], event["epoch"], event["interval"]


@dataclass
class LocalServices:
    """What a local run's backend started beside its roles: ``graph_server_args`` for every
    graph server's command line, and ``stats()``, the services' counters so far (the emulator's
    billed GB-seconds and requests; empty without services)."""

    graph_server_args: list[str] = field(default_factory=list)
    stats: Callable[[], dict[str, Any]] = dict


class RunBackend:
    """What ``--backend`` names (see the module doc). The defaults are a backend whose graph
    servers do the tensor work on their CPU cores and that starts nothing of its own."""

    # Whether the run has graph servers (and a partition store and a parameter server).
    graph_servers = True
    # The EC2 instance a graph server is priced at when the config names none.
    graph_server_instance = "c5.2xlarge"
    # Whether FUNCTION stages are billed calls (per request and GB-second at lambda_memory_mb),
    # which the planner prices with a function's rates and links.
    calls_functions = False
    # Where a graph server's tensor work runs: "cpu" (its cores, host memory) or "gpu" (one GPU,
    # device memory): the planner's rates, memory model and instance family.
    device = "cpu"
    # The graph-server instance of this backend's row in `dorylus plan`'s table at scale.
    scale_instance = "c5n.2xlarge"
    # Whether a graph server leaves dense features in the store (graphserver.state.StoredRows)
    # instead of memory: for a backend whose functions cache their interval's static rows, so
    # that the server reads them only when a cache misses (and the planner counts none).
    features_stored = False

    @classmethod
    def stage_on_server(cls, work, grad: bool, small: int = 0) -> bool:
        """Whether a FUNCTION stage of ``work`` on one interval (:class:`dorylus.models.base.Work`;
        ``grad``: it pushes a gradient; ``small``: the config's ``server_stage_ops``) runs on the
        graph server itself rather than as a billed call: always, unless the backend calls functions."""
        return not cls.calls_functions

    @classmethod
    def check_config(cls, config) -> list[tuple[bool, str]]:
        """``(ok, message)`` for the options this backend owns and the combinations it refuses;
        :meth:`dorylus.config.TrainConfig.validate` raises the first that fails."""
        return []

    @classmethod
    def check_machine(cls, config, parts: int | None = None) -> None:
        """What must hold on this machine before a local run (of ``parts`` graph servers, default
        the config's) writes anything; raises :class:`dorylus.errors.ConfigError`."""

    @classmethod
    @contextlib.contextmanager
    def local_services(cls, config, parts: int, keys_dir=None) -> Iterator[LocalServices]:
        """Start what a local run of ``parts`` graph servers needs beside its roles (``keys_dir``:
        the run's CURVE keys, None without); stopped when the context exits."""
        yield LocalServices()

    @classmethod
    def cluster_target(cls, spec) -> dict[str, Any]:
        """Cluster mode: the coordinator's word to each graph server on where calls go (its
        ``retarget`` arguments), from the cluster file ``spec``."""
        return {}

    @classmethod
    def scale_intervals(cls, machine) -> int:
        """Intervals per graph server in the table at scale on instance ``machine``
        (:class:`dorylus.plan.catalog.Instance`): one per vCPU, each a thread of the server."""
        return machine.vcpus


class Backend(RunBackend, abc.ABC):
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
                              num_intervals=config.intervals, sparse_features=config.sparse_features,
                              features_stored=cls.features_stored)

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


def backend_class(name: str) -> type[RunBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND


def graph_server_backend(name: str) -> type[Backend]:
    """The class of backend ``name``, which must run graph servers."""
    cls = backend_class(name)
    if not issubclass(cls, Backend):
        raise ValueError(f"backend {name!r} runs no graph server")
    return cls


def make_state(config, part, plan, *, parts: int):
    """The partition state of a graph server of ``config.backend`` (one of ``parts`` servers)."""
    return graph_server_backend(config.backend).make_state(config, part, plan, parts=parts)


def make_backend(name: str, server: Any, *, concurrency: int, options: dict[str, Any] | None = None) -> Backend:
    return graph_server_backend(name).create(server, concurrency=concurrency, options=dict(options or {}))
