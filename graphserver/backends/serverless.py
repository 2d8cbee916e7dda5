"""The ``lambda`` backend: each stage is a function call through the Lambda Invoke API
(:class:`graphserver.invoker.LambdaInvoker`: relaunch of slow and failed calls, throttling).

A call the functions keep failing (``--fallback-after`` failed attempts, or no result by its
deadline: :class:`graphserver.invoker.AttemptsExhausted`) runs on this graph server through the
cpu backend's code path (:meth:`graphserver.backends.cpu.CpuBackend.compute`: the model's
compute on the server's own rows, weights pulled from and gradients pushed to the parameter
server under the same key as the function's), counted as ``fallback_calls``. Only a task that
fails there too stops the run. A function attempt still in flight that pushes later is dropped
as a duplicate by both servers, so every result and gradient is still taken exactly once.

A call's result arrives as the function's PUSH to the graph server, which resolves the call's
future (:meth:`LambdaBackend.awaiting`); the call's own future resolves with that result once
the invoke has returned too, because the function pushes its rows and its gradient at once and
only the invoke's success says that the parameter server acknowledged the gradient.

A stage whose work is element-wise only and that pushes no gradient (by its model's
``stage_work``: no product, no dropout, no loss; GCN's and GAT's ``BIAS``, ``Y = G + b``) is not
worth an invoke: it runs on this graph server through the same cpu code path, its weights
pulled from the parameter server as a function's would be. Locally an invoke of it cost 35-50 ms
of the epoch's critical path (the invoke, a pull and a push of the interval's rows) for an add
of well under a millisecond. Those calls count in ``invocations`` of :meth:`take_stats` (the
``calls`` metric), not in the bill.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from dorylus.models import get_model
from dorylus.models.base import Work
from graphserver.backends import LimitedBackend, call_key
from graphserver.invoker import AttemptsExhausted, LambdaInvoker, TaskFailed, describe


class LambdaBackend(LimitedBackend):
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
        self._on_server: dict[tuple, bool] = {}  # (pass, task, layer) -> whether its stage runs here
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

    def runs_on_server(self, event: dict[str, Any]) -> bool:
        """Whether ``event``'s stage runs on this graph server (module docstring)."""
        spec = getattr(self.server, "spec", None)  # the model's layers; without them every stage is a call
        if spec is None or event["grad"]:
            return False
        key = (event["pass"], event["task"], event["layer"])
        if key not in self._on_server:
            work = get_model(event["model"]).stage_work(event["task"], event["args"], spec.layers[event["layer"]], 1.0,
                                                        event["pass"] == "train", Work())
            self._on_server[key] = work is not None and work.macs == work.dropout == work.softmax == 0
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
                await self.invoker.invoke(event, priority)
            except AttemptsExhausted as exc:
                if self.server is None:
                    raise
                await self._fallback(event, exc, pushed)
            if not pushed.done():
                raise TaskFailed(f"{describe(event)}: the function returned without pushing its result")
            return pushed.result()
        finally:
            del self._pushes[key]

    async def _fallback(self, event: dict[str, Any], exc: AttemptsExhausted, pushed: asyncio.Future) -> None:
        server = self.server
        self.fallback_calls += 1
        print(f"graph server {server.part_id}: running on this server: {exc}", file=sys.stderr, flush=True)
        if pushed.done():  # a late attempt pushed its result while the last one failed
            return
        try:
            rows, meta = await self._local_backend().compute(event)
        except Exception as local_exc:
            raise TaskFailed(f"{exc}; then on graph server {server.part_id} itself: "
                             f"{type(local_exc).__name__}: {local_exc}") from local_exc
        if not pushed.done():  # else a late attempt's push won while this one computed
            server.write_result(call_key(event), rows)
            pushed.set_result(meta)

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
