"""A local AWS Lambda: the Invoke HTTP API, handlers in worker processes, billing like Lambda.

Any Lambda client (boto3, aiobotocore) works against it unchanged with
``endpoint_url="http://HOST:PORT"``, any region and dummy credentials.

API (``POST /2015-03-31/functions/{FunctionName}/invocations``, optional ``?Qualifier=``;
FunctionName is a name, ``name:qualifier``, a full or a partial ARN):

* ``X-Amz-Invocation-Type: RequestResponse`` (default): 200 with the handler's JSON result;
  a function error (handler raised, timed out, worker crashed, result not JSON-serializable)
  is 200 with ``X-Amz-Function-Error: Unhandled`` and Lambda's error object as the payload.
  ``X-Amz-Log-Type: Tail`` returns the last 4 KB of the call's log in ``X-Amz-Log-Result``.
* ``Event``: 202 at once, the call runs in the background. ``DryRun``: 204, nothing runs.
* Each call runs in one of ``concurrency`` worker processes, one call per worker at a time. A
  call running past ``timeout_s`` is a function error (``Sandbox.Timedout``) and a worker that
  dies mid-call one of type ``Runtime.ExitError``; either way the worker is killed and replaced.
* API errors carry ``x-amzn-ErrorType`` and a JSON body, as botocore's rest-json parser expects:
  404 ResourceNotFoundException, 429 TooManyRequestsException (more than ``concurrency`` calls in
  flight, RequestResponse and Event together), 413 RequestTooLargeException, 400
  InvalidRequestContentException (payload not JSON), 400 InvalidParameterValueException.

Physics (:class:`dorylus.emulator.physics.Physics`; the default changes nothing, ``AWS_LIKE``
holds figures measured on Lambda):

* ``start_latency_ms``: a sleep before each call, modelling invoke and placement overhead; like
  the Lambda frontend's latency, it is not billed.
* Cold starts: a call goes to the idle worker that ran its function most recently; if none ran
  it within ``keep_warm_s``, the call is a cold start: the worker sleeps ``cold_start_ms`` (plus,
  on its first call of the function, imports the handler module), billed and reported as
  ``Init Duration`` as AWS bills INIT since August 2025. Counted in ``cold_starts``.
* ``bandwidth_mbps``: exposed to the handler as ``context.bandwidth_bytes_per_s``
  (``bandwidth_mbps * 1e6 / 8``, None when 0); the handler throttles its own traffic with it.
  The Invoke request and response themselves are not throttled.
* ``cpu_share``: a call gets ``memory_mb / 1769`` vCPUs (at most 6): a handler whose CPU time
  (all its threads) exceeds that share is stretched after it returns, by a sleep, to the time it
  would take at that share (``cpu_time * (1 / share - 1)`` for single-threaded work). Billed.

Faults (:class:`dorylus.emulator.faults.FaultPlan`): a seeded fraction of calls, chosen from a
hash of the seed and the event payload, raise (function error ``InjectedFault``), crash
(``Runtime.ExitError``), hang (``Sandbox.Timedout``) or straggle (the call takes
``straggle_factor`` times as long, billed). Counted in ``faults.<kind>``; each reply names its
fault in ``X-Dorylus-Fault``.

Billing: a call's billed duration is its run time in the worker (INIT as above, the handler, the
CPU-share stretch, a straggler's delay) rounded up to whole milliseconds, at least 1 ms; a
timed-out call bills the full timeout. GB-seconds = billed_ms / 1000 * memory_mb / 1024. Each
RequestResponse reply carries ``X-Dorylus-Billed-Ms``, ``X-Dorylus-Duration-Ms`` and
``X-Dorylus-Cold-Start`` (``true``/``false``); totals are at ``GET /emulator/stats`` (reset with
``POST /emulator/stats/reset``) and :meth:`EmulatorServer.stats`. ``GET /emulator/health`` is
the readiness probe.

Differences from AWS, on purpose: every function shares one pool of worker processes (one
account-level concurrency limit, Reason ``ConcurrentInvocationLimitExceeded``); an Event call
over the limit is refused with 429 instead of queued, and a failed one is not retried (Lambda
retries it twice); any Qualifier runs ``$LATEST``; memory is a billing figure and, with
``cpu_share``, a CPU share, but its size is not enforced; the Event payload limit stays at 256 KB
(AWS raised it to 1 MB in 2025), so payloads accepted here are accepted by every Lambda. Workers
are daemonic processes, so a handler cannot start multiprocessing children of its own. A worker
is a sandbox shared by every function, and one that goes cold is not replaced: the cold start
is a sleep, and the handler module's globals survive it (in AWS the sandbox, and its globals,
are gone). A CPU share above what this machine gives a worker cannot be emulated (calls run as
fast as they can here), nor can one below it for work the handler hands to other processes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import importlib.machinery
import importlib.util
import json
import logging
import math
import os
import re
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, Callable, Hashable, Mapping, Sequence
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http import HttpProcessingError

from dorylus import logs
from dorylus.emulator.faults import FAULT_KINDS, FaultPlan
from dorylus.emulator.physics import AWS_LIKE, Physics
from dorylus.emulator.pool import Outcome, WorkerPool
from dorylus.endpoints import check_port
from dorylus.lambda_limits import MAX_TIMEOUT_S, MEMORY_RANGE_MB
from dorylus.errors import ConfigError
from dorylus.function import FUNCTION_HANDLER, FUNCTION_NAME

logger = logging.getLogger("dorylus.emulator")

SYNC_PAYLOAD_LIMIT = 6 * 1024 * 1024  # 6,291,456 bytes, RequestResponse request and response
EVENT_PAYLOAD_LIMIT = 256 * 1024  # 262,144 bytes, Event request
LOG_TAIL_BYTES = 4096
DEFAULT_FUNCTIONS = {FUNCTION_NAME: FUNCTION_HANDLER}
DEFAULT_PORT = 9001
ACCOUNT_ID = "123456789012"

# Bodies up to this size are read even when refused, so the client gets the error response
# rather than a connection reset; a larger one is refused unread (aiohttp then discards what
# arrives for a few seconds and closes the connection).
_DRAIN_LIMIT = 64 * 1024 * 1024
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})
_INVOKE_PATH = re.compile(r"/2015-03-31/functions/([^/]+)/invocations/?")
_INVOCATION_TYPES = ("RequestResponse", "Event", "DryRun")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_REGION_IN_AUTH = re.compile(r"Credential=[^/,\s]+/\d{8}/([a-z0-9-]+)/lambda/")
# Error shapes whose message member is spelled "Message" in Lambda's service model.
_CAPITALIZED_MESSAGE = {"ResourceNotFoundException", "ServiceException"}


def default_concurrency() -> int:
    return max(2, os.cpu_count() or 2)


def _module_found(module: str, code_dirs: Sequence[str]) -> bool:
    """Whether ``module`` is importable from ``code_dirs`` (looked up without running any of its
    packages' code) or from this process's import path."""
    search: list[str] | None = list(code_dirs)
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search) if search else None
        if spec is None:
            break
        search = spec.submodule_search_locations
    else:
        return True
    return importlib.util.find_spec(module) is not None


def check_functions(functions: Mapping[str, str], code_dirs: Sequence[str] = ()) -> dict[str, str]:
    """Validate ``{name: "package.module:function"}``: Lambda-valid names, well-formed specs,
    modules that can be found (in ``code_dirs`` or on the import path). Raises ConfigError naming
    the function. Modules are imported only in the workers: one that fails on import gives
    Runtime.ImportModuleError there, as in Lambda."""
    if not functions:
        raise ConfigError("lambda emulator: no functions registered")
    for name, spec in functions.items():
        if not _FUNCTION_NAME.fullmatch(name):
            raise ConfigError(f"lambda emulator: function name {name!r} is not a valid Lambda "
                              "name (1-64 letters, digits, '-' or '_')")
        module, sep, attr = spec.partition(":")
        if not (sep and module and attr.isidentifier()):
            raise ConfigError(f"lambda emulator: handler {spec!r} of function {name!r} is not "
                              "of the form 'package.module:function'")
        try:
            found = _module_found(module, code_dirs)
        except Exception as exc:  # a parent package failed to import, or the name is malformed
            raise ConfigError(f"lambda emulator: handler module {module!r} of function {name!r} "
                              f"cannot be imported: {exc}") from exc
        if not found:
            raise ConfigError(f"lambda emulator: handler module {module!r} of function {name!r} "
                              "is not on the Python path" + (" nor in the code directories "
                              + ", ".join(code_dirs) if code_dirs else ""))
    return dict(functions)


def check_code_dirs(code_dirs: Sequence[str]) -> tuple[str, ...]:
    """Absolute paths of existing directories, or ConfigError naming the missing one."""
    for directory in code_dirs:
        if not os.path.isdir(directory):
            raise ConfigError(f"lambda emulator: code directory {directory!r} does not exist")
    return tuple(os.path.abspath(directory) for directory in code_dirs)


def parse_function_args(values: list[str]) -> dict[str, str]:
    """``["NAME=module:callable", ...]`` -> ``{NAME: "module:callable"}``."""
    functions: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep or not name or not spec:
            raise ConfigError(f"lambda emulator: --function {value!r} is not NAME=module:callable")
        if name in functions:
            raise ConfigError(f"lambda emulator: --function {name!r} given twice")
        functions[name] = spec
    return functions


def parse_function_name(raw: str) -> tuple[str, str | None]:
    """Name and qualifier from any FunctionName form: ``name``, ``name:qualifier``,
    ``arn:aws:lambda:REGION:ACCOUNT:function:name[:qualifier]``,
    ``ACCOUNT:function:name[:qualifier]``. Unrecognized forms come back whole (not found)."""
    parts = raw.split(":")
    if len(parts) in (7, 8) and parts[0] == "arn" and parts[5] == "function":
        return parts[6], (parts[7] if len(parts) == 8 else None)
    if len(parts) in (3, 4) and parts[1] == "function":
        return parts[2], (parts[3] if len(parts) == 4 else None)
    if len(parts) in (1, 2):
        return parts[0], (parts[1] if len(parts) == 2 else None)
    return raw, None


def billed_ms(duration_ns: int) -> int:
    """Lambda bills duration rounded up to the next millisecond, at least 1 ms."""
    return max(1, -(-duration_ns // 1_000_000))


@dataclasses.dataclass
class _Counters:
    invocations: int = 0  # admitted RequestResponse + Event calls: each is one billed request
    errors: int = 0  # function errors: raised, timed out, crashed, unserializable result
    throttles: int = 0  # refused with 429
    dry_runs: int = 0
    billed_ms: int = 0
    duration_ms: float = 0.0  # measured, unrounded
    peak_concurrency: int = 0
    cold_starts: int = 0  # calls that found no worker warm for their function
    faults: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))  # injected, by kind


class _ApiError(Exception):
    def __init__(self, status: int, code: str, message: str,
                 extra: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.extra, self.headers = dict(extra or {}), dict(headers or {})


class EmulatorServer:
    """A running emulator: HTTP server thread + worker pool. Create with :func:`serve`."""

    def __init__(self, host: str, port: int, functions: Mapping[str, str], concurrency: int,
                 memory_mb: int, timeout_s: float, start_latency_ms: float = 0.0,
                 code_dirs: Sequence[str] = (), *, physics: Physics | None = None,
                 faults: FaultPlan | None = None, environment: Mapping[str, str] | None = None,
                 affinity: Callable[[bytes], Hashable] | None = None):
        if concurrency < 1:
            raise ConfigError(f"lambda emulator: concurrency must be >= 1, got {concurrency}")
        if not MEMORY_RANGE_MB[0] <= memory_mb <= MEMORY_RANGE_MB[1]:
            raise ConfigError(f"lambda emulator: memory {memory_mb} MB is outside Lambda's "
                              f"range {MEMORY_RANGE_MB[0]}..{MEMORY_RANGE_MB[1]} MB")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"lambda emulator: timeout {timeout_s} s is outside (0, 900] s")
        if physics is None:
            try:
                physics = Physics(start_latency_ms=start_latency_ms)
            except ValueError:
                raise ConfigError(f"lambda emulator: start latency {start_latency_ms!r} ms is "
                                  "not a finite number >= 0") from None
        elif not isinstance(physics, Physics):
            raise ConfigError(f"lambda emulator: physics must be a Physics, got {physics!r}")
        if faults is not None and not isinstance(faults, FaultPlan):
            raise ConfigError(f"lambda emulator: faults must be a FaultPlan, got {faults!r}")
        self.code_dirs = check_code_dirs(code_dirs)
        self.functions = check_functions(functions, self.code_dirs)
        # The functions' environment variables, as Lambda's function configuration sets them
        # (e.g. the CURVE keys); set in the worker before each call.
        self.environment = {str(k): str(v) for k, v in (environment or {}).items()}
        self.concurrency, self.memory_mb = concurrency, memory_mb
        self.timeout_s, self.physics = timeout_s, physics
        self.start_latency_ms = physics.start_latency_ms
        # An all-zero plan is no plan: no hashing on the call path.
        self.faults = faults if faults is not None and faults.active else None
        self._fault_plan = faults
        self.affinity = affinity
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._in_flight = 0
        self._closed = False
        # Bound before the workers start, so that a taken port fails at once; served after.
        try:
            sock = socket.create_server((host, port), backlog=128, family=(
                socket.AF_INET6 if ":" in host else socket.AF_INET))
        except OSError as exc:
            raise ConfigError(f"lambda emulator: cannot listen on {host}:{port} (cannot bind: "
                              f"{str(exc.strerror or exc).lower()})") from exc
        self._address = sock.getsockname()[:2]
        try:
            self._pool = WorkerPool(concurrency, self.code_dirs,
                                    keep_warm_s=physics.keep_warm_s)
        except BaseException:
            sock.close()
            raise
        # The pool blocks on its workers' pipes, so calls run in threads; admission keeps at most
        # ``concurrency`` of them (RequestResponse and Event together) there at once.
        self._calls = ThreadPoolExecutor(concurrency, thread_name_prefix="lambda-call")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lambda-emulator-http",
                                        daemon=True)
        self._thread.start()
        # At shutdown the calls in flight end with the pool and their handlers answer at once;
        # a connection still busy a second later is a client sending a body it was refused.
        self._runner = web.ServerRunner(_Server(self._handle, loop=self._loop),
                                        shutdown_timeout=1.0)
        try:
            asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result()
        except BaseException:
            self.close()
            raise

    async def _serve(self, sock: socket.socket) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def _stop_serving(self) -> None:
        await self._runner.cleanup()
        # What cleanup gave up waiting for (a connection still draining a refused body) ends here,
        # not as a task destroyed pending with the loop.
        rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        return self._address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stats(self) -> dict[str, Any]:
        """Counters since start or the last reset (``invocations``, ``errors``, ``throttles``,
        ``dry_runs``, ``billed_ms``, ``duration_ms``, ``peak_concurrency``, ``cold_starts``,
        ``faults.raise``, ``faults.crash``, ``faults.hang``, ``faults.straggle``), plus
        ``in_flight`` now, ``billed_gb_s = billed_ms / 1000 * memory_mb / 1024`` and the
        settings (``memory_mb``, ``concurrency``, ``timeout_s``, ``start_latency_ms``,
        ``physics``: the Physics fields, ``fault_plan``: the FaultPlan fields or None)."""
        with self._lock:
            out: dict[str, Any] = dataclasses.asdict(self._counters)
            out["in_flight"] = self._in_flight
        for kind, count in out.pop("faults").items():
            out[f"faults.{kind}"] = count
        out["billed_gb_s"] = out["billed_ms"] / 1000 * self.memory_mb / 1024
        out.update(memory_mb=self.memory_mb, concurrency=self.concurrency,
                   timeout_s=self.timeout_s, start_latency_ms=self.start_latency_ms,
                   physics=dataclasses.asdict(self.physics),
                   fault_plan=(dataclasses.asdict(self._fault_plan)
                               if self._fault_plan is not None else None))
        return out

    def reset_stats(self) -> None:
        """Zero the counters; calls in flight stay counted in ``in_flight`` and the peak."""
        with self._lock:
            self._counters = _Counters(peak_concurrency=self._in_flight)

    def close(self) -> None:
        """Stop listening, stop the workers (calls in flight end as function errors), close every
        connection once its reply is sent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # The runner stops listening at once, then waits for the handlers, which wait for the pool.
        cleanup = asyncio.run_coroutine_threadsafe(self._stop_serving(), self._loop)
        self._pool.close()
        cleanup.result()
        self._calls.shutdown()  # Event calls: their workers are gone, so they end at once
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> EmulatorServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- used by the request handler ------------------------------------------------------

    def _admit(self) -> bool:
        with self._lock:
            if self._in_flight >= self.concurrency:
                self._counters.throttles += 1
                return False
            self._in_flight += 1
            self._counters.invocations += 1
            self._counters.peak_concurrency = max(self._counters.peak_concurrency,
                                                  self._in_flight)
            return True

    def _count_dry_run(self) -> None:
        with self._lock:
            self._counters.dry_runs += 1

    def _prepare(self, call: dict[str, Any]) -> dict[str, Any]:
        """Add the physics and the call's fault (drawn from its payload, counted) to ``call``."""
        physics = self.physics
        call.update(cold_start_ms=physics.cold_start_ms, vcpus=physics.vcpus(self.memory_mb),
                    bandwidth_bytes_per_s=physics.bandwidth_bytes_per_s, fault=None,
                    environment=self.environment, affinity=None)
        if self.affinity is not None:
            try:
                call["affinity"] = self.affinity(call["payload"])
            except Exception:  # a payload the function does not place: any warm worker
                call["affinity"] = None
        if self.faults is not None:
            fault = call["fault"] = self.faults.choose(call["payload"])
            if fault is not None:
                call["straggle_factor"] = self.faults.straggle_factor
                with self._lock:
                    self._counters.faults[fault] += 1
        return call

    def _execute(self, call: dict[str, Any]) -> tuple[Outcome, int]:
        """Run an admitted, prepared call; -> (outcome, billed ms). Frees its slot before
        returning, so that a client that calls again right after the reply is not throttled."""
        try:
            if self.start_latency_ms:
                time.sleep(self.start_latency_ms / 1000)
            outcome = self._pool.run(call, self.timeout_s)
            if outcome.ok and len(outcome.body) > SYNC_PAYLOAD_LIMIT:
                outcome = dataclasses.replace(outcome, ok=False, body=json.dumps({
                    "errorMessage": "Response payload size exceeded maximum allowed payload "
                                    f"size ({SYNC_PAYLOAD_LIMIT} bytes).",
                    "errorType": "Function.ResponseSizeTooLarge"}).encode())
            # A call that never reached a worker (emulator shutting down) bills nothing.
            billed = billed_ms(outcome.duration_ns) if outcome.duration_ns else 0
            with self._lock:
                self._counters.billed_ms += billed
                self._counters.duration_ms += outcome.duration_ns / 1e6
                self._counters.errors += not outcome.ok
                self._counters.cold_starts += outcome.cold
        finally:
            with self._lock:
                self._in_flight -= 1
        return outcome, billed

    def _report_line(self, request_id: str, outcome: Outcome, billed: int) -> str:
        line = (f"REPORT RequestId: {request_id}\tDuration: {outcome.duration_ns / 1e6:.2f} ms\t"
                f"Billed Duration: {billed} ms\tMemory Size: {self.memory_mb} MB\t"
                f"Max Memory Used: {outcome.max_rss_mb} MB")
        if outcome.init_ns:
            line += f"\tInit Duration: {outcome.init_ns / 1e6:.2f} ms"
        return line + "\n"

    def _run_event(self, call: dict[str, Any]) -> None:
        try:
            outcome, _ = self._execute(call)
            if not outcome.ok:
                logger.warning("lambda emulator: Event call %s of %s failed: %s",
                               call["request_id"], call["function_name"],
                               outcome.body.decode(errors="replace")[:1000])
        except Exception:
            logger.exception("lambda emulator: Event call %s failed", call["request_id"])

    # -- HTTP -------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in _METHODS:  # closed, as after a request aiohttp cannot parse
            response = _error_response(_ApiError(501, "UnknownOperationException",
                                                 f"Unsupported method {request.method!r}"))
            response.force_close()
            return response
        try:
            return await self._route(request, await _read_body(request))
        except _ApiError as exc:
            return _error_response(exc)
        except ConnectionError:  # the client left; there is no one to answer
            raise
        except Exception:
            logger.exception("lambda emulator: internal error on %s %s", request.method,
                             request.rel_url)
            response = _error_response(_ApiError(500, "ServiceException",
                                                 "internal emulator error"))
            response.force_close()
            return response

    async def _route(self, request: web.BaseRequest, body: bytes) -> web.Response:
        path = request.rel_url.raw_path
        match = _INVOKE_PATH.fullmatch(path)
        if match:
            _require(request, "POST")
            return await self._invoke(request, unquote(match.group(1)), body)
        if path == "/emulator/health":
            _require(request, "GET")
            return _response(200, json.dumps({"status": "ok", "url": self.url}).encode())
        if path == "/emulator/stats":
            _require(request, "GET")
            return _response(200, json.dumps(self.stats()).encode())
        if path == "/emulator/stats/reset":
            _require(request, "POST")
            self.reset_stats()
            return _response(200, json.dumps(self.stats()).encode())
        raise _ApiError(404, "UnknownOperationException",
                        f"no operation at {request.method} {path}")

    async def _invoke(self, request: web.BaseRequest, raw_name: str, body: bytes) -> web.Response:
        name, qualifier = parse_function_name(raw_name)
        qualifier = request.query.get("Qualifier", qualifier)
        region_match = _REGION_IN_AUTH.search(request.headers.get("Authorization", ""))
        region = region_match.group(1) if region_match else "us-east-1"
        arn = f"arn:aws:lambda:{region}:{ACCOUNT_ID}:function:{name}"
        if qualifier:
            arn += f":{qualifier}"
        invocation_type = request.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if invocation_type not in _INVOCATION_TYPES:
            raise _ApiError(400, "InvalidParameterValueException",
                            f"Unsupported invocation type {invocation_type!r}; use one of "
                            + ", ".join(_INVOCATION_TYPES))
        spec = self.functions.get(name)
        if spec is None:
            raise _ApiError(404, "ResourceNotFoundException", f"Function not found: {arn}")
        limit = EVENT_PAYLOAD_LIMIT if invocation_type == "Event" else SYNC_PAYLOAD_LIMIT
        if len(body) > limit:
            raise _ApiError(413, "RequestTooLargeException",
                            f"Request must be smaller than {limit} bytes for the InvokeFunction "
                            "operation")
        if body.strip():
            try:
                json.loads(body)
            except ValueError as exc:
                raise _ApiError(400, "InvalidRequestContentException",
                                f"Could not parse request body into json: {exc}") from exc
        if invocation_type == "DryRun":
            self._count_dry_run()
            return _response(204)
        if not self._admit():
            raise _ApiError(429, "TooManyRequestsException", "Rate Exceeded.",
                            extra={"Reason": "ConcurrentInvocationLimitExceeded"},
                            headers={"Retry-After": "1"})
        request_id = str(uuid.uuid4())
        call = self._prepare({"request_id": request_id, "function_name": name, "handler": spec,
                              "invoked_function_arn": arn, "memory_mb": self.memory_mb,
                              "region": region, "payload": body})
        if invocation_type == "Event":
            self._calls.submit(self._run_event, call)
            return _response(202, headers={"x-amzn-RequestId": request_id})
        outcome, billed = await asyncio.get_running_loop().run_in_executor(
            self._calls, self._execute, call)
        headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": "$LATEST",
                   "X-Dorylus-Billed-Ms": str(billed),
                   "X-Dorylus-Duration-Ms": f"{outcome.duration_ns / 1e6:.6f}",
                   "X-Dorylus-Cold-Start": "true" if outcome.cold else "false"}
        if call["fault"]:
            headers["X-Dorylus-Fault"] = call["fault"]
        if not outcome.ok:
            headers["X-Amz-Function-Error"] = "Unhandled"
        if request.headers.get("X-Amz-Log-Type") == "Tail":
            log = (outcome.log + self._report_line(request_id, outcome, billed)).encode()
            headers["X-Amz-Log-Result"] = base64.b64encode(log[-LOG_TAIL_BYTES:]).decode()
        return _response(200, outcome.body, headers)



