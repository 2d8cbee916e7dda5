"""PriorityLimiter alone: admission order, run-time capacity, cancellation, accounting."""

from __future__ import annotations

import asyncio

import pytest

from graphserver.limiter import PriorityLimiter


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waiters_are_admitted_lowest_priority_first_ties_fifo():
    async def scenario():
        limiter = PriorityLimiter(1)
        order = []

        async def worker(name, priority):
            async with limiter.slot(priority):
                order.append(name)
                await asyncio.sleep(0)

        await limiter.acquire(())
        # (epoch, pass, stage, interval) as the graph server passes them
        queued = [("e2", (2, 0, 0, 0)), ("bwd", (1, 1, 0, 3)), ("fwd-i5", (1, 0, 1, 5)),
                  ("fwd-i1", (1, 0, 1, 1)), ("tie-a", (1, 0, 0, 7)), ("tie-b", (1, 0, 0, 7)), ("old", (0, 1, 2, 9))]
        tasks = []
        for name, priority in queued:
            tasks.append(asyncio.create_task(worker(name, priority)))
            await settle()
        assert limiter.waiting == len(queued) and limiter.in_use == 1
        limiter.release()
        await asyncio.gather(*tasks)
        assert limiter.in_use == 0 and limiter.waiting == 0
        return order

    assert run(scenario()) == ["old", "tie-a", "tie-b", "fwd-i1", "fwd-i5", "bwd", "e2"]


def test_free_slot_is_taken_at_once_without_queueing():
    async def scenario():
        limiter = PriorityLimiter(2)
        async with limiter.slot((5,)):
            async with limiter.slot((9,)):
                assert limiter.in_use == 2 and limiter.waiting == 0
        assert limiter.in_use == 0

    run(scenario())


def test_raising_capacity_admits_waiters_at_once_in_priority_order():
    async def scenario():
        limiter = PriorityLimiter(1)
        admitted = []
        gate = asyncio.Event()

        async def worker(priority):
            async with limiter.slot(priority):
                admitted.append(priority)
                await gate.wait()

        holder = asyncio.create_task(worker((0,)))
        await settle()
        tasks = [asyncio.create_task(worker((p,))) for p in (3, 1, 2)]
        await settle()
        assert admitted == [(0,)] and limiter.waiting == 3
        limiter.capacity = 3
        await settle()
        assert admitted == [(0,), (1,), (2,)]
        assert limiter.in_use == 3 and limiter.waiting == 1
        gate.set()
        await asyncio.gather(holder, *tasks)
        assert admitted[-1] == (3,) and limiter.in_use == 0

    run(scenario())


def test_lowering_capacity_takes_effect_as_holders_release():
    async def scenario():
        limiter = PriorityLimiter(3)
        for _ in range(3):
            await limiter.acquire()
        waiter = asyncio.create_task(limiter.acquire((0,)))
        await settle()
        limiter.capacity = 1
        assert limiter.in_use == 3  # running holders are not pre-empted
        limiter.release()
        await settle()
        assert not waiter.done() and limiter.in_use == 2
        limiter.release()
        await settle()
        assert not waiter.done() and limiter.in_use == 1
        limiter.release()
        await settle()
        assert waiter.done() and limiter.in_use == 1 and limiter.waiting == 0
        limiter.release()
        assert limiter.in_use == 0

    run(scenario())


def test_capacity_must_be_a_positive_integer():
    with pytest.raises(ValueError):
        PriorityLimiter(0)
    limiter = PriorityLimiter(1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            limiter.capacity = bad
    assert limiter.capacity == 1
    with pytest.raises(RuntimeError):
        limiter.release()


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        limiter = PriorityLimiter(1)
        await limiter.acquire()
        first = asyncio.create_task(limiter.acquire((0,)))
        second = asyncio.create_task(limiter.acquire((1,)))
        await settle()
        assert limiter.waiting == 2
        first.cancel()
        await settle()
        assert first.cancelled() and limiter.waiting == 1
        limiter.release()
        await settle()
        assert second.done() and limiter.in_use == 1 and limiter.waiting == 0
        limiter.release()
        assert limiter.in_use == 0

    run(scenario())


def test_waiter_cancelled_after_its_grant_hands_the_slot_back():
    async def scenario():
        limiter = PriorityLimiter(1)
        await limiter.acquire()
        granted = asyncio.create_task(limiter.acquire((0,)))
        behind = asyncio.create_task(limiter.acquire((1,)))
        await settle()
        limiter.release()  # grants `granted` its slot, but it has not resumed yet ...
        granted.cancel()  # ... when it is cancelled
        await settle()
        assert granted.cancelled()
        assert behind.done() and limiter.in_use == 1 and limiter.waiting == 0  # passed on, not leaked
        limiter.release()
        assert limiter.in_use == 0

    run(scenario())


def test_cancelling_a_holder_releases_its_slot():
    async def scenario():
        limiter = PriorityLimiter(1)

        async def hold():
            async with limiter.slot():
                await asyncio.sleep(60)

        task = asyncio.create_task(hold())
        await settle()
        assert limiter.in_use == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert limiter.in_use == 0
        async with limiter.slot():
            pass

    run(scenario())


def test_take_stats_integrates_busy_and_waiting_time_and_resets():
    async def scenario():
        clock = FakeClock()
        limiter = PriorityLimiter(2, clock=clock)
        await limiter.acquire()
        clock.now += 1.0  # 1 s at in_use 1
        await limiter.acquire()
        waiters = [asyncio.create_task(limiter.acquire((i,))) for i in range(3)]
        await settle()
        clock.now += 2.0  # 2 s at in_use 2 with 3 waiting
        limiter.release()
        await settle()
        clock.now += 0.5  # 0.5 s at in_use 2 with 2 waiting
        stats = limiter.take_stats()
        assert stats == pytest.approx({"busy_s": 1.0 + 4.0 + 1.0, "wait_s": 6.0 + 1.0, "max_waiting": 3,
                                       "capacity": 2, "interval_s": 3.5})
        clock.now += 1.0  # 1 s at in_use 2 with 2 waiting
        limiter.capacity = 4
        await settle()
        stats = limiter.take_stats()
        assert stats == pytest.approx({"busy_s": 2.0, "wait_s": 2.0, "max_waiting": 2, "capacity": 4,
                                       "interval_s": 1.0})
        assert limiter.in_use == 4 and all(w.done() for w in waiters)
        assert limiter.take_stats()["max_waiting"] == 0

    run(scenario())
