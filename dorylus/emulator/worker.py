"""Worker process of the Lambda emulator: one sandbox that runs one call at a time.

The server talks to a worker over a multiprocessing pipe with pickled messages:

* worker -> server, once at start: ``("ready", pid)``
* server -> worker: a call ``dict`` (see :func:`run_call`), or ``None`` to exit
* worker -> server: a result ``dict``: ``ok`` (bool), ``body`` (bytes: the handler's JSON
  result, or Lambda's error object ``{"errorMessage", "errorType", "requestId", "stackTrace"}``),
  ``duration_ns`` (import + handler wall time in this process), ``init_ns`` (import part),
  ``log`` (what the call printed and logged, framed by Lambda's START/END lines), ``max_rss_mb``.

A call dict may also carry the server's physics and fault plan, already resolved for the call
(all optional): ``cold`` (bool: this worker has not run the function within the keep-warm
window) and ``cold_start_ms`` (slept, billed as INIT, when cold), ``vcpus`` (the CPU share the
call's memory buys; CPU work beyond it stretches the call, see
:func:`dorylus.emulator.physics.cpu_stretch_s`), ``bandwidth_bytes_per_s`` (exposed on the
context), ``fault`` (``raise``, ``crash``, ``hang`` or ``straggle``, see
:mod:`dorylus.emulator.faults`) and ``straggle_factor``.

The handler's :mod:`logging` records reach the call's log as Lambda's Python runtime writes them
to CloudWatch: ``[LEVEL]\tUTC time\trequest id\tmessage``, through a handler on the root logger,
whose level stays Python's default (WARNING) as in Lambda: a function that wants INFO records
sets its logger's level.

Timeouts and crashes are the server's business: it kills this process and starts another, the
way Lambda discards a sandbox. A worker whose server process is gone exits within a second,
even in the middle of a call. Only the standard library is imported here, so a fresh worker
starts fast.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any, Callable

from dorylus.emulator.physics import cpu_stretch_s

CRASH_EXIT_STATUS = 1  # what an injected crash exits with, like a runtime that died
PARENT_GONE_EXIT_STATUS = 1  # a worker whose server died (no one reads it: the server is gone)
HANG_GRACE_S = 5.0  # an injected hang outlives its deadline by this much (the server kills it)


class LambdaContext:
    """The context object that Lambda's Python runtime passes as the handler's second argument.

    ``memory_limit_in_mb`` is a string, as in the real runtime, so that code written against
    the emulator behaves the same in AWS. ``bandwidth_bytes_per_s`` is the emulator's own
    addition (absent in AWS): the cap on the call's network traffic in bytes/s, or None.
    """

    def __init__(self, call: dict[str, Any]):
        self.function_name: str = call["function_name"]
        self.function_version: str = "$LATEST"
        self.invoked_function_arn: str = call["invoked_function_arn"]
        self.memory_limit_in_mb: str = str(call["memory_mb"])
        self.aws_request_id: str = call["request_id"]
        self.log_group_name: str = f"/aws/lambda/{self.function_name}"
        self.log_stream_name: str = call["log_stream_name"]
        self.identity = None
        self.client_context = None
        self.bandwidth_bytes_per_s: float | None = call.get("bandwidth_bytes_per_s")
        self._deadline = call["deadline"]  # time.monotonic() value, shared clock with the server

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


@contextlib.contextmanager
def _call_logging(log: io.StringIO, request_id: str):
    """What Lambda's runtime puts on the root logger: the call's records, in its log, stamped
    with its request id (an emulator request id is a UUID: no ``%`` for the format to trip on)."""
    handler = logging.StreamHandler(log)
    formatter = logging.Formatter(f"[%(levelname)s]\t%(asctime)s.%(msecs)03dZ\t{request_id}\t%(message)s",
                                  "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def _error_body(request_id: str, error_type: str, message: str, stack: list[str]) -> bytes:
    return json.dumps({"errorMessage": message, "errorType": error_type,
                       "requestId": request_id, "stackTrace": stack}).encode()


class InjectedFault(Exception):
    """A function error that the emulator's fault plan injected."""


class _InjectedHang(Exception):
    """An injected hang that outlived the server (which normally kills the worker first)."""


class _HandlerLoadError(Exception):
    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


