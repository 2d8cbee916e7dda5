"""Emulator workers whose server was SIGKILLed exit quietly, even with a call in flight: a
short one (its reply meets a broken pipe) and one that would run for a minute (the worker's
parent watch ends it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.processes import alive, children_of, cmdline

from .test_server import CODE_DIR, H, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_workers_exit_quietly_when_the_server_is_killed(tmp_path):
    stderr = tmp_path / "stderr"
    workers: set[int] = set()
    # A file, not a pipe: the orphaned workers inherit it and keep writing after the server died.
    with open(stderr, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "dorylus.cli", "lambda-emulator", "--port", "0", "--concurrency", "3",
             "--function", f"sleep={H}:sleep", "--code-dir", CODE_DIR],
            stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=REPO)
    try:
        wait_until(lambda: "listening on" in stderr.read_text(), timeout_s=60, what="the emulator's listening line")
        listening = stderr.read_text()
        url = re.search(r"http://\S+", listening).group(0)
        workers = children_of(process.pid)  # the three workers (multiprocessing's resource tracker is left out)
        assert len(workers) == 3, [cmdline(pid) for pid in workers]
        # Two workers busy in calls of 1 s and 60 s, one idle in recv().
        for seconds in (1.0, 60.0):
            request = urllib.request.Request(f"{url}/2015-03-31/functions/sleep/invocations", method="POST",
                                             data=json.dumps({"seconds": seconds}).encode(),
                                             headers={"X-Amz-Invocation-Type": "Event"})
            assert urllib.request.urlopen(request, timeout=10).status == 202
        time.sleep(0.3)  # let the calls reach their workers
        process.kill()
        process.wait(timeout=10)
        wait_until(lambda: not any(map(alive, workers)), timeout_s=20, what="the orphaned processes to exit")
        assert stderr.read_text() == listening  # nothing after the server's own record
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