async def _read_body(request: web.BaseRequest) -> bytes:
    """The whole body (aiohttp undoes chunked encoding), refused past ``_DRAIN_LIMIT``."""
    too_large = _ApiError(413, "RequestTooLargeException",
                          f"Request must be smaller than {SYNC_PAYLOAD_LIMIT} bytes")
    if (request.content_length or 0) > _DRAIN_LIMIT:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > _DRAIN_LIMIT:  # chunked: no length up front
                raise too_large
            chunks.append(chunk)
    except HttpProcessingError as exc:  # e.g. a malformed chunk
        raise _ApiError(400, "InvalidRequestContentException",
                        f"malformed request body: {exc.message}") from None
    return b"".join(chunks)


def _require(request: web.BaseRequest, method: str) -> None:
    if request.method != method:
        raise _ApiError(405, "MethodNotAllowedException",
                        f"{request.method} is not allowed here; use {method}",
                        headers={"Allow": method})


def _response(status: int, body: bytes = b"", headers: Mapping[str, str] | None = None
              ) -> web.Response:
    return web.Response(status=status, body=body,
                        headers={"Content-Type": "application/json", **(headers or {})})


def _error_response(exc: _ApiError) -> web.Response:
    key = "Message" if exc.code in _CAPITALIZED_MESSAGE else "message"
    body = {"Type": "Service" if exc.code == "ServiceException" else "User",
            key: exc.message, **exc.extra}
    return _response(exc.status, json.dumps(body).encode(),
                     {"x-amzn-ErrorType": exc.code, "x-amzn-RequestId": str(uuid.uuid4()),
                      **exc.headers})


