"""Roles started by ``dorylus train`` stop with it, even when it exits before they are up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from dorylus.lifecycle import stop_with_parent

REPO = Path(__file__).resolve().parents[1]


def test_the_watch_stops_when_the_named_parent_is_not_the_parent():
    stopped = threading.Event()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)  # a launcher that exited before the watch started
    done = stop_with_parent(stopped.set, parent=gone.pid, interval_s=0.05)
    try:
        assert stopped.wait(5), "the watch did not notice that the launcher had gone"
    finally:
        done.set()


def test_the_watch_keeps_quiet_while_the_parent_lives():
    stopped = threading.Event()
    done = stop_with_parent(stopped.set, interval_s=0.02)
    try:
        assert not stopped.wait(0.3)
    finally:
        done.set()


def test_a_role_whose_launcher_exited_before_it_was_up_stops(tmp_path):
    """The parameter server is told its launcher's pid, which has already exited (the race that
    left orphans when a launcher died during the role's imports): it stops on its own."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"layers": 2, "hidden": 4}))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    role = subprocess.Popen([sys.executable, "-m", "dorylus.paramserver", "--config", str(config), "--num-features",
                             "5", "--num-classes", "3", "--bind", "tcp://127.0.0.1:0", "--exit-with-parent",
                             str(gone.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    try:
        out, err = role.communicate(timeout=60)
        assert role.returncode == 0, err
        assert f"paramserver[{role.pid}] INFO listening on tcp://127.0.0.1:" in err
    finally:
        if role.poll() is None:
            role.kill()
            role.communicate(timeout=30)


def test_freed_heap_memory_goes_back_to_the_system():
    """Small freed blocks stay resident in glibc's heap until malloc_trim; the coordinator calls
    release_freed_memory once partitioning is done. Run in a child, so this process's heap is not
    what is measured."""
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from dorylus.lifecycle import release_freed_memory\n"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024\n"
        "blocks = [np.ones(1000) for _ in range(50_000)]\n"  # 400 MB in 8 KB blocks: the heap, not mmap
        "del blocks\n"
        "before = rss()\n"
        "release_freed_memory()\n"
        "print(before, rss())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split())
    assert before > 300 and after < before - 250, (before, after)
