"""Helpers shared by the benchmark scripts (run as ``python benchmarks/bench_*.py``)."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any

from dorylus import atomic
from dorylus import protocol as P


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` to ``path`` atomically (a temp file in the same directory, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, result, indent=1, mode=0o644)


def machine_info(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    """What a result depends on besides its code: platform, versions, cores, torch threads, load."""
    import numpy as np
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "load_average_before": load_before,
            "load_average_after": load_after}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def status_kb(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmHWM``, the resident high-water mark)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def routed_requests(sock, bounds: P.Bounds, timeout_s: float):
    """``(identity, request, tensors)`` of each well-formed request on the ROUTER ``sock``, as a
    role's receive loop takes them: a malformed one is answered with its error (when its sender
    is known) and skipped; the requests end when none comes within ``timeout_s`` (the client
    went away)."""
    while True:
        try:
            yield P.recv_routed(sock, bounds, timeout=timeout_s)
        except P.ProtocolError as exc:
            if exc.identity is not None:
                P.send_routed(sock, exc.identity, P.error_reply(None, exc))
        except TimeoutError:
            return
