"""Local AWS Lambda emulator: the Invoke HTTP API backed by a pool of worker processes.

See :mod:`dorylus.emulator.server` for the API, the billing rules and the deliberate
differences from AWS.
"""

from __future__ import annotations

__all__ = ["DEFAULT_FUNCTIONS", "EVENT_PAYLOAD_LIMIT", "SYNC_PAYLOAD_LIMIT", "EmulatorServer",
           "add_arguments", "billed_ms", "run_from_args", "serve"]


def __getattr__(name: str):
    # The server's names load with their first use, so that a graph server or the config that
    # needs only dorylus.emulator.physics does not import the HTTP server and its pool.
    if name in __all__:
        from dorylus.emulator import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
