"""The ``lambda`` backend: each stage is a function call through the Lambda Invoke API
(:class:`graphserver.invoker.LambdaInvoker`: relaunch of slow and failed calls, throttling).

A call the functions keep failing (``--fallback-after`` failed attempts, or no result by its
deadline: :class:`graphserver.invoker.AttemptsExhausted`) runs on this graph server through the
cpu backend's code path (:meth:`graphserver.backends.cpu.CpuBackend.compute`: the model's
compute on the server's own rows, weights pulled from and gradients pushed to the parameter
server under the same key as the function's), counted as ``fallback_calls``. Only a task that
fails there too stops the run. A function attempt still in flight that pushes later is dropped
as a duplicate by both servers, so every result and gradient is still taken exactly once.

A function pushes its gradient and its rows at once, so a failed attempt may have delivered
either without the other; relaunches and the fallback settle both:

* gradient in, rows not (a crash or a failed push between the two): a relaunch computes with the
  same stashed weights; its gradient is dropped as a duplicate, its rows are the first. If the
  gradient completed its epoch, the step released the stash: the relaunch is refused
  (``StashReleased``, no more attempts) and the fallback, finding the epoch stepped, has nothing
  left to do, since only a stage that writes no rows (layer 0's backward) can complete an epoch.
* rows in, gradient not: a relaunch pushes the gradient; the fallback computes here for the
  gradient alone and keeps the rows already written.
* a late push of an earlier attempt, after the call has its rows: dropped (the graph server takes
  the first push of a call in progress only, and the key names pass, task, layer, epoch and
  interval, so no other call's push is taken for it).

A call's result arrives as the function's PUSH to the graph server, which resolves the call's
future (:meth:`LambdaBackend.awaiting`); the call's own future resolves with that result once
the invoke has returned too, because the function pushes its rows and its gradient at once and
only the invoke's success says that the parameter server acknowledged the gradient. A stage
that writes no rows (layer 0's backward) pushes nothing to the graph server: its result (the
weights' version, the loss stage's counts) is the invoke's answer, one round trip less a call.

A stage that is not worth an invoke runs on this graph server through the same cpu code path,
its weights pulled from (and any gradient pushed to) the parameter server as a function's would
be (:meth:`LambdaBackend.stage_on_server`, priced by its model's ``stage_work`` on the interval's
rows): work that is element-wise only with no gradient, at any size (GCN's and GAT's ``BIAS``,
``Y = G + b``: locally an invoke of it cost 35-50 ms of the epoch's critical path, the invoke, a
pull and a push of the interval's rows, for an add of well under a millisecond), and small work
with no dropout mask to regenerate: at most ``server_stage_ops`` multiply-adds, elements and
logits (:data:`SERVER_STAGE_OPS` by default, a few milliseconds of one core, less than an
invoke's own latency). Those calls count in ``invocations`` of :meth:`take_stats` (the ``calls``
metric), not in the bill.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from dorylus.errors import ConfigError
from dorylus.lambda_limits import MAX_TIMEOUT_S, MEMORY_RANGE_MB
from dorylus.models import stage_cost
from dorylus.models.base import Work
from graphserver.backends import LimitedBackend, LocalServices, call_key
from graphserver.invoker import AttemptsExhausted, LambdaInvoker, TaskFailed, describe

logger = logging.getLogger(__name__)

# A local lambda run gives every call in flight an emulator worker process (numpy, pyzmq and the
# handler: ~20 MB resident when idle, a call's rows on top). A machine starts at most one per
# WORKER_MB of available memory and WORKERS_PER_CPU per core, whichever is fewer.
WORKER_MB = 256
WORKERS_PER_CPU = 32
# A stage of at most this many multiply-adds, elements and logits on its interval, with no dropout
# mask to regenerate, runs on its graph server (module docstring): a few milliseconds of one core,
# less than an invoke's own latency.
SERVER_STAGE_OPS = 1 << 24
MAX_SERVER_STAGE_OPS = 1 << 40
# Failed attempts of one call before its graph server runs it: each is an invoke billed, and up to
# this many attempts of a straggling call may be in flight at once.
MAX_FALLBACK_AFTER = 100


def local_worker_capacity() -> tuple[int, str]:
    """How many emulator worker processes this machine can run, and why: one per
    :data:`WORKER_MB` of available memory, at most :data:`WORKERS_PER_CPU` per core."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available_mb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available_mb = int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    by_cpu = WORKERS_PER_CPU * cpus
    if available_mb is None:
        return by_cpu, f"{WORKERS_PER_CPU} per core x {cpus} cores"
    by_memory = max(1, available_mb // WORKER_MB)
    if by_memory < by_cpu:
        return by_memory, f"{available_mb:,} MB available / {WORKER_MB} MB per worker"
    return by_cpu, f"{WORKERS_PER_CPU} per core x {cpus} cores"


def emulator_physics(config):
    """The emulator's :class:`~dorylus.emulator.physics.Physics` from the config's ``lambda_*``
    options, or the measured AWS figures with ``aws_like``."""
    from dorylus.emulator.physics import AWS_LIKE, Physics

    if config.aws_like:
        return AWS_LIKE
    return Physics(start_latency_ms=config.lambda_start_latency_ms, cold_start_ms=config.lambda_cold_start_ms,
                   keep_warm_s=config.lambda_keep_warm_s, bandwidth_mbps=config.lambda_bandwidth_mbps,
                   cpu_share=config.lambda_cpu_share)


def call_affinity(payload: bytes) -> tuple[int, int]:
    """A call's (part, interval), from its event: the local emulator gives the calls of one
    interval the sandbox that last ran one, whose cache holds that interval's static rows (with
    the most recent warm sandbox instead, every sandbox came to cache most intervals' features:
    0.55 GiB each on an ogbn-products-sized graph)."""
    event = json.loads(payload)
    return int(event["part"]), int(event["interval"])


def emulator_workers(config, parts: int) -> int:
    """Emulator worker processes a local run of ``parts`` graph servers needs: every call a
    server may have in flight (:func:`graphserver.modes.calls_at_once`: twice the intervals where
    evaluation runs beside training), and one more per server, since relaunched attempts run
    beside stragglers. With fewer, the emulator answers the extra calls 429 and botocore sleeps
    before retrying, on the epoch's critical path."""
    from graphserver.modes import calls_at_once, get_mode

    mode = get_mode(config.mode, config.staleness)
    return parts * (calls_at_once(mode, config.intervals, config.functions) + 1)


class LambdaBackend(LimitedBackend):
    calls_functions = True
    # The functions cache their interval's features (lambdas.handler): the server reads them from
    # the store on a miss (and for a call it runs itself) instead of holding them.
    features_stored = True
    # Lambda's calls need no cores of their own on the graph server's instance: the table at
    # scale starts from one interval and searches counts and memory sizes (dorylus.plan.planner).

    @classmethod
    def check_config(cls, config) -> list[tuple[bool, str]]:
        return [
            (config.task_timeout_s <= MAX_TIMEOUT_S,
             f"task_timeout_s must be <= {MAX_TIMEOUT_S:.0f} with the lambda backend (Lambda's limit), "
             f"got {config.task_timeout_s:g}"),
            (1 <= config.fallback_after <= MAX_FALLBACK_AFTER,
             f"fallback_after must be in [1, {MAX_FALLBACK_AFTER}], got {config.fallback_after}"),
            (config.lambda_cold_start_ms >= 0 and config.lambda_keep_warm_s >= 0 and config.lambda_bandwidth_mbps >= 0,
             "lambda_cold_start_ms, lambda_keep_warm_s and lambda_bandwidth_mbps must be >= 0"),
            (all(0.0 <= f <= 1.0 for f in (config.fault_raise, config.fault_crash, config.fault_hang,
                                           config.fault_straggle))
             and config.fault_raise + config.fault_crash + config.fault_hang + config.fault_straggle <= 1.0,
             "fault fractions must be in [0, 1] and sum to at most 1"),
            (config.fault_straggle_factor >= 1, "fault_straggle_factor must be >= 1"),
            (isinstance(config.server_stage_ops, int) and 0 <= config.server_stage_ops <= MAX_SERVER_STAGE_OPS,
             f"server_stage_ops must be an integer in [0, 2^40], got {config.server_stage_ops!r}"),
            (MEMORY_RANGE_MB[0] <= config.lambda_memory_mb <= MEMORY_RANGE_MB[1],
             f"lambda_memory_mb must be in [{MEMORY_RANGE_MB[0]}, {MEMORY_RANGE_MB[1]}] (Lambda's range), "
             f"got {config.lambda_memory_mb}"),
            (config.lambda_start_latency_ms >= 0, "lambda_start_latency_ms must be >= 0"),
        ]

    @classmethod
    def check_machine(cls, config, parts: int | None = None) -> None:
        """The ``function_handler`` imports (a typo fails here in one line instead of in every
        function call), and this machine can start an emulator worker for every call the graph
        servers may have in flight."""
        module_name, _, attr = config.function_handler.partition(":")
        try:
            handler = getattr(importlib.import_module(module_name), attr) if module_name and attr else None
        except Exception as exc:  # any import failure of user code is a config error here
            raise ConfigError(f"invalid config: function_handler {config.function_handler!r} does not import: "
                              f"{type(exc).__name__}: {exc}") from None
        if not callable(handler):
            raise ConfigError(f"invalid config: function_handler {config.function_handler!r} is not a "
                              "module:callable")
        parts = parts or config.parts or 2
        workers = emulator_workers(config, parts)
        per_server = workers // parts - 1
        capacity, why = local_worker_capacity()
        if workers > capacity:
            flag = "--functions" if config.functions else "--intervals (--functions' default)"
            raise ConfigError(f"invalid config: {flag} {config.functions or config.intervals} needs {parts} x "
                              f"({per_server} + 1) = {workers} "
                              f"emulator workers, more than this machine can start ({capacity}: {why}); use "
                              f"--functions {max(1, capacity // parts - 1)} or fewer")

    @classmethod
    @contextlib.contextmanager
    def local_services(cls, config, parts: int, keys_dir=None) -> Iterator[LocalServices]:
        """The local Lambda emulator running ``config.function_handler`` as
        :data:`dorylus.function.FUNCTION_NAME`, with a worker for every call :func:`emulator_workers` counts, the config's physics and
        faults, and the function's CURVE keys from ``keys_dir``."""
        from dorylus import curve
        from dorylus.emulator import serve
        from dorylus.emulator.faults import FaultPlan
        from dorylus.function import FUNCTION_NAME

        c = config
        emulator = serve(functions={FUNCTION_NAME: c.function_handler}, concurrency=emulator_workers(c, parts),
                         memory_mb=c.lambda_memory_mb, timeout_s=c.task_timeout_s, physics=emulator_physics(c),
                         faults=FaultPlan(raise_fraction=c.fault_raise, crash_fraction=c.fault_crash,
                                          hang_fraction=c.fault_hang, straggle_fraction=c.fault_straggle,
                                          straggle_factor=c.fault_straggle_factor, seed=c.fault_seed),
                         environment=curve.function_environment(keys_dir) if keys_dir is not None else None,
                         affinity=call_affinity)
        try:
            yield LocalServices(["--lambda-endpoint", emulator.url, "--function-name", FUNCTION_NAME], emulator.stats)
        finally:
            emulator.close()

    @classmethod
    def cluster_target(cls, spec) -> dict[str, Any]:
        """The cluster file's function, region and (if set) endpoint."""
        f = spec.function
        return {"function_name": f.name, "region": spec.region,
                **({"lambda_endpoint": f.endpoint_url} if f.endpoint_url else {})}

    @classmethod
    def scale_intervals(cls, machine) -> int:
        """One: the planner then searches interval counts and function sizes (its table at scale)."""
        return 1

    def __init__(self, config, *, concurrency: int, endpoint_url: str | None, function_name: str,
                 region: str | None = None, server: Any = None):
        self.invoker = LambdaInvoker(endpoint_url, function_name, concurrency=concurrency,
                                     timeout_s=config.task_timeout_s, relaunch_min_s=config.relaunch_min_s,
                                     relaunch_ratio=config.relaunch_ratio, fallback_after=config.fallback_after,
                                     region=region)
        self.limiter = self.invoker.limiter
        self.server = server  # the graph server whose rows a fallback computes on (None: no fallback)
        self._local = None
        self.fallback_calls = 0
        self.server_calls = 0  # stages run here instead of in a function (module docstring)
        self._on_server: dict[tuple, bool] = {}  # (pass, task, layer, rows) -> whether its stage runs here
        self._pushes: dict[tuple, asyncio.Future] = {}  # calls in progress -> their result, set by the first push

    @classmethod
    def create(cls, server, *, concurrency: int, options: dict[str, Any]) -> LambdaBackend:
        return cls(server.config, concurrency=concurrency, endpoint_url=options.get("lambda_endpoint"),
                   function_name=options["function_name"], region=options.get("region"),
                   server=server)

    def retarget(self, function_name: str | None = None, region: str | None = None,
                 lambda_endpoint: str | None = None) -> None:
        """Invoke another function, region or endpoint (cluster mode: the cluster file's, sent
        by the coordinator before the first call)."""
        self.invoker.retarget(function_name=function_name, region=region, endpoint_url=lambda_endpoint)

    def awaiting(self, key: tuple) -> asyncio.Future | None:
        pushed = self._pushes.get(key)
        return pushed if pushed is not None and not pushed.done() else None

    @classmethod
    def stage_on_server(cls, work: Work, grad: bool, small: int = SERVER_STAGE_OPS) -> bool:
        """A stage not worth an invoke (module docstring): element-wise work only and no gradient,
        or at most ``small`` operations (``server_stage_ops``) and no dropout mask."""
        if work.macs == work.dropout == work.softmax == 0 and not grad:
            return True
        return work.dropout == 0 and work.macs + work.elementwise + work.softmax <= small

    def runs_on_server(self, event: dict[str, Any]) -> bool:
        """Whether ``event``'s stage runs on this graph server (:meth:`stage_on_server`)."""
        spec = getattr(self.server, "spec", None)  # the model's layers; without them every stage is a call
        if spec is None:
            return False
        start, stop = event["rows"]
        key = (event["pass"], event["task"], event["layer"], stop - start)
        if key not in self._on_server:
            work = stage_cost(event["model"], event["task"], event["args"], spec.layers[event["layer"]], stop - start,
                              event["pass"] == "train")
            # no formula: nothing says it is small
            self._on_server[key] = work is not None and self.stage_on_server(
                work, bool(event["grad"]), self.server.config.server_stage_ops)
        return self._on_server[key]

    async def execute(self, event: dict[str, Any], priority: tuple) -> dict[str, Any]:
        if self.runs_on_server(event):
            self.server_calls += 1
            rows, meta = await self._local_backend().compute(event)
            self.server.write_result(call_key(event), rows)
            return meta
        key = call_key(event)
        pushed = self._pushes[key] = asyncio.get_running_loop().create_future()
        try:
            try:
                answer = await self.invoker.invoke(event, priority)
            except AttemptsExhausted as exc:
                if self.server is None:
                    raise
                await self._fallback(event, exc, pushed)
            else:
                result = (answer or {}).get("result")  # lambdas/handler.py's summary
                if not pushed.done() and not event["writes"] and isinstance(result, dict):  # nothing to push
                    pushed.set_result(result)
            if not pushed.done():
                raise TaskFailed(f"{describe(event)}: the function returned without pushing its result")
            return pushed.result()
        finally:
            del self._pushes[key]

    async def _fallback(self, event: dict[str, Any], exc: AttemptsExhausted, pushed: asyncio.Future) -> None:
        """Run the call here. Its attempts may have failed between their two pushes (module
        docstring): rows in but the gradient maybe not, or the reverse."""
        server = self.server
        self.fallback_calls += 1
        logger.warning("running on this server: %s", exc)  # the role (graphserver-N) heads every line
        if pushed.done() and not event["grad"]:  # a late attempt pushed its result while the last one failed
            return
        try:  # with the rows already in, for the gradient alone (a duplicate if an attempt pushed it)
            rows, meta = await self._local_backend().compute(event)
        except Exception as local_exc:
            if not (event["grad"] and await self._stepped(event["epoch"])):
                raise TaskFailed(f"{exc}; then on graph server {server.part_id} itself: "
                                 f"{type(local_exc).__name__}: {local_exc}") from local_exc
            # A step takes every gradient of its epoch, this call's included (an attempt pushed it
            # before failing); the step released the weights its rows would need. Only a stage that
            # writes none can be here: every other gradient of the epoch waits for its rows.
            if event["writes"] and not pushed.done():
                raise TaskFailed(f"{exc}; its gradient was applied, but epoch {event['epoch']} was stepped before "
                                 f"its rows {list(event['writes'])} were written") from local_exc
            rows, meta = [], {}
        if not pushed.done():  # else a late attempt's push won while this one computed
            server.write_result(call_key(event), rows)
            pushed.set_result(meta)

    async def _stepped(self, epoch: int) -> bool:
        """Whether the parameter server has stepped ``epoch`` (version ``v`` is the weights after
        epoch ``v``'s step, as the scheduler's weight waits assume)."""
        return await self.server.wait_version(0) >= epoch

    def _local_backend(self):
        """The cpu backend's code path on this graph server (fallbacks, stages run here)."""
        if self._local is None:
            from graphserver.backends.cpu import CpuBackend

            self._local = CpuBackend(self.server, concurrency=self.server.config.intervals)
        return self._local

    def take_stats(self) -> dict[str, Any]:
        stats = self.invoker.take_stats()
        stats["invocations"] += self.server_calls  # calls made, as the cpu backend counts its own
        self.server_calls = 0
        stats["fallback_calls"], self.fallback_calls = self.fallback_calls, 0
        return stats

    async def close(self) -> None:
        await self.invoker.close()
        if self._local is not None:
            await self._local.close()


BACKEND = LambdaBackend
