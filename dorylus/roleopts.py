"""The options both server roles (``dorylus graphserver``, ``dorylus paramserver``) share:
CURVE keys, the address they advertise, and whether they live only as long as their parent.

Started by ``dorylus train`` (local mode) a role exits with its coordinator; started by hand or
by systemd (cluster mode) it waits for coordinators for as long as it runs, so the parent watch
is opt-in (``--exit-with-parent``)."""

from __future__ import annotations

import argparse
import threading
from typing import Callable

from dorylus.endpoints import check_advertise


def add_server_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--keys", metavar="DIR",
                        help=f"CURVE keys directory (`dorylus keys`, or the servers' copy from SSM): the socket "
                             f"becomes a CURVE server with DIR/{role}.secret that admits only the coordinator's, the "
                             "graph servers' and the function's public keys, each to its own operations "
                             "(default: no CURVE)")
    parser.add_argument("--advertise", metavar="HOST[:PORT]",
                        help="the address functions and peers dial, when it differs from --bind (e.g. bind "
                             "tcp://0.0.0.0:5500, advertise the private IP); PORT defaults to the bound one")
    parser.add_argument("--exit-with-parent", nargs="?", type=int, const=0, metavar="PID",
                        help="stop when the process that started this one (PID, if given: `dorylus train` names "
                             "the zygote it forks roles from, so an exit before this process is up counts too) is "
                             "no longer its parent; "
                             "by default the server keeps waiting for coordinators")


def watch_parent(args: argparse.Namespace, stop: Callable[[], None]) -> threading.Event | None:
    """``--exit-with-parent [PID]``: call ``stop()`` once the launcher (PID, else the parent at
    start) is no longer this process's parent; ``None`` without the option."""
    from dorylus.lifecycle import stop_with_parent

    if args.exit_with_parent is None:
        return None
    return stop_with_parent(stop, args.exit_with_parent or None)


def server_options(args: argparse.Namespace, role: str):
    """``(keys, advertise)`` from the parsed options, checked."""
    from dorylus.curve import load_keys

    advertise = check_advertise("--advertise", args.advertise) if args.advertise else None
    keys = load_keys(args.keys, role) if args.keys else None
    return keys, advertise
