"""Calls the tensor function through the AWS Lambda Invoke API with aiobotocore.

The same code talks to AWS Lambda and to the local emulator; only ``endpoint_url`` differs.
Concurrency is bounded by a semaphore; throttling (429 ``TooManyRequestsException``) is retried
with capped exponential backoff and jitter. A function error becomes :class:`TaskFailed`
naming the task, interval, epoch and layer.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any


class TaskFailed(RuntimeError):
    """A tensor task failed or could not be run; the message names task, interval and epoch."""


def describe(event: dict[str, Any]) -> str:
    return (f"{event['task']} interval {event['interval']} epoch {event['epoch']} layer {event['layer']} "
            f"on graph server {event['part']}")


class LambdaInvoker:
    def __init__(self, endpoint_url: str | None, function_name: str, *, concurrency: int, timeout_s: float,
                 region: str = "us-east-1", max_throttle_retries: int = 10, backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0):
        self.endpoint_url = endpoint_url
        self.function_name = function_name
        self.region = region
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.max_throttle_retries = max_throttle_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.throttled = 0
        self._semaphore: asyncio.Semaphore | None = None
        self._client_cm = None
        self._client = None

    async def _ensure_client(self):
        if self._client is None:
            from aiobotocore.session import get_session
            from botocore.config import Config

            config = Config(retries={"total_max_attempts": 1}, read_timeout=self.timeout_s, connect_timeout=10,
                            max_pool_connections=max(10, self.concurrency))
            credentials = {}
            if self.endpoint_url:  # the local emulator does not check signatures
                credentials = {"aws_access_key_id": "local", "aws_secret_access_key": "local"}
            self._client_cm = get_session().create_client("lambda", region_name=self.region,
                                                          endpoint_url=self.endpoint_url, config=config, **credentials)
            self._client = await self._client_cm.__aenter__()
            self._semaphore = asyncio.Semaphore(self.concurrency)
        return self._client

    async def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        """Run one task synchronously (``RequestResponse``) and return the function's result."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = await self._ensure_client()
        payload = json.dumps(event).encode()
        async with self._semaphore:
            for attempt in range(self.max_throttle_retries + 1):
                try:
                    response = await client.invoke(FunctionName=self.function_name,
                                                   InvocationType="RequestResponse", Payload=payload)
                    body = await response["Payload"].read()
                    break
                except ClientError as exc:
                    code = exc.response.get("Error", {}).get("Code")
                    if code == "TooManyRequestsException" and attempt < self.max_throttle_retries:
                        self.throttled += 1
                        delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
                        await asyncio.sleep(delay * (0.5 + random.random() / 2))
                        continue
                    raise TaskFailed(f"{describe(event)}: invoke failed: {code}: {exc}") from None
                except (BotoCoreError, OSError, asyncio.TimeoutError) as exc:
                    raise TaskFailed(f"{describe(event)}: invoke failed: {type(exc).__name__}: {exc}") from None
        try:
            result = json.loads(body) if body else None
        except ValueError:
            raise TaskFailed(f"{describe(event)}: function returned a non-JSON payload") from None
        if response.get("FunctionError"):
            error = result if isinstance(result, dict) else {}
            raise TaskFailed(f"{describe(event)}: function error {error.get('errorType', 'Unhandled')}: "
                             f"{error.get('errorMessage', body[:500])}")
        return result

    async def close(self) -> None:
        if self._client_cm is not None:
            await self._client_cm.__aexit__(None, None, None)
            self._client_cm = self._client = None
