"""LambdaInvoker against the real local emulator: throttling, priorities, relaunch, failures."""

import asyncio
import time
from pathlib import Path

import pytest

from dorylus.emulator import serve
from graphserver.invoker import LambdaInvoker, TaskFailed
from tests.graphserver import handlers

HANDLERS = handlers.__name__
# The directory from which the handler modules import; pytest does not leave it on sys.path for
# the emulator's workers.
CODE_DIR = str(Path(handlers.__file__).parents[HANDLERS.count(".")])
STATS_KEYS = {"invocations", "relaunches", "failed_calls", "failures", "throttled", "busy_s", "wait_s", "max_waiting",
              "capacity", "interval_s"}


def event(interval: int, **extra) -> dict:
    return {"task": "AV", "interval": interval, "epoch": 5, "layer": 1, "part": 0, **extra}


@pytest.fixture(scope="module")
def single():
    """One worker: a second call in flight is throttled."""
    server = serve(functions={"sleep": f"{HANDLERS}:sleep"}, concurrency=1, timeout_s=30,
                   code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def emulator():
    """Room for stragglers beside their relaunches (a straggler keeps its worker until it ends)."""
    names = ("sleep", "fail_first", "fail", "straggle_first", "crash_first")
    server = serve(functions={name: f"{HANDLERS}:{name}" for name in names}, concurrency=6, timeout_s=30,
                   code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def using(invoker: LambdaInvoker, coro_fn):
    try:
        return await coro_fn(invoker)
    finally:
        await invoker.close()


def test_throttled_calls_are_retried_until_they_run(single):
    invoker = LambdaInvoker(single.url, "sleep", concurrency=3, timeout_s=30)

    async def calls(inv):
        return await asyncio.gather(*(inv.invoke(event(i, seconds=0.3)) for i in range(3)))

    results = run(using(invoker, calls))
    assert results == [{"slept": 0.3, "attempt": 0}] * 3
    stats = invoker.take_stats()
    assert set(stats) == STATS_KEYS
    assert stats["throttled"] >= 2 and invoker.throttled == stats["throttled"]  # one worker: two calls met 429
    assert stats["invocations"] == 3 and stats["relaunches"] == 0 and stats["failed_calls"] == 0
    assert invoker.take_stats()["throttled"] == 0  # reset


def test_function_error_names_the_task(emulator):
    invoker = LambdaInvoker(emulator.url, "fail", concurrency=1, timeout_s=30, fallback_after=1)
    with pytest.raises(TaskFailed, match=r"AV interval 2 epoch 5 layer 1 on graph server 0: failed after 1 attempt; "
                                         r"last error: function error ValueError: .*bad rows"):
        run(using(invoker, lambda inv: inv.invoke(event(2, message="bad rows"))))


def test_unreachable_endpoint_is_a_task_failure():
    invoker = LambdaInvoker("http://127.0.0.1:9", "sleep", concurrency=1, timeout_s=5, fallback_after=2)
    with pytest.raises(TaskFailed, match="AV interval 0 epoch 5 layer 1 on graph server 0: failed after 2 attempts; "
                                         "last error: invoke failed"):
        run(using(invoker, lambda inv: inv.invoke(event(0, seconds=0))))


def test_unknown_function_fails_at_once(emulator):
    invoker = LambdaInvoker(emulator.url, "no-such-function", concurrency=1, timeout_s=30)
    with pytest.raises(TaskFailed, match="failed after 1 attempt; last error: invoke failed: ResourceNotFound"):
        run(using(invoker, lambda inv: inv.invoke(event(0))))


def test_queued_calls_run_lowest_priority_first(emulator):
    invoker = LambdaInvoker(emulator.url, "sleep", concurrency=1, timeout_s=30)
    order = []

    async def call(inv, interval, priority, seconds):
        await inv.invoke(event(interval, seconds=seconds), priority)
        order.append(interval)

    async def calls(inv):
        first = asyncio.create_task(call(inv, 0, (0, 0, 0, 0), 0.3))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(call(inv, i, p, 0.01))
                  for i, p in ((3, (6, 0, 0, 3)), (2, (5, 1, 0, 2)), (1, (5, 0, 2, 1)))]
        await asyncio.sleep(0.05)
        assert inv.limiter.waiting == 3
        await asyncio.gather(first, *queued)

    run(using(invoker, calls))
    assert order == [0, 1, 2, 3]
    stats = invoker.take_stats()
    assert stats["max_waiting"] == 3 and stats["capacity"] == 1 and stats["wait_s"] > 0.5 and stats["busy_s"] > 0.3


def test_concurrency_is_settable_while_running(emulator):
    invoker = LambdaInvoker(emulator.url, "sleep", concurrency=1, timeout_s=30)

    async def calls(inv):
        tasks = [asyncio.create_task(inv.invoke(event(i, seconds=0.5))) for i in range(3)]
        await asyncio.sleep(0.1)
        assert inv.limiter.in_use == 1 and inv.limiter.waiting == 2
        inv.concurrency = 3
        assert inv.limiter.capacity == 3 and inv.limiter.in_use == 3 and inv.limiter.waiting == 0
        started = time.monotonic()
        await asyncio.gather(*tasks)
        return time.monotonic() - started

    assert run(using(invoker, calls)) < 1.0  # the two queued calls ran together (0.5 s), not in turn (1.4 s)
    assert invoker.concurrency == 3 and invoker.take_stats()["capacity"] == 3


def test_failed_attempt_is_relaunched_and_its_successor_wins(emulator):
    invoker = LambdaInvoker(emulator.url, "fail_first", concurrency=1, timeout_s=30)
    result = run(using(invoker, lambda inv: inv.invoke(event(0))))
    assert result == {"attempt": 1}
    stats = invoker.take_stats()
    assert (stats["invocations"], stats["relaunches"], stats["failed_calls"]) == (2, 1, 1)


def test_crashed_sandbox_is_relaunched(emulator):
    invoker = LambdaInvoker(emulator.url, "crash_first", concurrency=1, timeout_s=30)
    assert run(using(invoker, lambda inv: inv.invoke(event(0)))) == {"attempt": 1}
    stats = invoker.take_stats()
    assert (stats["relaunches"], stats["failed_calls"]) == (1, 1)


def test_straggler_is_relaunched_after_its_deadline_and_the_relaunch_wins(emulator, tmp_path):
    # concurrency 1: the relaunch must not wait for the slot its own straggler holds.
    # relaunch_ratio 0.001: once one success is noted the deadline is relaunch_min_s however slow a
    # loaded machine made that success (at ratio 3, a 0.2 s answer would move it to 0.6 s).
    # fallback_after 2: a relaunch that itself takes over 0.5 s (a fresh worker importing the
    # handlers on a busy machine) gets no third attempt, so the counts below are exact.
    invoker = LambdaInvoker(emulator.url, "straggle_first", concurrency=1, timeout_s=30, relaunch_min_s=0.5,
                            relaunch_ratio=0.001, fallback_after=2)
    # The straggler answers once this exists, or after 10 s: a relaunch much later than its 0.5 s
    # deadline would lose to it.
    release = tmp_path / "release"

    async def calls(inv):
        assert inv.relaunch_after("AV") == 30  # no success yet: timeout_s
        assert await inv.invoke(event(0, straggle_s=0)) == {"attempt": 0}
        assert inv.relaunch_after("AV") == 0.5  # the quick success was noted
        started = time.monotonic()
        try:
            result = await inv.invoke(event(1, straggle_s=10, release=str(release)), (1,))
        finally:
            release.touch()
        return result, time.monotonic() - started

    result, elapsed = run(using(invoker, calls))
    assert result == {"attempt": 1}  # the straggler (attempt 0) cannot answer before the release
    assert elapsed >= 0.5  # not relaunched before its deadline
    stats = invoker.take_stats()
    assert (stats["invocations"], stats["relaunches"], stats["failed_calls"]) == (3, 1, 0)
    assert invoker.in_flight == 0 and invoker.limiter.in_use == 0  # the straggler's request was dropped


def test_first_call_of_a_kind_waits_timeout_s_before_a_relaunch(emulator):
    invoker = LambdaInvoker(emulator.url, "straggle_first", concurrency=1, timeout_s=1.0, relaunch_min_s=0.1)
    # no success of the kind yet: the deadline is timeout_s, when the request times out anyway
    assert invoker.relaunch_after("AV") == 1.0
    started = time.monotonic()
    assert run(using(invoker, lambda inv: inv.invoke(event(0, straggle_s=3)))) == {"attempt": 1}
    assert 1.0 <= time.monotonic() - started < 2.5
    assert invoker.take_stats()["relaunches"] == 1


def test_all_attempts_failing_raise_task_failed_with_the_count(emulator):
    invoker = LambdaInvoker(emulator.url, "fail", concurrency=2, timeout_s=30, fallback_after=3)
    with pytest.raises(TaskFailed, match=r"AV interval 4 epoch 5 layer 1 on graph server 0: failed after 3 attempts; "
                                         r"last error: function error ValueError: bad rows \(attempt 2\)"):
        run(using(invoker, lambda inv: inv.invoke(event(4, message="bad rows"))))
    stats = invoker.take_stats()
    assert (stats["invocations"], stats["relaunches"], stats["failed_calls"]) == (3, 2, 3)
    assert invoker.limiter.in_use == 0


def test_cancelling_invoke_cancels_its_attempts_and_frees_the_slot(emulator):
    invoker = LambdaInvoker(emulator.url, "sleep", concurrency=1, timeout_s=30)

    async def calls(inv):
        task = asyncio.create_task(inv.invoke(event(0, seconds=3)))
        await asyncio.sleep(0.3)
        assert inv.in_flight == 1 and inv.limiter.in_use == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert inv.in_flight == 0 and inv.limiter.in_use == 0
        return await inv.invoke(event(1, seconds=0.01))  # the slot is usable again

    assert run(using(invoker, calls)) == {"slept": 0.01, "attempt": 0}


def test_close_fails_calls_in_flight(emulator):
    invoker = LambdaInvoker(emulator.url, "sleep", concurrency=1, timeout_s=30)

    async def calls(inv):
        task = asyncio.create_task(inv.invoke(event(0, seconds=3)))
        await asyncio.sleep(0.3)
        await inv.close()
        with pytest.raises(TaskFailed, match="invoker was closed"):
            await task
        with pytest.raises(TaskFailed, match="invoker is closed"):
            await inv.invoke(event(1, seconds=0))

    run(using(invoker, calls))


def test_relaunch_deadline_follows_the_moving_mean_per_task_kind():
    invoker = LambdaInvoker(None, "f", concurrency=1, timeout_s=30, relaunch_min_s=0.5, relaunch_ratio=3.0)
    assert invoker.relaunch_after("AV") == 30  # no success yet: timeout_s
    invoker.note_duration("AV", 0.1)
    assert invoker.relaunch_after("AV") == 0.5  # 3 x 0.1 < relaunch_min_s
    invoker.note_duration("AV", 1.0)
    assert invoker.relaunch_after("AV") == pytest.approx(3 * 0.55)
    for _ in range(20):  # the window keeps the last 20 successes only
        invoker.note_duration("AV", 2.0)
    assert invoker.relaunch_after("AV") == pytest.approx(6.0)
    invoker.note_duration("AV", 22.0)
    assert invoker.relaunch_after("AV") == pytest.approx(3 * (19 * 2.0 + 22.0) / 20)
    assert invoker.relaunch_after("GA") == 30  # kinds are separate
    invoker.note_duration("GA", 50.0)
    assert invoker.relaunch_after("GA") == 30  # never beyond timeout_s


def test_fallback_after_must_be_positive():
    with pytest.raises(ValueError):
        LambdaInvoker(None, "f", concurrency=1, timeout_s=1, fallback_after=0)
