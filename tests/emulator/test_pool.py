"""The emulator's sandboxes run numpy's OpenBLAS with one thread, as the local roles do."""

from __future__ import annotations

import os

import pytest

from dorylus.emulator.pool import WorkerPool


def _sandbox_environ(pool: WorkerPool) -> list[bytes]:
    (worker,) = pool._workers
    with open(f"/proc/{worker.process.pid}/environ", "rb") as f:
        return f.read().split(b"\0")


@pytest.mark.parametrize("user_setting", [None, "3"])
def test_sandboxes_get_one_openblas_thread_unless_the_user_chose(monkeypatch, user_setting):
    if user_setting is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", user_setting)
    pool = WorkerPool(1, start_timeout_s=60)
    try:
        assert f"OPENBLAS_NUM_THREADS={user_setting or 1}".encode() in _sandbox_environ(pool)
    finally:
        pool.close()
    # This process's own environment is left as it was.
    assert os.environ.get("OPENBLAS_NUM_THREADS") == user_setting


def test_workers_that_do_not_start_in_time_are_an_error_and_are_stopped(monkeypatch):
    """Each worker gets the whole start timeout after the one before it is ready; one that is
    not ready by then is named in the error, and every started worker is stopped."""
    from dorylus.emulator import pool as pool_module
    from dorylus.errors import DorylusError

    started = []
    spawn = WorkerPool._spawn
    monkeypatch.setattr(WorkerPool, "_spawn", lambda self: started.append(spawn(self)) or started[-1])
    waits = []
    wait_ready = pool_module._Worker.wait_ready
    monkeypatch.setattr(pool_module._Worker, "wait_ready",
                        lambda self, timeout_s: waits.append(timeout_s) or wait_ready(self, timeout_s))
    with pytest.raises(DorylusError, match=r"lambda-worker-\d+ did not start within 0.001 s of the one before it"):
        WorkerPool(2, start_timeout_s=0.001)  # an interpreter takes longer than a millisecond to start
    assert waits == [0.001]  # the first worker's own full timeout, not what was left of a shared one
    assert len(started) == 2 and all(not w.process.is_alive() for w in started)