def _load_handler(spec: str) -> Callable[[Any, LambdaContext], Any]:
    """Import ``package.module:function``; failures get the error types Lambda reports."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the module raises on import, like Lambda's INIT
        raise _HandlerLoadError("Runtime.ImportModuleError",
                                f"Unable to import module '{module_name}': {exc}") from exc
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise _HandlerLoadError("Runtime.HandlerNotFound",
                                f"Handler '{attr}' missing on module '{module_name}'")
    return handler


def run_call(call: dict[str, Any], handlers: dict[str, Callable]) -> dict[str, Any]:
    """Run one invocation. ``call`` keys: request_id, function_name, handler (spec),
    invoked_function_arn, memory_mb, deadline, log_stream_name, region, payload (JSON bytes,
    empty means ``{}``), the optional ``environment`` (variables set before the call, as Lambda's
    function configuration does) and the optional physics and fault keys of the module docstring."""
    request_id, spec = call["request_id"], call["handler"]
    fault = call.get("fault")
    os.environ.update(call.get("environment") or {})
    os.environ.update(AWS_LAMBDA_FUNCTION_NAME=call["function_name"],
                      AWS_LAMBDA_FUNCTION_VERSION="$LATEST",
                      AWS_LAMBDA_FUNCTION_MEMORY_SIZE=str(call["memory_mb"]),
                      AWS_REGION=call["region"], AWS_DEFAULT_REGION=call["region"])
    log = io.StringIO()
    log.write(f"START RequestId: {request_id} Version: $LATEST\n")
    ok, init_ns = False, 0
    start = time.perf_counter_ns()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), _call_logging(log, request_id):
        try:
            cold_start_ms = call.get("cold_start_ms", 0.0) if call.get("cold") else 0.0
            if cold_start_ms:
                time.sleep(cold_start_ms / 1000)
            handler = handlers.get(spec)
            if handler is None:
                handler = handlers[spec] = _load_handler(spec)
                init_ns = time.perf_counter_ns() - start
            elif cold_start_ms:
                init_ns = time.perf_counter_ns() - start
            if fault:
                _play_fault(fault, call)
            payload = call["payload"]
            event = json.loads(payload) if payload.strip() else {}
            result = _run_handler(handler, event, call)
            try:
                body, ok = json.dumps(result).encode(), True
            except (TypeError, ValueError) as exc:
                body = _error_body(request_id, "Runtime.MarshalError",
                                   f"Unable to marshal response: {exc}", [])
        except _HandlerLoadError as exc:
            body = _error_body(request_id, exc.error_type, str(exc), [])
            log.write(f"[ERROR] {exc.error_type}: {exc}\n")  # the runtime's own line, not a record
        except _InjectedHang as exc:
            body = _error_body(request_id, "Sandbox.Timedout", str(exc), [])
        except Exception as exc:
            # Drop this module's own frames, as Lambda drops its runtime's frames.
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next
            stack = traceback.format_tb(tb) if tb is not None else []
            body = _error_body(request_id, type(exc).__name__, str(exc), stack)
            log.write(f"[ERROR] {type(exc).__name__}: {exc}\n{''.join(stack)}")
    duration_ns = time.perf_counter_ns() - start
    log.write(f"END RequestId: {request_id}\n")
    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # Linux: KiB
    return {"ok": ok, "body": body, "duration_ns": duration_ns, "init_ns": init_ns,
            "log": log.getvalue(), "max_rss_mb": max_rss_mb}


def _play_fault(fault: str, call: dict[str, Any]) -> None:
    """The faults that replace the handler: raise, crash, hang (straggle is in _run_handler)."""
    if fault == "raise":
        raise InjectedFault("fault injected by the Lambda emulator: this call fails on purpose")
    if fault == "crash":
        os._exit(CRASH_EXIT_STATUS)
    if fault == "hang":
        # The server kills this worker at the deadline; if no one does, give up a bit later.
        time.sleep(max(0.0, call["deadline"] - time.monotonic()) + HANG_GRACE_S)
        raise _InjectedHang("fault injected by the Lambda emulator: the call hung past its "
                            "deadline")


def _run_handler(handler: Callable, event: Any, call: dict[str, Any]) -> Any:
    """Call the handler, then stretch the call to the CPU share its memory buys and, for an
    injected straggler, slow it down by ``straggle_factor`` (also when the handler raised)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        return handler(event, LambdaContext(call))
    finally:
        wall_s = time.perf_counter() - wall0
        stretch_s = cpu_stretch_s(time.process_time() - cpu0, wall_s, call.get("vcpus"))
        if call.get("fault") == "straggle":
            stretch_s += (call.get("straggle_factor", 1.0) - 1) * (wall_s + stretch_s)
        if stretch_s > 0:
            time.sleep(stretch_s)


def worker_main(conn, code_dirs: tuple[str, ...] = ()) -> None:
    """Process entry point: serve calls from ``conn`` until ``None`` or the pipe closes.
    ``code_dirs`` go first on the import path, as a function's code directory does in Lambda."""
    from dorylus.lifecycle import stop_with_parent

    sys.path[:0] = list(code_dirs)
    # Ctrl-C reaches the whole process group; the server decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A server killed outright closes the pipe, which ends an idle worker; a worker inside a call
    # (a handler waiting up to minutes on servers that died with it) ends here, as its sandbox would.
    stop_with_parent(lambda: os._exit(PARENT_GONE_EXIT_STATUS))
    handlers: dict[str, Callable] = {}
    try:
        conn.send(("ready", os.getpid()))
        while (call := conn.recv()) is not None:
            conn.send(run_call(call, handlers))
    except (EOFError, OSError):  # the server is gone (killed, say): no one is left to answer
        pass
