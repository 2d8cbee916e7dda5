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


def test_work_in_a_forked_child_leaves_its_imports_there_and_raises_its_errors_here(tmp_path):
    """The coordinator writes the partition store through in_forked_child, so that numba stays
    out of it: what the work imports is not imported here, its files are, its exceptions are
    raised here, a child killed by a signal is an error; with a second thread, or with the
    module to keep out imported already, the work runs here. In a fresh interpreter: pytest's
    own may run threads."""
    script = (
        "import json, os, signal, sys, threading\n"
        "from pathlib import Path\n"
        "from dorylus.errors import DorylusError\n"
        "from dorylus.lifecycle import in_forked_child\n"
        "out = {}\n"
        "def work():\n"
        "    import colorsys\n"
        f"    Path({str(tmp_path / 'written')!r}).write_text('by the child')\n"
        "in_forked_child(work, 'the work')\n"
        f"out['written'] = Path({str(tmp_path / 'written')!r}).read_text()\n"
        "out['imported_here'] = 'colorsys' in sys.modules\n"
        "def fails():\n"
        "    raise ValueError('bad rows')\n"
        "def unpicklable():\n"
        "    class Local(Exception): pass\n"
        "    raise Local('not picklable')\n"
        "def killed():\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "for name, fn in (('fails', fails), ('unpicklable', unpicklable), ('killed', killed)):\n"
        "    try:\n"
        "        in_forked_child(fn, 'the work')\n"
        "    except Exception as exc:\n"
        "        out[name] = [type(exc).__name__, str(exc)]\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        "in_forked_child(work, 'the work')\n"
        "stop.set(); t.join()\n"
        "out['imported_with_a_thread'] = 'colorsys' in sys.modules\n"
        f"pid_file = Path({str(tmp_path / 'pid')!r})\n"
        "in_forked_child(lambda: pid_file.write_text(str(os.getpid())), 'the work', keep_out='colorsys')\n"
        "out['ran_here_when_kept_out_is_imported'] = pid_file.read_text() == str(os.getpid())\n"
        "in_forked_child(lambda: pid_file.write_text(str(os.getpid())), 'the work', keep_out='not_imported')\n"
        "out['forked_otherwise'] = pid_file.read_text() != str(os.getpid())\n"
        "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["written"] == "by the child" and out["imported_here"] is False
    assert out["fails"] == ["ValueError", "bad rows"]
    assert out["unpicklable"] == ["DorylusError", "Local: not picklable"]
    assert out["killed"] == ["DorylusError", "the work failed: its process was killed by signal 9"]
    assert out["imported_with_a_thread"] is True
    assert out["ran_here_when_kept_out_is_imported"] is True and out["forked_otherwise"] is True
