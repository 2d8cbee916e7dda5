"""Role processes end when the coordinator that started them is gone, so even a coordinator
killed with SIGKILL leaves no orphans behind."""

from __future__ import annotations

import os
import threading
from typing import Callable


def stop_with_parent(stop: Callable[[], None], interval_s: float = 1.0) -> threading.Event:
    """Call ``stop()`` once this process's parent exits (it is re-parented). Runs in a daemon
    thread; set the returned event to end the watch."""
    parent = os.getppid()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if os.getppid() != parent:
                stop()
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return done