class _Protocol(web.RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        # aiohttp answers requests it cannot parse here, in plain text and logged as errors;
        # SDK clients expect the API's error shape, and a garbled request is the client's fault.
        logger.debug("lambda emulator: bad request from %s: %s", request.remote,
                     message or exc)
        code = "ServiceException" if status >= 500 else "InvalidRequestContentException"
        response = _error_response(_ApiError(status, code, message or HTTPStatus(status).phrase))
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's low-level server (one handler, the routing above), answering in the API's
    error shape even for requests it cannot parse."""

    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=asyncio.get_running_loop(), access_log=None)


def serve(host: str = "127.0.0.1", port: int = 0, functions: Mapping[str, str] | None = None,
          concurrency: int | None = None, memory_mb: int = 1024, timeout_s: float = MAX_TIMEOUT_S,
          start_latency_ms: float = 0.0, code_dirs: Sequence[str] = (), *,
          physics: Physics | None = None, faults: FaultPlan | None = None,
          environment: Mapping[str, str] | None = None,
          affinity: Callable[[bytes], Hashable] | None = None) -> EmulatorServer:
    """Start an emulator in background threads and return it once every worker is ready.

    ``functions``: ``{name: "package.module:function"}`` (default: the tensor function,
    :data:`~dorylus.function.FUNCTION_NAME` -> ``lambdas.handler:handler``). ``concurrency``: worker processes = most calls in flight
    (default: CPU count, at least 2). ``code_dirs``: directories put first on the workers'
    import path, like a function's unpacked code bundle. ``physics``: latencies, cold starts,
    bandwidth and CPU share (default: none; ``Physics(start_latency_ms=start_latency_ms)``).
    When ``physics`` is given it wins: ``start_latency_ms`` is ignored (use
    ``physics.start_latency_ms``). ``faults``: seeded fault injection (default: none).
    ``environment``: variables set for the functions, as Lambda's configuration does (the
    workers also inherit this process's environment). ``affinity``: a function of a call's
    payload whose value places it, among warm workers, on one whose last call had the same
    (:mod:`dorylus.emulator.pool`; None or raising: any warm worker). Stop it with ``close()``
    or a ``with`` block.
    """
    return EmulatorServer(host, port, DEFAULT_FUNCTIONS if functions is None else functions,
                          default_concurrency() if concurrency is None else concurrency,
                          memory_mb, timeout_s, start_latency_ms, code_dirs,
                          physics=physics, faults=faults, environment=environment, affinity=affinity)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dorylus lambda-emulator``."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s; 0.0.0.0 accepts "
                             "other machines: the API has no authentication)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="TCP port (default: %(default)s; 0 picks a free port, see the "
                             "startup line)")
    parser.add_argument("--function", action="append", metavar="NAME=MODULE:CALLABLE",
                        help="register a function: invocations of NAME run CALLABLE(event, "
                             "context) from the importable MODULE; repeatable (default: "
                             + ", ".join(f"{k}={v}" for k, v in DEFAULT_FUNCTIONS.items()) + ")")
    parser.add_argument("--code-dir", action="append", default=[], metavar="DIR",
                        help="directory put first on the handlers' import path, e.g. an "
                             "unpacked function bundle; repeatable")
    parser.add_argument("--concurrency", type=int, default=default_concurrency(),
                        help="worker processes, i.e. the most calls in flight at once; more are "
                             "refused with 429 TooManyRequestsException (default: CPU count, "
                             "%(default)s)")
    parser.add_argument("--memory-mb", type=int, default=1024,
                        help="function memory size in MB: billed as GB-seconds and shown to the "
                             "handler, not enforced (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=MAX_TIMEOUT_S,
                        help="a call running longer is a function error (Sandbox.Timedout) and "
                             "its worker is replaced (default: %(default)s, Lambda's maximum)")
    physics = parser.add_argument_group(
        "physics", "how long calls take, as on AWS Lambda (default: as fast as this machine "
        "runs them); with --aws-like, any of these given overrides that preset's figure")
    physics.add_argument("--aws-like", action="store_true",
                         help="start from figures measured on AWS Lambda: start latency "
                              f"{AWS_LIKE.start_latency_ms:g} ms, cold start "
                              f"{AWS_LIKE.cold_start_ms:g} ms, keep-warm "
                              f"{AWS_LIKE.keep_warm_s:g} s, bandwidth "
                              f"{AWS_LIKE.bandwidth_mbps:g} Mbit/s, CPU share on (sources in "
                              "dorylus/emulator/physics.py)")
    physics.add_argument("--start-latency-ms", type=float, default=None,
                         help="latency added before every call to model Lambda's invoke/start "
                              "overhead; not billed (default: 0)")
    physics.add_argument("--cold-start-ms", type=float, default=None,
                         help="extra latency of a call on a worker that has not run the "
                              "function within --keep-warm-s; billed as INIT (default: 0)")
    physics.add_argument("--keep-warm-s", type=float, default=None,
                         help="how long a worker stays warm for a function after its last call "
                              "of it (default: 600)")
    physics.add_argument("--bandwidth-mbps", type=float, default=None,
                         help="cap on each call's own network traffic in Mbit/s, passed to the "
                              "handler as context.bandwidth_bytes_per_s; 0 = none (default: 0)")
    physics.add_argument("--cpu-share", action=argparse.BooleanOptionalAction, default=None,
                         help="give each call the CPU its memory buys on Lambda (1,769 MB = one "
                              "vCPU, at most 6): CPU-bound calls below one vCPU are stretched, "
                              "billed (default: off)")
    faults = parser.add_argument_group(
        "fault injection", "fail a seeded fraction of calls, chosen from a hash of the seed and "
        "the event payload (default: none)")
    faults.add_argument("--fault-raise", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of calls that are a function error (InjectedFault)")
    faults.add_argument("--fault-crash", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of calls whose worker process dies (Runtime.ExitError)")
    faults.add_argument("--fault-hang", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of calls that hang until the timeout (Sandbox.Timedout)")
    faults.add_argument("--fault-straggle", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of calls slowed down by --fault-straggle-factor")
    faults.add_argument("--fault-straggle-factor", type=float, default=10.0, metavar="FACTOR",
                        help="a straggling call takes this many times as long, >= 1 "
                             "(default: %(default)s)")
    faults.add_argument("--fault-seed", type=int, default=0,
                        help="seed of which calls fail (default: %(default)s)")
    logs.add_argument(parser)


_PHYSICS_OPTIONS = {"start_latency_ms": "--start-latency-ms", "cold_start_ms": "--cold-start-ms",
                    "keep_warm_s": "--keep-warm-s", "bandwidth_mbps": "--bandwidth-mbps",
                    "cpu_share": "--cpu-share"}
_FAULT_OPTIONS = {"raise_fraction": "--fault-raise", "crash_fraction": "--fault-crash",
                  "hang_fraction": "--fault-hang", "straggle_fraction": "--fault-straggle",
                  "straggle_factor": "--fault-straggle-factor", "seed": "--fault-seed"}


def physics_from_args(args: argparse.Namespace) -> Physics:
    """The Physics the options ask for: AWS_LIKE with --aws-like, else the defaults, with each
    physics option given overriding its field. Bad values raise ConfigError naming the option."""
    base = AWS_LIKE if getattr(args, "aws_like", False) else Physics()
    given = {field: getattr(args, field) for field in _PHYSICS_OPTIONS
             if getattr(args, field, None) is not None}
    for field, value in given.items():
        if field != "cpu_share" and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"lambda emulator: {_PHYSICS_OPTIONS[field]} must be a finite "
                              f"number >= 0, got {value:g}")
    return dataclasses.replace(base, **given)


def faults_from_args(args: argparse.Namespace) -> FaultPlan | None:
    """The FaultPlan the --fault-* options ask for, or None when no fraction is set. Bad values
    raise ConfigError naming the option."""
    values = {field: getattr(args, option.lstrip("-").replace("-", "_"))
              for field, option in _FAULT_OPTIONS.items()}
    for field in ("raise_fraction", "crash_fraction", "hang_fraction", "straggle_fraction"):
        if not 0.0 <= values[field] <= 1.0:
            raise ConfigError(f"lambda emulator: {_FAULT_OPTIONS[field]} must be a fraction in "
                              f"[0, 1], got {values[field]:g}")
    if not (math.isfinite(values["straggle_factor"]) and values["straggle_factor"] >= 1):
        raise ConfigError(f"lambda emulator: --fault-straggle-factor must be a finite number "
                          f">= 1, got {values['straggle_factor']:g}")
    try:
        plan = FaultPlan(**values)
    except ValueError as exc:  # the fractions' sum
        total = sum(values[field] for field in _FAULT_OPTIONS if field.endswith("_fraction"))
        raise ConfigError(f"lambda emulator: --fault-raise, --fault-crash, --fault-hang and "
                          f"--fault-straggle sum to {total:g}; they must sum to at most 1"
                          ) from exc
    return plan if plan.active else None


def run_from_args(args: argparse.Namespace) -> int:
    """Serve in the foreground until SIGINT or SIGTERM, then shut down cleanly; returns 0."""
    logs.setup("lambda-emulator", args.log_level)
    check_port("--port", args.port)
    functions = parse_function_args(args.function) if args.function else None
    physics, faults = physics_from_args(args), faults_from_args(args)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with serve(args.host, args.port, functions, args.concurrency, args.memory_mb,
                   args.timeout_s, code_dirs=args.code_dir, physics=physics,
                   faults=faults) as server:
            logger.info("listening on %s (concurrency %d, memory %d MB)", server.url,
                        server.concurrency, server.memory_mb)
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
