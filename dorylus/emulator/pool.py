"""A fixed-size pool of worker processes ("sandboxes"), each running one call at a time.

A call that outlives its timeout, and a worker that dies mid-call, end the worker: it is killed
and a fresh one takes its place, so the pool keeps its size. Callers bound the number of calls in
flight to the pool size (the server's concurrency limit), so :meth:`WorkerPool.run` always finds
a worker.

Placement follows Lambda's: a call goes to the idle worker that ran its function most recently,
if that was within ``keep_warm_s`` (a warm start); otherwise to another idle worker, and the call
is a cold start (``Outcome.cold``; the worker sleeps the call's ``cold_start_ms``, billed as
INIT). So sequential calls reuse one warm worker, and only calls that overlap spread out.

A call may carry an ``affinity`` (any hashable: the emulator's ``affinity`` function of its
payload). Among the warm idle workers, one whose last call had the same affinity is preferred:
Lambda promises no placement, so this is one of the placements it may make, and the one that
keeps a sandbox's cached data (the tensor function caches its interval's static rows) from
being copied into every sandbox of this one machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dorylus.emulator.worker import worker_main
from dorylus.errors import DorylusError
from dorylus.lifecycle import one_blas_thread_for_children

logger = logging.getLogger("dorylus.emulator")


@dataclass(frozen=True)
class Outcome:
    """What one call produced. ``body`` is the handler's JSON result when ``ok``, else Lambda's
    error object; ``duration_ns`` is the billable run time (import + handler; the full timeout
    for a call that timed out); ``cold``: the call was a cold start on its worker."""

    ok: bool
    body: bytes
    duration_ns: int
    init_ns: int = 0
    log: str = ""
    max_rss_mb: int = 0
    cold: bool = False


class _Worker:
    def __init__(self, ctx, name: str, code_dirs: tuple[str, ...]):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, code_dirs), name=name,
                                   daemon=True)
        with one_blas_thread_for_children():
            self.process.start()
        child.close()
        self.ready = False
        self.last_call_end: dict[str, float] = {}  # handler spec -> time.monotonic()
        self.last_affinity: tuple[str, Any] | None = None  # (handler spec, affinity) of its last call
        self.idle_since = 0.0
        self._stop_lock = threading.Lock()
        # One log stream per sandbox, named like Lambda's: date/[version]id.
        day = datetime.now(timezone.utc).strftime("%Y/%m/%d")
        self.log_stream_name = f"{day}/[$LATEST]{uuid.uuid4().hex}"

    def wait_ready(self, timeout_s: float) -> bool:
        if not self.ready:
            try:
                self.ready = self.conn.poll(timeout_s) and self.conn.recv()[0] == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def ready_now(self) -> bool:
        """Whether the worker has started (without waiting, without consuming its message)."""
        try:
            return self.ready or self.conn.poll(0)
        except (EOFError, OSError):
            return False

    def exchange(self, call: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
        """Send one call and wait for its result.
        -> ("ok", result) | ("timeout", None) | ("exit", exit code)"""
        try:
            self.conn.send(call)
            ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], timeout_s)
            if not ready:
                return "timeout", None
            if self.conn in ready:
                return "ok", self.conn.recv()
        except (EOFError, OSError):
            pass
        self.process.join(1.0)
        return "exit", self.process.exitcode

    def stop(self, timeout_s: float = 5.0) -> None:
        # SIGKILL, as Lambda ends a sandbox: a handler cannot delay or block it, and a worker
        # holds nothing that needs flushing.
        with self._stop_lock:  # close() and a failing call's thread may both retire this worker
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout_s)
            if not self.conn.closed:
                self.conn.close()


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"signal: {(signal.strsignal(-exitcode) or str(-exitcode)).lower()}"
        except ValueError:
            return f"signal: {-exitcode}"
    return f"exit status {exitcode}"


def _failure(request_id: str, error_type: str, message: str, duration_ns: int) -> Outcome:
    body = json.dumps({"errorMessage": f"RequestId: {request_id} Error: {message}",
                       "errorType": error_type}).encode()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    log = (f"START RequestId: {request_id} Version: $LATEST\n"
           f"{stamp} {request_id} {message}\nEND RequestId: {request_id}\n")
    return Outcome(ok=False, body=body, duration_ns=duration_ns, log=log)


class WorkerPool:
    """``size`` worker processes started with the 'spawn' method (safe in a threaded server);
    ``code_dirs`` are put first on their import path; a worker stays warm for a function for
    ``keep_warm_s`` after its last call of it."""

    def __init__(self, size: int, code_dirs: tuple[str, ...] = (), start_timeout_s: float = 60.0,
                 keep_warm_s: float = math.inf):
        self._ctx = multiprocessing.get_context("spawn")
        self._code_dirs = tuple(code_dirs)
        self._start_timeout_s = start_timeout_s
        self._keep_warm_s = keep_warm_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a worker became idle, or closing
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()
        self._closed = False
        self._spawned = 0
        try:
            started = [self._spawn() for _ in range(size)]
            # Each worker gets the whole timeout after the one before it is ready: they start
            # together, so on a loaded machine the last is ready soon after the first, while one
            # budget for all (60 s) ran out at load 20 with workers still making progress.
            for worker in started:
                if not worker.wait_ready(start_timeout_s):
                    raise DorylusError(
                        f"lambda emulator: worker process {worker.process.name} did not start "
                        f"within {start_timeout_s:g} s of the one before it (exit code {worker.process.exitcode})")
        except BaseException:
            self.close()
            raise
        for worker in started:
            self._release(worker)

    def _spawn(self) -> _Worker:
        with self._lock:
            self._spawned += 1
            worker = _Worker(self._ctx, f"lambda-worker-{self._spawned}", self._code_dirs)
            self._workers.add(worker)
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            worker.idle_since = time.monotonic()
            self._idle.append(worker)
            self._changed.notify()

    def _acquire(self, spec: str, affinity: Any = None) -> tuple[_Worker | None, bool]:
        """An idle worker for a call of ``spec`` (of ``affinity``) and whether the call is a cold
        start there; (None, False) when the pool is closed or none came free within the start
        timeout."""
        give_up = time.monotonic() + self._start_timeout_s
        with self._lock:
            while not self._idle and not self._closed:
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    return None, False
                self._changed.wait(remaining)
            if self._closed:
                return None, False
            now = time.monotonic()

            def preference(worker: _Worker) -> tuple:
                last = worker.last_call_end.get(spec)
                warm = last is not None and now - last <= self._keep_warm_s
                # Warm for this function, of the call's affinity first, most recent first; else a
                # started worker, and among those the one idle the shortest (it is likely still
                # in the CPU's caches).
                same = warm and affinity is not None and worker.last_affinity == (spec, affinity)
                return (warm, same, last if warm else 0.0, worker.ready_now(), worker.idle_since)

            worker = max(self._idle, key=preference)
            self._idle.remove(worker)
            last = worker.last_call_end.get(spec)
            return worker, not (last is not None and now - last <= self._keep_warm_s)

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker whose sandbox is spoiled and, unless closing, start its replacement."""
        worker.stop()
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
        try:
            self._release(self._spawn())
        except Exception:  # e.g. out of processes: the pool shrinks, calls still get answers
            logger.exception("lambda emulator: could not start a replacement worker")

    def run(self, call: dict[str, Any], timeout_s: float) -> Outcome:
        """Run ``call`` (see :func:`dorylus.emulator.worker.run_call`; ``deadline``, ``cold``
        and ``log_stream_name`` are filled in here) within ``timeout_s`` seconds."""
        request_id, spec, affinity = call["request_id"], call["handler"], call.get("affinity")
        worker, cold = self._acquire(spec, affinity)
        if worker is None:
            with self._lock:
                closed = self._closed
            return _failure(request_id, "ServiceException", "the emulator is shutting down"
                            if closed else "no worker process available", 0)
        # A replacement may still be starting: waiting for it is sandbox setup, not billed.
        if not worker.wait_ready(self._start_timeout_s):
            self._retire(worker)
            return _failure(request_id, "Runtime.ExitError",
                            "Runtime exited without providing a reason", 0)
        start = time.monotonic()
        kind, result = worker.exchange(
            {**call, "deadline": start + timeout_s, "cold": cold,
             "log_stream_name": worker.log_stream_name}, timeout_s)
        if kind == "ok":
            worker.last_call_end[spec] = time.monotonic()
            worker.last_affinity = (spec, affinity)
            self._release(worker)
            return Outcome(**result, cold=cold)
        elapsed_ns = int((time.monotonic() - start) * 1e9)
        self._retire(worker)
        injected = " (fault injected by the emulator)" if call.get("fault") else ""
        if kind == "timeout":
            outcome = _failure(request_id, "Sandbox.Timedout",
                               f"Task timed out after {timeout_s:.2f} seconds{injected}",
                               int(timeout_s * 1e9))
        else:
            outcome = _failure(request_id, "Runtime.ExitError",
                               f"Runtime exited with error: {_exit_description(result)}{injected}",
                               elapsed_ns)
        return dataclasses.replace(outcome, cold=cold)

    def close(self) -> None:
        """Stop every worker (idle or busy); calls still running end as Runtime.ExitError."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
            self._idle.clear()
            self._changed.notify_all()
        for worker in workers:
            worker.stop()
