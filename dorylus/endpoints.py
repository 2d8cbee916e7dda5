"""Validation of the addresses the roles listen on and dial, done before any role starts work.

Standard library only, so that checking options costs nothing before the heavy imports.
"""

from __future__ import annotations

import re

from dorylus.errors import ConfigError

# ZeroMQ spells "any free port" as "*"; the roles also accept 0 (see dorylus.paramserver._any_port).
_TCP = re.compile(r"tcp://(\[[^\]\s]+\]|[^:/\[\]\s]+):(\d+|\*)")
_OTHER = re.compile(r"(ipc|inproc)://\S+")


def check_port(option: str, port: int) -> int:
    """``port`` if it is a TCP port number, else a ConfigError naming ``option``."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{option} {port} is outside the port range 0-65535")
    return port


def check_endpoint(option: str, endpoint: str) -> str:
    """``endpoint`` if it has a ZeroMQ endpoint's form (``tcp://HOST:PORT``, ``ipc://PATH``,
    ``inproc://NAME``), else a ConfigError naming ``option`` and the value. Whether the host
    resolves or the port is free shows only when binding or connecting."""
    tcp = _TCP.fullmatch(endpoint)
    if tcp is None and not _OTHER.fullmatch(endpoint):
        raise ConfigError(f"{option} {endpoint!r} is not a ZeroMQ endpoint "
                          "(tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
    if tcp and tcp.group(2) != "*":
        check_port(f"{option} {endpoint}: port", int(tcp.group(2)))
    return endpoint
