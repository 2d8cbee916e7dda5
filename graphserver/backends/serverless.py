"""The ``lambda`` backend: each stage is a function call through the Lambda Invoke API
(:class:`graphserver.invoker.LambdaInvoker`: relaunch of slow and failed calls, throttling).

A call the functions keep failing (``--fallback-after`` failed attempts, or no result by its
deadline: :class:`graphserver.invoker.AttemptsExhausted`) runs on this graph server through the
cpu backend's code path (:meth:`graphserver.backends.cpu.CpuBackend.compute`: the model's
compute on the server's own rows, weights pulled from and gradients pushed to the parameter
server under the same key as the function's), counted as ``fallback_calls``. Only a task that
fails there too stops the run. A function attempt still in flight that pushes later is dropped
as a duplicate by both servers, so every result and gradient is still taken exactly once.
"""

from __future__ import annotations

import sys
from typing import Any

from graphserver.backends import Backend
from graphserver.invoker import AttemptsExhausted, LambdaInvoker, TaskFailed


class LambdaBackend(Backend):
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

    def retarget(self, function_name: str | None = None, region: str | None = None,
                 lambda_endpoint: str | None = None) -> None:
        """Invoke another function, region or endpoint (cluster mode: the cluster file's, sent
        by the coordinator before the first call)."""
        self.invoker.retarget(function_name=function_name, region=region, endpoint_url=lambda_endpoint)

    async def run(self, event: dict[str, Any], priority: tuple) -> None:
        try:
            await self.invoker.invoke(event, priority)
        except AttemptsExhausted as exc:
            if self.server is None:
                raise
            await self._fallback(event, exc)

    async def _fallback(self, event: dict[str, Any], exc: AttemptsExhausted) -> None:
        server = self.server
        self.fallback_calls += 1
        print(f"graph server {server.part_id}: running on this server: {exc}", file=sys.stderr, flush=True)
        key = (event["pass"], event["task"], event["layer"], event["epoch"], event["interval"])
        if key in server.results:  # a late attempt pushed its result while the last one failed
            return
        if self._local is None:
            from graphserver.backends.cpu import CpuBackend

            self._local = CpuBackend(server, concurrency=server.config.intervals)
        try:
            await self._local.compute(event)
        except Exception as local_exc:
            raise TaskFailed(f"{exc}; then on graph server {server.part_id} itself: "
                             f"{type(local_exc).__name__}: {local_exc}") from local_exc

    def take_stats(self) -> dict[str, Any]:
        stats = self.invoker.take_stats()
        stats["fallback_calls"], self.fallback_calls = self.fallback_calls, 0
        return stats

    async def close(self) -> None:
        await self.invoker.close()
        if self._local is not None:
            await self._local.close()
