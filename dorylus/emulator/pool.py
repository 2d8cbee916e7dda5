"""A fixed-size pool of worker processes ("sandboxes"), each running one call at a time.

A call that outlives its timeout, and a worker that dies mid-call, end the worker: it is killed
and a fresh one takes its place, so the pool keeps its size. Callers bound the number of calls in
flight to the pool size (the server's concurrency limit), so :meth:`WorkerPool.run` always finds
a worker.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dorylus.emulator.worker import worker_main
from dorylus.errors import DorylusError

logger = logging.getLogger("dorylus.emulator")


@dataclass(frozen=True)
class Outcome:
    """What one call produced. ``body`` is the handler's JSON result when ``ok``, else Lambda's
    error object; ``duration_ns`` is the billable run time (import + handler; the full timeout
    for a call that timed out)."""

    ok: bool
    body: bytes
    duration_ns: int
    init_ns: int = 0
    log: str = ""
    max_rss_mb: int = 0


class _Worker:
    def __init__(self, ctx, name: str, code_dirs: tuple[str, ...]):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, code_dirs), name=name,
                                   daemon=True)
        self.process.start()
        child.close()
        self.ready = False
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
    ``code_dirs`` are put first on their import path."""

    def __init__(self, size: int, code_dirs: tuple[str, ...] = (), start_timeout_s: float = 60.0):
        self._ctx = multiprocessing.get_context("spawn")
        self._code_dirs = tuple(code_dirs)
        self._start_timeout_s = start_timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()  # None: the pool is closed
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._spawned = 0
        try:
            started = [self._spawn() for _ in range(size)]
            give_up = time.monotonic() + start_timeout_s
            for worker in started:
                if not worker.wait_ready(max(0.0, give_up - time.monotonic())):
                    raise DorylusError(
                        f"lambda emulator: worker process {worker.process.name} did not start "
                        f"within {start_timeout_s:g} s (exit code {worker.process.exitcode})")
        except BaseException:
            self.close()
            raise
        for worker in started:
            self._idle.put(worker)

    def _spawn(self) -> _Worker:
        with self._lock:
            self._spawned += 1
            worker = _Worker(self._ctx, f"lambda-worker-{self._spawned}", self._code_dirs)
            self._workers.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker whose sandbox is spoiled and, unless closing, start its replacement."""
        worker.stop()
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
        try:
            self._idle.put(self._spawn())
        except Exception:  # e.g. out of processes: the pool shrinks, calls still get answers
            logger.exception("lambda emulator: could not start a replacement worker")

    def run(self, call: dict[str, Any], timeout_s: float) -> Outcome:
        """Run ``call`` (see :func:`dorylus.emulator.worker.run_call`; ``deadline`` and
        ``log_stream_name`` are filled in here) within ``timeout_s`` seconds."""
        request_id = call["request_id"]
        try:
            worker = self._idle.get(timeout=self._start_timeout_s)
        except queue.Empty:
            return _failure(request_id, "ServiceException", "no worker process available", 0)
        if worker is None:
            self._idle.put(None)  # wake the next waiter too
            return _failure(request_id, "ServiceException", "the emulator is shutting down", 0)
        # A replacement may still be starting: waiting for it is a cold start, not billed.
        if not worker.wait_ready(self._start_timeout_s):
            self._retire(worker)
            return _failure(request_id, "Runtime.ExitError",
                            "Runtime exited without providing a reason", 0)
        start = time.monotonic()
        kind, result = worker.exchange(
            {**call, "deadline": start + timeout_s, "log_stream_name": worker.log_stream_name},
            timeout_s)
        if kind == "ok":
            self._idle.put(worker)
            return Outcome(**result)
        elapsed_ns = int((time.monotonic() - start) * 1e9)
        self._retire(worker)
        if kind == "timeout":
            return _failure(request_id, "Sandbox.Timedout",
                            f"Task timed out after {timeout_s:.2f} seconds", int(timeout_s * 1e9))
        return _failure(request_id, "Runtime.ExitError",
                        f"Runtime exited with error: {_exit_description(result)}", elapsed_ns)

    def close(self) -> None:
        """Stop every worker (idle or busy); calls still running end as Runtime.ExitError."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        self._idle.put(None)
        for worker in workers:
            worker.stop()
