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
