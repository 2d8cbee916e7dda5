"""An asyncio concurrency limiter that admits waiters by priority, with a capacity settable at run time.

``async with limiter.slot(priority):`` holds one of ``capacity`` slots. When none is free the caller
waits; waiters are admitted lowest priority tuple first, ties first come first served. The limiter
only compares the tuples; the graph server passes Dorylus's (DESIGN §3), e.g. ``(epoch, pass,
stage, interval)``, so older epochs and earlier stages go first.

``limiter.capacity = n`` (n >= 1) may be set at any time: raising it admits waiters at once;
lowering it takes effect as holders release (running holders are never pre-empted, so ``in_use``
can exceed ``capacity`` for a while).

A waiter cancelled while queued leaves the queue; one cancelled just after it was granted a slot
(before it resumed) hands the slot back, so cancellation never leaks a slot.

:meth:`PriorityLimiter.take_stats` returns and resets the idle/busy accounting an autotuner needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from typing import AsyncIterator


class PriorityLimiter:
    def __init__(self, capacity: int, *, clock=time.monotonic):
        self._capacity = self._check(capacity)
        self._clock = clock
        self._in_use = 0
        self._waiting = 0
        self._heap: list[tuple[tuple, int, asyncio.Future]] = []  # (priority, seq, future); cancelled ones lazily
        self._seq = itertools.count()
        now = clock()
        self._last = now  # time of the last change of in_use or waiting
        self._stats_since = now
        self._busy_s = 0.0  # integral of in_use over time
        self._wait_s = 0.0  # integral of waiting over time = sum of the waiters' waiting times
        self._max_waiting = 0

    @staticmethod
    def _check(capacity: int) -> int:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, not {capacity!r}")
        return capacity

    # -- state ----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = self._check(value)
        self._admit()

    @property
    def in_use(self) -> int:
        """Slots held now (may exceed ``capacity`` just after it was lowered)."""
        return self._in_use

    @property
    def waiting(self) -> int:
        """Callers queued for a slot."""
        return self._waiting

    def _account(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            self._busy_s += self._in_use * elapsed
            self._wait_s += self._waiting * elapsed
        self._last = now

    def take_stats(self) -> dict:
        """Return and reset, for the time since the previous call (or creation):
        ``busy_s`` (time integral of ``in_use``), ``wait_s`` (sum of the waiters' waiting time,
        including those still waiting), ``max_waiting`` (most waiters at once), ``capacity`` (now)
        and ``interval_s`` (length of the interval; ``busy_s / (capacity * interval_s)`` is the
        utilization)."""
        self._account()
        stats = {"busy_s": self._busy_s, "wait_s": self._wait_s, "max_waiting": self._max_waiting,
                 "capacity": self._capacity, "interval_s": self._last - self._stats_since}
        self._busy_s = self._wait_s = 0.0
        self._max_waiting = self._waiting
        self._stats_since = self._last
        return stats

    # -- acquire / release ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self, priority: tuple = ()) -> AsyncIterator[None]:
        """Hold one slot for the ``async with`` block; wait by ``priority`` when none is free."""
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: tuple = ()) -> None:
        if self._in_use < self._capacity and not self._waiting:
            self._account()
            self._in_use += 1
            return
        future = asyncio.get_running_loop().create_future()
        self._account()
        heapq.heappush(self._heap, (priority, next(self._seq), future))
        self._waiting += 1
        self._max_waiting = max(self._max_waiting, self._waiting)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted (in_use already counted) but cancelled before resuming
            else:
                future.cancel()  # still queued: _admit skips it
                self._account()
                self._waiting -= 1
            raise

    def release(self) -> None:
        if self._in_use <= 0:
            raise RuntimeError("PriorityLimiter.release() without a slot held")
        self._account()
        self._in_use -= 1
        self._admit()

    def _admit(self) -> None:
        while self._heap and self._in_use < self._capacity:
            _, _, future = heapq.heappop(self._heap)
            if future.done():  # cancelled while queued; already uncounted
                continue
            self._account()
            self._waiting -= 1
            self._in_use += 1
            future.set_result(None)
