"""Calls the tensor function through the AWS Lambda Invoke API with aiobotocore.

The same code talks to AWS Lambda and to the local emulator; only ``endpoint_url`` differs.

* Concurrency: each :meth:`LambdaInvoker.invoke` holds one slot of a :class:`PriorityLimiter`
  (``invoker.limiter``) for its whole life; queued calls are admitted lowest priority tuple first
  (Dorylus's task priorities, DESIGN §3). ``invoker.concurrency = n`` changes the capacity while
  running (an autotuner may set it between epochs).
* Throttling (429 ``TooManyRequestsException``) and other transient answers (5xx) are retried
  inside an attempt by botocore's ``standard`` retry mode (exponential backoff with jitter, at
  most ``max_throttle_retries`` retries); they are not a failed attempt unless the retries run
  out. Botocore does not resend a request that got no answer (refused, reset, read timeout): that
  fails the attempt, and relaunch below, not a resend of the same attempt, deals with it.
* Relaunch (DESIGN §3): attempt 0 is sent with ``event["attempt"] = 0``. When the newest attempt
  fails (function error, including a crashed sandbox ``Runtime.ExitError`` and a timeout
  ``Sandbox.Timedout``; an invoke error; a client read timeout) or has not answered within
  :meth:`LambdaInvoker.relaunch_after` seconds of being sent, a copy of the event with the next
  ``attempt`` number is launched, up to ``max_attempts`` in all. A straggler keeps running beside
  its relaunch; the first success wins and is returned, and the other attempts still in flight are
  then cancelled (only the HTTP request: a running function cannot be stopped, and the graph and
  parameter servers keep the first push per key and acknowledge late duplicates). A failure of an
  attempt that was already superseded launches nothing. When every attempt has failed,
  :class:`TaskFailed` names the task, the number of attempts and the last error. API errors that
  would fail the same way again (unknown function, payload too large or not JSON, bad parameter)
  end the call at once.
* Relaunched attempts never queue in the limiter: they run under the slot their call already
  holds, so with a straggler still running a call has two or more attempts in flight and
  ``in_flight`` may exceed ``concurrency`` (by at most ``max_attempts - 1`` per straggling call).
  They therefore never wait behind lower-priority calls and cannot deadlock at capacity 1. Should
  that overflow exceed the account's concurrency, Lambda answers 429 and the attempt backs off.
  Time spent backing off does not count towards the relaunch deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import time
from typing import Any

from graphserver.limiter import PriorityLimiter


class TaskFailed(RuntimeError):
    """A tensor task failed or could not be run; the message names task, interval and epoch."""


def describe(event: dict[str, Any]) -> str:
    return (f"{event['task']} interval {event['interval']} epoch {event['epoch']} layer {event['layer']} "
            f"on graph server {event['part']}")


# Invoke API errors that a new attempt would meet again: the call fails at once.
FATAL_API_ERRORS = frozenset({"ResourceNotFoundException", "RequestTooLargeException",
                              "InvalidRequestContentException", "InvalidParameterValueException"})
DURATION_WINDOW = 20  # successful calls per task kind in the moving mean


class _AttemptFailed(Exception):
    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class _Attempt:
    __slots__ = ("number", "sent_at", "task")

    def __init__(self, number: int, now: float):
        self.number = number
        self.sent_at: float | None = now  # when its request was last sent; None while backing off
        self.task: asyncio.Task | None = None


# The attempt whose request botocore is sending: each attempt runs in a task of its own, and
# botocore's event hooks run in the task that makes the call.
_ATTEMPT: contextvars.ContextVar[_Attempt] = contextvars.ContextVar("dorylus_invoke_attempt")


class LambdaInvoker:
    def __init__(self, endpoint_url: str | None, function_name: str, *, concurrency: int, timeout_s: float,
                 relaunch_min_s: float = 5.0, relaunch_ratio: float = 3.0, max_attempts: int = 4,
                 region: str | None = None, max_throttle_retries: int = 10):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        self.endpoint_url = endpoint_url
        self.function_name = function_name
        self.region = region
        self.timeout_s = timeout_s
        self.relaunch_min_s = relaunch_min_s
        self.relaunch_ratio = relaunch_ratio
        self.max_attempts = max_attempts
        self.max_throttle_retries = max_throttle_retries
        self.limiter = PriorityLimiter(concurrency)
        self.throttled = 0  # since creation; take_stats() reports per interval
        self._counts = dict.fromkeys(("invocations", "relaunches", "failed_calls", "throttled"), 0)
        self._durations: dict[str, collections.deque[float]] = {}
        self._attempt_tasks: set[asyncio.Task] = set()
        self._client_lock = asyncio.Lock()
        self._closed = False
        self._client_cm = None
        self._client = None

    # -- knobs and accounting -------------------------------------------------------------------

    @property
    def concurrency(self) -> int:
        """Calls admitted at once (the limiter's capacity); settable while running."""
        return self.limiter.capacity

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        self.limiter.capacity = value

    @property
    def in_flight(self) -> int:
        """Attempts whose request is in flight now (relaunches included)."""
        return len(self._attempt_tasks)

    def take_stats(self) -> dict[str, Any]:
        """Return and reset the counts since the previous call: ``invocations`` (attempts
        launched), ``relaunches`` (attempts beyond the first), ``failed_calls`` (attempts that
        failed), ``throttled`` (429 answers; botocore retries each while its retries last), plus
        the limiter's ``busy_s``, ``wait_s``, ``max_waiting``, ``capacity`` and ``interval_s``."""
        stats = dict(self._counts)
        self._counts = dict.fromkeys(self._counts, 0)
        stats.update(self.limiter.take_stats())
        return stats

    def note_duration(self, task: str, seconds: float) -> None:
        """Record a successful call's duration for the moving mean of its task kind."""
        self._durations.setdefault(task, collections.deque(maxlen=DURATION_WINDOW)).append(seconds)

    def relaunch_after(self, task: str) -> float:
        """Seconds an attempt of this task kind may run before a new one is launched:
        ``max(relaunch_min_s, relaunch_ratio * mean)`` over the last 20 successful calls of the
        kind, ``timeout_s`` before any, and never more than ``timeout_s`` (by then the request
        has timed out anyway)."""
        durations = self._durations.get(task)
        if not durations:
            return self.timeout_s
        mean = sum(durations) / len(durations)
        return min(self.timeout_s, max(self.relaunch_min_s, self.relaunch_ratio * mean))

    # -- client ---------------------------------------------------------------------------------

    def retarget(self, *, function_name: str | None = None, region: str | None = None,
                 endpoint_url: str | None = None) -> None:
        """Call ``function_name`` in ``region`` at ``endpoint_url`` from now on (each only if
        given). Only before the first call: the client is made for one region and endpoint."""
        if self._client is not None:
            raise RuntimeError("the invoker cannot change its function, region or endpoint after the first call")
        self.function_name = function_name or self.function_name
        self.region = region or self.region
        self.endpoint_url = endpoint_url or self.endpoint_url

    def _region(self) -> str | None:
        """The region given, else AWS's own settings (``AWS_REGION``, ``AWS_DEFAULT_REGION``, the
        config file); for an endpoint override (the emulator) any region will do."""
        if self.region:
            return self.region
        if self.endpoint_url:
            return "us-east-1"
        return None

    async def _ensure_client(self):
        async with self._client_lock:
            if self._client is None:
                from aiobotocore.session import get_session
                from botocore.config import Config

                # Connections open on demand, so a generous pool costs nothing and lets the
                # concurrency (and relaunches beyond it) grow at run time. "standard", not "adaptive":
                # Lambda's 429 here is a limit on calls in flight, not on their rate, and adaptive
                # mode would slow every call of the client down after one.
                config = Config(retries={"mode": "standard", "max_attempts": self.max_throttle_retries},
                                read_timeout=self.timeout_s, connect_timeout=10,
                                max_pool_connections=max(256, 2 * self.concurrency))
                credentials = {}
                if self.endpoint_url:  # the local emulator does not check signatures
                    credentials = {"aws_access_key_id": "local", "aws_secret_access_key": "local"}
                from botocore.exceptions import NoRegionError

                try:
                    cm = get_session().create_client("lambda", region_name=self._region(),
                                                     endpoint_url=self.endpoint_url, config=config, **credentials)
                    client = await cm.__aenter__()
                except NoRegionError:
                    raise TaskFailed(f"cannot invoke {self.function_name}: no AWS region (give the graph server "
                                     "--region, set AWS_REGION, or name it in the cluster file)") from None
                # Specific to Invoke, so these run before botocore's retry handler (on all of Lambda).
                client.meta.events.register("before-send.lambda.Invoke", self._on_send)
                client.meta.events.register("needs-retry.lambda.Invoke", self._on_answer)
                self._client_cm, self._client = cm, client
            return self._client

    @staticmethod
    def _on_send(**_) -> None:
        attempt = _ATTEMPT.get(None)
        if attempt is not None:
            attempt.sent_at = time.monotonic()

    def _on_answer(self, response=None, caught_exception=None, **_) -> None:
        """botocore's ``needs-retry`` event, seen before its retry handler decides."""
        if caught_exception is not None:
            raise caught_exception  # no answer: not botocore's to resend (module docstring)
        status = response[0].status_code
        if status >= 400:
            attempt = _ATTEMPT.get(None)
            if attempt is not None:
                attempt.sent_at = None  # backing off, if botocore retries it, until it is sent again
            if status == 429:
                self.throttled += 1
                self._counts["throttled"] += 1

    # -- invoke ---------------------------------------------------------------------------------

    async def invoke(self, event: dict[str, Any], priority: tuple = ()) -> dict[str, Any]:
        """Run one task synchronously (``RequestResponse``), relaunching it as described in the
        module docstring, and return the first successful result. ``priority``: the call's place
        in the queue when all ``concurrency`` slots are taken (lowest tuple first)."""
        if self._closed:
            raise TaskFailed(f"{describe(event)}: the invoker is closed")
        async with self.limiter.slot(priority):
            if self._closed:
                raise TaskFailed(f"{describe(event)}: the invoker is closed")
            client = await self._ensure_client()
            return await self._run_attempts(client, event)

    def _launch(self, client, event: dict[str, Any], attempts: list[_Attempt]) -> _Attempt:
        attempt = _Attempt(len(attempts), time.monotonic())
        attempt.task = asyncio.create_task(self._attempt(client, {**event, "attempt": attempt.number}, attempt))
        self._attempt_tasks.add(attempt.task)
        attempt.task.add_done_callback(self._attempt_tasks.discard)
        attempts.append(attempt)
        self._counts["invocations"] += 1
        if attempt.number:
            self._counts["relaunches"] += 1
        return attempt

    async def _run_attempts(self, client, event: dict[str, Any]) -> dict[str, Any]:
        kind = str(event.get("task"))
        attempts: list[_Attempt] = []
        by_task: dict[asyncio.Task, _Attempt] = {}
        last_error = "no attempt made"
        try:
            first = self._launch(client, event, attempts)
            by_task[first.task] = first
            while by_task:
                newest = attempts[-1]
                can_relaunch = len(attempts) < self.max_attempts
                timeout = None
                if can_relaunch and newest.task in by_task:
                    # While it backs off its deadline is unknown: look again after one relaunch period.
                    timeout = self.relaunch_after(kind) if newest.sent_at is None else \
                        max(0.0, newest.sent_at + self.relaunch_after(kind) - time.monotonic())
                done, _ = await asyncio.wait(by_task, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                relaunch = False
                # Successes first: when several attempts end together, any success wins.
                for task in sorted(done, key=lambda t: t.cancelled() or t.exception() is not None):
                    attempt = by_task.pop(task)
                    if task.cancelled():  # only close() cancels an attempt behind our back
                        raise TaskFailed(f"{describe(event)}: cancelled: the invoker was closed")
                    error = task.exception()
                    if error is None:
                        result, duration = task.result()
                        self.note_duration(kind, duration)
                        return result
                    self._counts["failed_calls"] += 1
                    last_error = str(error)
                    if isinstance(error, _AttemptFailed) and error.fatal:
                        raise TaskFailed(f"{describe(event)}: failed after {len(attempts)} "
                                         f"attempt{'s' * (len(attempts) != 1)}; last error: {last_error}")
                    if attempt is newest:
                        relaunch = True
                if not done and newest.task in by_task and newest.sent_at is not None and \
                        time.monotonic() >= newest.sent_at + self.relaunch_after(kind):
                    relaunch = True  # the newest attempt is straggling; it keeps running
                if relaunch and can_relaunch:
                    if self._closed:
                        raise TaskFailed(f"{describe(event)}: cancelled: the invoker was closed")
                    attempt = self._launch(client, event, attempts)
                    by_task[attempt.task] = attempt
            raise TaskFailed(f"{describe(event)}: failed after {len(attempts)} "
                             f"attempt{'s' * (len(attempts) != 1)}; last error: {last_error}")
        finally:
            left = list(by_task)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left)
            for task in left:  # ignored outcomes; retrieved so asyncio does not log them
                if not task.cancelled():
                    task.exception()

    async def _attempt(self, client, event: dict[str, Any], attempt: _Attempt) -> tuple[Any, float]:
        """One attempt: the invoke, botocore's retries included. Returns (result, seconds from
        the last send to the answer) or raises _AttemptFailed."""
        from botocore.exceptions import BotoCoreError, ClientError

        _ATTEMPT.set(attempt)
        try:
            response = await client.invoke(FunctionName=self.function_name, InvocationType="RequestResponse",
                                           Payload=json.dumps(event).encode())
            body = await response["Payload"].read()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            raise _AttemptFailed(f"invoke failed: {code}: {exc}", fatal=code in FATAL_API_ERRORS) from None
        except (BotoCoreError, OSError, asyncio.TimeoutError) as exc:
            raise _AttemptFailed(f"invoke failed: {type(exc).__name__}: {exc}") from None
        duration = time.monotonic() - attempt.sent_at
        try:
            result = json.loads(body) if body else None
        except ValueError:
            raise _AttemptFailed("function returned a non-JSON payload") from None
        if response.get("FunctionError"):
            error = result if isinstance(result, dict) else {}
            raise _AttemptFailed(f"function error {error.get('errorType', 'Unhandled')}: "
                                 f"{error.get('errorMessage', body[:500])}")
        return result, duration

    async def close(self) -> None:
        """Cancel the attempts still in flight (their calls raise TaskFailed) and close the client."""
        self._closed = True
        pending = [t for t in self._attempt_tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        if self._client_cm is not None:
            cm, self._client_cm, self._client = self._client_cm, None, None
            await cm.__aexit__(None, None, None)
