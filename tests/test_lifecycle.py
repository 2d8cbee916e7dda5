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
