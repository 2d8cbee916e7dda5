"""The ``lambda`` backend: each stage is a function call through the Lambda Invoke API
(:class:`graphserver.invoker.LambdaInvoker`: relaunch of slow and failed calls, throttling)."""

from __future__ import annotations

from typing import Any

from graphserver.backends import Backend
from graphserver.invoker import LambdaInvoker


class LambdaBackend(Backend):
    def __init__(self, config, *, concurrency: int, endpoint_url: str | None, function_name: str):
        self.invoker = LambdaInvoker(endpoint_url, function_name, concurrency=concurrency,
                                     timeout_s=config.task_timeout_s, relaunch_min_s=config.relaunch_min_s,
                                     relaunch_ratio=config.relaunch_ratio, max_attempts=config.max_attempts)
        self.limiter = self.invoker.limiter

    async def run(self, event: dict[str, Any], priority: tuple) -> None:
        await self.invoker.invoke(event, priority)

    def take_stats(self) -> dict[str, Any]:
        return self.invoker.take_stats()

    async def close(self) -> None:
        await self.invoker.close()
