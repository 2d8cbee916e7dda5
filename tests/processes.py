"""Processes a test started, found through /proc, so that the test can check none is left."""

from __future__ import annotations

import time
from pathlib import Path


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc, except the processes that live as long as
    their interpreter by design: multiprocessing's resource tracker and the role zygote
    (:mod:`dorylus.zygote`, reused by every local run of the process). Roles forked from the
    zygote are its children, so one left behind is still found."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if alive(p) and b"resource_tracker" not in cmdline(p) and b"dorylus.zygote" not in cmdline(p)}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]
