"""Processes Dorylus starts locally: role processes end when the coordinator that started them
is gone, so even a coordinator killed with SIGKILL leaves no orphans behind; and every local
process (role or emulator sandbox) runs numpy's OpenBLAS with one thread (roles with two malloc
arenas)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
from collections.abc import Iterator
from typing import Callable

# Every local role and emulator sandbox shares the machine's cores, and an idle OpenBLAS pool
# spins after each product: with one pool per core in every process, epochs took 1.7x (cpu) to
# 2.5x (lambda) as long on 2 cores. Parallelism comes from the roles, intervals and sandboxes
# instead (a Lambda function under 1,769 MB has less than one vCPU anyway). The user's own
# setting wins.
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
# glibc gives each thread that allocates its own heap arena (up to 8 per core); a role's executor,
# numba and ZeroMQ threads each then keep freed interval-sized arrays in their own arena. Two
# arenas cut a graph server's peak RSS by ~190 MB on an ogbn-products-sized graph (2 parts: 2.94
# -> 2.75 GB and 2.55 -> 2.36 GB) at no measurable cost. The user's own setting wins.
MALLOC_ARENAS = "MALLOC_ARENA_MAX"
_environ_lock = threading.Lock()


def release_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's
    ``malloc_trim``; elsewhere nothing): freed memory below malloc's mmap threshold otherwise
    stays resident. The coordinator calls it once the partition store is written, so that what
    partitioning freed is not held through the whole run."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def in_forked_child(work: Callable[[], None], what: str, keep_out: str | None = None) -> None:
    """Run ``work`` in a forked child of this process and wait for it, so that what it imports
    and leaves allocated goes when it exits: the coordinator writes the partition store this
    way, whose locality order loads numba and its compiler (about 0.12 GB resident, private
    and the llvmlite library's pages, held through the whole run otherwise). The child sees
    this process's memory as it is (copy-on-write) and writes files only; an exception in it is
    raised here (its own when it pickles, else a :class:`~dorylus.errors.DorylusError` with its
    text), a child killed by a signal raises one too. ``work`` runs here instead where forking
    is unsafe (another Python thread runs, or no ``os.fork``) or would keep nothing out (the
    module ``keep_out`` is imported here already). Native threads (OpenBLAS's pool) do not
    count: OpenBLAS stops its pool at a fork."""
    import pickle
    import signal
    import sys

    from dorylus.errors import DorylusError

    if not hasattr(os, "fork") or threading.active_count() > 1 or (keep_out is not None and keep_out in sys.modules):
        work()
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's side (its coverage is not collected)
        status = 0
        try:
            os.close(read_end)
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
                status = 1
                try:
                    payload = pickle.dumps(exc)
                    pickle.loads(payload)  # some pickle but do not unpickle (required arguments)
                except Exception:  # noqa: BLE001 - an exception that does not travel: its text
                    payload = pickle.dumps(DorylusError(f"{type(exc).__name__}: {exc}"))
                with os.fdopen(write_end, "wb") as out:
                    out.write(payload)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(status)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as source:
            payload = source.read()
        _, status = os.waitpid(pid, 0)
    except BaseException:  # e.g. Ctrl-C here: the child must not outlive the wait
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    code = os.waitstatus_to_exitcode(status)
    if payload:
        raise pickle.loads(payload)
    if code != 0:
        raise DorylusError(f"{what} failed: its process "
                           + (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"))


def local_process_environment() -> dict[str, str]:
    """The environment for a role started locally: this one's, with one OpenBLAS thread and two
    malloc arenas unless the user set :data:`BLAS_THREADS` or :data:`MALLOC_ARENAS`."""
    return {**os.environ, BLAS_THREADS: os.environ.get(BLAS_THREADS, "1"),
            MALLOC_ARENAS: os.environ.get(MALLOC_ARENAS, "2")}


@contextlib.contextmanager
def one_blas_thread_for_children() -> Iterator[None]:
    """Within the block, processes started without an explicit environment (multiprocessing's
    'spawn' offers none) get one OpenBLAS thread unless the user set :data:`BLAS_THREADS`;
    this process's environment is restored afterwards."""
    with _environ_lock:
        if BLAS_THREADS in os.environ:
            yield
            return
        os.environ[BLAS_THREADS] = "1"
        try:
            yield
        finally:
            del os.environ[BLAS_THREADS]


def stop_with_parent(stop: Callable[[], None], parent: int | None = None, interval_s: float = 1.0) -> threading.Event:
    """Call ``stop()`` once this process's parent ``parent`` (default: the parent now) is not its
    parent any more: it exited, and this process was re-parented. A launcher names itself, so a
    parent that exits before the watch starts is noticed too. Runs in a daemon thread; set the
    returned event to end the watch."""
    parent = os.getppid() if parent is None else parent
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if os.getppid() != parent:
                stop()
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return done
