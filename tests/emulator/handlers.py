"""Handler functions the emulator tests register (imported in the emulator's worker processes)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path


def echo(event, context):
    """Return the event, the context's fields and two remaining-time readings 20 ms apart."""
    first = context.get_remaining_time_in_millis()
    time.sleep(0.02)
    second = context.get_remaining_time_in_millis()
    return {
        "event": event,
        "pid": os.getpid(),
        "remaining_ms": [first, second],
        "context": {name: getattr(context, name) for name in (
            "function_name", "function_version", "invoked_function_arn", "memory_limit_in_mb",
            "aws_request_id", "log_group_name", "log_stream_name")},
        "env_function_name": os.environ.get("AWS_LAMBDA_FUNCTION_NAME"),
    }


def sleep(event, context):
    """Sleep ``event["seconds"]``, then append the request id to ``event["marker"]`` if given."""
    time.sleep(event["seconds"])
    if "marker" in event:
        with open(event["marker"], "a") as f:
            f.write(context.aws_request_id + "\n")
    return {"slept": event["seconds"]}


def pid(event, context):
    """Sleep ``event["seconds"]`` and return the sandbox's process id."""
    time.sleep(event["seconds"])
    return os.getpid()


def noop(event, context):
    return None


def fail(event, context):
    raise ValueError(event.get("message", "boom"))


def crash(event, context):
    os._exit(3)


def unserializable(event, context):
    return {"value": object()}


def chatty(event, context):
    for _ in range(event.get("lines", 1)):
        print(f"hello from {context.function_name}: {event['word']}")
    return "ok"


def logs(event, context):
    """Log as a Lambda function does: its own logger at INFO, the root left as the runtime set it."""
    logger = logging.getLogger("tests.emulator.logs")
    logger.setLevel(logging.INFO)
    logger.info("said: %s", event["word"])
    logging.getLogger("tests.emulator.quiet").info("below the root's level")
    return "ok"


def big(event, context):
    return "a" * event["n"]


def touch(event, context):
    """Create ``event["marker"]``: evidence that the call ran.

    Written beside and renamed into place so that a test polling for the file never reads it
    created but still empty.
    """
    marker = Path(event["marker"])
    partial = marker.with_name(marker.name + ".partial")
    partial.write_text(context.aws_request_id)
    partial.replace(marker)
    return None


def spin(event, context):
    """Burn ``event["cpu_s"]`` seconds of CPU; return the wall and CPU time it took."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - cpu0 < event["cpu_s"]:
        for i in range(10_000):
            x += i * i
    return {"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0}


def bandwidth(event, context):
    return getattr(context, "bandwidth_bytes_per_s", None)


def environment(event, context):
    """The values of the environment variables named in ``event["names"]``."""
    return {name: os.environ.get(name) for name in event["names"]}
