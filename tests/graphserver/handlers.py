"""Handler functions the invoker tests register (imported in the emulator's worker processes).

Each misbehaves on some attempts only, reading ``event["attempt"]`` as the invoker sets it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def sleep(event, context):
    """Sleep ``event["seconds"]`` and report it with the attempt number."""
    time.sleep(event["seconds"])
    return {"slept": event["seconds"], "attempt": event["attempt"]}


def fail_first(event, context):
    """Raise on attempts below ``event["fail_until"]`` (default 1); succeed after."""
    if event["attempt"] < event.get("fail_until", 1):
        raise ValueError(f"attempt {event['attempt']} fails on purpose")
    return {"attempt": event["attempt"]}


def fail(event, context):
    """Raise on every attempt."""
    raise ValueError(f"{event.get('message', 'boom')} (attempt {event['attempt']})")


def straggle_first(event, context):
    """Sleep ``event["straggle_s"]`` on attempt 0 only, then answer. With ``event["release"]`` (a
    path), attempt 0 instead waits until that file exists, at most ``straggle_s``: the test, not
    the machine's load, decides when the straggler may answer."""
    if event["attempt"] == 0:
        release = event.get("release")
        until = time.monotonic() + event["straggle_s"]
        while time.monotonic() < until and not (release and Path(release).exists()):
            time.sleep(0.01 if release else max(0.0, until - time.monotonic()))
    return {"attempt": event["attempt"]}


def crash_first(event, context):
    """Kill the sandbox (``Runtime.ExitError``) on attempt 0; succeed after."""
    if event["attempt"] == 0:
        os._exit(3)
    return {"attempt": event["attempt"]}


def stash_released(event, context):
    """Fails as the real function does when its call's stashed weights are gone."""
    from lambdas.handler import StashReleased

    raise StashReleased("parameter server refused PULL_WEIGHTS: out_of_range: no weights stashed")
