"""The ``lambda`` backend: each stage is a function call through the Lambda Invoke API
(:class:`graphserver.invoker.LambdaInvoker`: relaunch of slow and failed calls, throttling)."""

from __future__ import annotations

from typing import Any

from graphserver.backends import Backend
from graphserver.invoker import LambdaInvoker


class LambdaBackend(Backend):
    def __init__(self, config, *, concurrency: int, endpoint_url: str | None, function_name: str,
                 region: str | None = None):
        self.invoker = LambdaInvoker(endpoint_url, function_name, concurrency=concurrency,
                                     timeout_s=config.task_timeout_s, relaunch_min_s=config.relaunch_min_s,
                                     relaunch_ratio=config.relaunch_ratio, max_attempts=config.max_attempts,
                                     region=region)
        self.limiter = self.invoker.limiter

    def retarget(self, function_name: str | None = None, region: str | None = None,
                 lambda_endpoint: str | None = None) -> None:
        """Invoke another function, region or endpoint (cluster mode: the cluster file's, sent
        by the coordinator before the first call)."""
        self.invoker.retarget(function_name=function_name, region=region, endpoint_url=lambda_endpoint)

    async def run(self, event: dict[str, Any], priority: tuple) -> None:
        await self.invoker.invoke(event, priority)

    def take_stats(self) -> dict[str, Any]:
        return self.invoker.take_stats()

    async def close(self) -> None:
        await self.invoker.close()
