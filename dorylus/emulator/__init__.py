"""Local AWS Lambda emulator: the Invoke HTTP API backed by a pool of worker processes.

See :mod:`dorylus.emulator.server` for the API, the billing rules and the deliberate
differences from AWS.
"""

from __future__ import annotations

from dorylus.emulator.server import (
    DEFAULT_FUNCTIONS,
    EVENT_PAYLOAD_LIMIT,
    SYNC_PAYLOAD_LIMIT,
    EmulatorServer,
    add_arguments,
    billed_ms,
    run_from_args,
    serve,
)

__all__ = ["DEFAULT_FUNCTIONS", "EVENT_PAYLOAD_LIMIT", "SYNC_PAYLOAD_LIMIT", "EmulatorServer",
           "add_arguments", "billed_ms", "run_from_args", "serve"]
