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
  ``Sandbox.Timedout``; an invoke error; a client read timeout), a copy of the event with the next
  ``attempt`` number is launched after a jittered exponential backoff (full jitter: uniform in
  ``[0, min(backoff_max_s, backoff_base_s x 2^(failures - 1))]``), so that a burst of failures
  does not come back as a burst of relaunches. When the newest attempt has not answered within
  :meth:`LambdaInvoker.relaunch_after` seconds of being sent (a straggler), the next attempt is
  launched at once beside it; at most ``fallback_after`` attempts of one call are in flight. The
  first success wins and is returned, and the other attempts still in flight are then cancelled
  (only the HTTP request: a running function cannot be stopped, and the graph and parameter
  servers keep the first push per key and acknowledge late duplicates).
* Giving up on functions: after ``fallback_after`` failed attempts of one call, or when the call
  has no result by its deadline (``timeout_s`` plus ``fallback_after`` relaunch periods of its
  task kind after the first launch), :class:`AttemptsExhausted` (a :class:`TaskFailed`) names
  the task, the attempts and the last error. The lambda backend then runs the task on its graph
  server (:mod:`graphserver.backends.serverless`): a failed call does not end a run. API errors
  that would fail the same way again (unknown function, payload too large or not JSON, bad
  parameter) are configuration errors, not failed calls: they end the call at once with a plain
  :class:`TaskFailed`, and the run with them. A function error in :data:`GRAPH_SERVER_DECIDES`
  (the call's stashed weights are gone) also ends the call's attempts at once, as
  :class:`AttemptsExhausted`: no relaunch could succeed, and the graph server knows why.
* Failures are counted by kind (``failures`` in :meth:`LambdaInvoker.take_stats`): ``raise``
  (the function raised), ``crash`` (``Runtime.ExitError``), ``timeout`` (``Sandbox.Timedout`` or
  no answer within the client's read timeout), ``throttle`` (429s that outlasted botocore's
  retries), ``invoke`` (refused, reset, other API errors).
* Relaunched attempts never queue in the limiter: they run under the slot their call already
  holds, so with a straggler still running a call has two or more attempts in flight and
  ``in_flight`` may exceed ``concurrency`` (by at most ``fallback_after - 1`` per straggling
  call). They therefore never wait behind lower-priority calls and cannot deadlock at capacity 1.
  Should that overflow exceed the account's concurrency, Lambda answers 429 and the attempt backs
  off. Time spent backing off in botocore does not count towards the relaunch period.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import random
import time
from typing import Any

from graphserver.limiter import PriorityLimiter


class TaskFailed(RuntimeError):
    """A tensor task failed or could not be run; the message names task, interval and epoch."""


class AttemptsExhausted(TaskFailed):
    """The function failed ``fallback_after`` times for one call, or gave no result by the call's
    deadline: the task is for its graph server to run (the lambda backend's fallback)."""


def describe(event: dict[str, Any]) -> str:
    return (f"{event['task']} interval {event['interval']} epoch {event['epoch']} layer {event['layer']} "
            f"on graph server {event['part']}")


# Invoke API errors that a new attempt would meet again: the call fails at once.
FATAL_API_ERRORS = frozenset({"ResourceNotFoundException", "RequestTooLargeException",
                              "InvalidRequestContentException", "InvalidParameterValueException"})
DURATION_WINDOW = 20  # successful calls per task kind in the moving mean
FAILURE_KINDS = ("raise", "crash", "timeout", "throttle", "invoke")
# Function errors that are not the handler's own exception (Lambda's names for them).
_FUNCTION_ERROR_KINDS = {"Runtime.ExitError": "crash", "Sandbox.Timedout": "timeout"}
# Function errors that every relaunch would meet again but that the graph server can settle (the
# lambda backend's fallback): lambdas.handler.StashReleased, the call's stashed weights are gone,
# usually because an earlier attempt's gradient completed the epoch and its step released them.
GRAPH_SERVER_DECIDES = frozenset({"StashReleased"})


class _AttemptFailed(Exception):
    def __init__(self, message: str, kind: str, fatal: bool = False, final: bool = False):
        super().__init__(message)
        self.kind = kind
        self.fatal = fatal  # ends the run: a configuration error
        self.final = final  # ends the call's attempts: its graph server decides (GRAPH_SERVER_DECIDES)


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
                 relaunch_min_s: float = 5.0, relaunch_ratio: float = 3.0, fallback_after: int = 4,
                 region: str | None = None, max_throttle_retries: int = 10, backoff_base_s: float = 0.05,
                 backoff_max_s: float = 2.0, seed: int | None = None):
        if fallback_after < 1:
            raise ValueError(f"fallback_after must be >= 1, not {fallback_after}")
        self.endpoint_url = endpoint_url
        self.function_name = function_name
        self.region = region
        self.timeout_s = timeout_s
        self.relaunch_min_s = relaunch_min_s
        self.relaunch_ratio = relaunch_ratio
        self.fallback_after = fallback_after
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        # Only the backoff's jitter draws from it: which calls fail is the function's business.
        self._random = random.Random(seed)
        self.max_throttle_retries = max_throttle_retries
        self.limiter = PriorityLimiter(concurrency)
        self.throttled = 0  # since creation; take_stats() reports per interval
        self._counts = dict.fromkeys(("invocations", "relaunches", "failed_calls", "throttled"), 0)
        self._failures = dict.fromkeys(FAILURE_KINDS, 0)
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
        failed), ``failures`` (those by kind, :data:`FAILURE_KINDS`), ``throttled`` (429 answers;
        botocore retries each while its retries last), plus the limiter's ``busy_s``, ``wait_s``,
        ``max_waiting``, ``capacity`` and ``interval_s``."""
        stats: dict[str, Any] = dict(self._counts)
        stats["failures"] = dict(self._failures)
        self._counts = dict.fromkeys(self._counts, 0)
        self._failures = dict.fromkeys(FAILURE_KINDS, 0)
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

    def deadline_after(self, task: str) -> float:
        """Seconds from a call's first launch after which, with no result, it is given up on:
        ``timeout_s`` plus ``fallback_after`` relaunch periods of its kind, so that the last
        attempt the relaunch schedule launches has had its whole timeout. It bounds a call
        whose attempts neither answer nor fail (botocore backing off on 429s, a request that
        never times out); hanging attempts fail by their timeout long before."""
        return self.timeout_s + self.fallback_after * self.relaunch_after(task)

    def backoff(self, failures: int) -> float:
        """Seconds to wait before relaunching after the call's ``failures``-th failed attempt:
        full jitter over an exponential bound (AWS's recommended backoff)."""
        bound = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** max(0, failures - 1))
        return self._random.uniform(0.0, bound)

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
                # The client's CPU per invoke is spent on the graph server's event loop, which also
                # answers the functions' pulls and pushes. The three parameters are always well
                # formed here, so botocore does not validate them; and the local emulator checks
                # no signatures, so none are computed for it. Together: 10-30% of the 1.3-2.5 ms
                # per call (benchmarks/bench_invoke.py, client CPU column, loaded machine).
                options: dict[str, Any] = {"parameter_validation": False}
                credentials = {}
                if self.endpoint_url:
                    from botocore import UNSIGNED

                    options["signature_version"] = UNSIGNED
                    credentials = {"aws_access_key_id": "local", "aws_secret_access_key": "local"}
                config = Config(retries={"mode": "standard", "max_attempts": self.max_throttle_retries},
                                read_timeout=self.timeout_s, connect_timeout=10,
                                max_pool_connections=max(256, 2 * self.concurrency), **options)
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
        failures = 0
        last_error = "no attempt made"
        started = time.monotonic()
        deadline = started + self.deadline_after(kind)
        relaunch_at: float | None = None  # after a failure: when its backoff ends

        def summary() -> str:
            return (f"{describe(event)}: failed after {len(attempts)} attempt{'s' * (len(attempts) != 1)}; "
                    f"last error: {last_error}")

        try:
            first = self._launch(client, event, attempts)
            by_task[first.task] = first
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise AttemptsExhausted(f"{describe(event)}: no result within {deadline - started:.3g} s (the "
                                            f"call's deadline) from {len(attempts)} attempt"
                                            f"{'s' * (len(attempts) != 1)} ({failures} failed); last error: "
                                            f"{last_error}")
                newest = attempts[-1]
                waits = [deadline - now]
                if relaunch_at is not None:
                    waits.append(relaunch_at - now)
                elif newest.task in by_task and len(by_task) < self.fallback_after:
                    # While it backs off its send time is unknown: look again after one relaunch period.
                    waits.append(self.relaunch_after(kind) if newest.sent_at is None else
                                 newest.sent_at + self.relaunch_after(kind) - now)
                timeout = max(0.0, min(waits))
                if by_task:
                    done, _ = await asyncio.wait(by_task, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                else:  # every attempt failed: the relaunch waits out its backoff
                    done = set()
                    await asyncio.sleep(timeout)
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
                    failures += 1
                    self._counts["failed_calls"] += 1
                    failure_kind = error.kind if isinstance(error, _AttemptFailed) else "invoke"
                    self._failures[failure_kind] += 1
                    last_error = str(error)
                    if isinstance(error, _AttemptFailed) and error.fatal:
                        raise TaskFailed(summary())
                    if failures >= self.fallback_after or isinstance(error, _AttemptFailed) and error.final:
                        raise AttemptsExhausted(summary())
                    if attempt is newest and relaunch_at is None:
                        relaunch_at = time.monotonic() + self.backoff(failures)
                now = time.monotonic()
                relaunch = False
                if relaunch_at is not None:
                    relaunch = now >= relaunch_at
                elif newest.task in by_task and newest.sent_at is not None and len(by_task) < self.fallback_after \
                        and now >= newest.sent_at + self.relaunch_after(kind):
                    relaunch = True  # the newest attempt is straggling; it keeps running
                if relaunch:
                    if self._closed:
                        raise TaskFailed(f"{describe(event)}: cancelled: the invoker was closed")
                    relaunch_at = None
                    attempt = self._launch(client, event, attempts)
                    by_task[attempt.task] = attempt
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
            raise _AttemptFailed(f"invoke failed: {code}: {exc}", "throttle" if code == "TooManyRequestsException"
                                 else "invoke", fatal=code in FATAL_API_ERRORS) from None
        except (BotoCoreError, OSError, asyncio.TimeoutError) as exc:
            from botocore.exceptions import ReadTimeoutError

            timed_out = isinstance(exc, (ReadTimeoutError, asyncio.TimeoutError))
            raise _AttemptFailed(f"invoke failed: {type(exc).__name__}: {exc}",
                                 "timeout" if timed_out else "invoke") from None
        duration = time.monotonic() - attempt.sent_at
        try:
            result = json.loads(body) if body else None
        except ValueError:
            raise _AttemptFailed("function returned a non-JSON payload", "raise") from None
        if response.get("FunctionError"):
            error = result if isinstance(result, dict) else {}
            error_type = str(error.get("errorType", "Unhandled"))
            raise _AttemptFailed(f"function error {error_type}: {error.get('errorMessage', body[:500])}",
                                 _FUNCTION_ERROR_KINDS.get(error_type, "raise"),
                                 final=error_type in GRAPH_SERVER_DECIDES)
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
