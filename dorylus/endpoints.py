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


_ADVERTISE = re.compile(r"(\[[^\]\s]+\]|[^:/\[\]\s]+)(?::(\d+))?")


def check_advertise(option: str, value: str) -> str:
    """``value`` if it is ``HOST`` or ``HOST:PORT`` (what a function or peer dials instead of
    the bound address), else a ConfigError naming ``option``."""
    match = _ADVERTISE.fullmatch(value)
    if match is None or match.group(1) in ("*", "0.0.0.0", "[::]"):
        raise ConfigError(f"{option} {value!r} is not HOST or HOST:PORT of an address others can dial")
    if match.group(2) is not None and not 1 <= int(match.group(2)) <= 65535:
        raise ConfigError(f"{option} {value}: port {match.group(2)} is outside 1-65535")
    return value


def advertised_endpoint(bound: str, advertise: str | None) -> str:
    """The endpoint others dial: ``tcp://`` + ``advertise`` (its port defaults to the bound
    one), or the bound endpoint itself when nothing is advertised."""
    if advertise is None:
        return bound
    match = _ADVERTISE.fullmatch(check_advertise("--advertise", advertise))
    tcp = _TCP.fullmatch(bound)
    if tcp is None:
        raise ConfigError(f"--advertise {advertise}: only a tcp:// endpoint can be advertised, bound to {bound}")
    return f"tcp://{match.group(1)}:{match.group(2) or tcp.group(2)}"
