"""LambdaInvoker's use of botocore's retries against the local emulator: 429 is retried by botocore
inside an attempt; an invoke that got no answer is not resent by botocore but left to relaunch."""

import asyncio
import json
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from dorylus.emulator import serve
from graphserver.invoker import LambdaInvoker, TaskFailed
from tests.graphserver import handlers

HANDLERS = handlers.__name__
CODE_DIR = str(Path(handlers.__file__).parents[HANDLERS.count(".")])


def event(interval: int, **extra) -> dict:
    return {"task": "AV", "interval": interval, "epoch": 5, "layer": 1, "part": 0, **extra}


@pytest.fixture
def single():
    """One worker, so one call holding it makes the emulator answer 429 to any other."""
    server = serve(functions={"sleep": f"{HANDLERS}:sleep"}, concurrency=1, timeout_s=30, code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


def hold_the_only_worker(server, seconds: float) -> None:
    """An Event call that keeps the emulator's one worker busy (admitted before the 202)."""
    client = boto3.client("lambda", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x", config=Config(retries={"max_attempts": 0}))
    try:
        reply = client.invoke(FunctionName="sleep", InvocationType="Event",
                              Payload=json.dumps({"seconds": seconds, "attempt": -1}))
        assert reply["StatusCode"] == 202
    finally:
        client.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def using(invoker: LambdaInvoker, coro_fn):
    try:
        return await coro_fn(invoker)
    finally:
        await invoker.close()


def test_throttled_invoke_is_retried_by_botocore_and_succeeds(single):
    # fallback_after=1: no relaunch, so only botocore's retries can turn the 429s into a result.
    invoker = LambdaInvoker(single.url, "sleep", concurrency=1, timeout_s=30, fallback_after=1)

    async def calls(inv):
        await inv.invoke(event(0, seconds=0))  # the client exists before the worker is taken
        inv.take_stats()
        hold_the_only_worker(single, 1.5)
        throttles = single.stats()["throttles"]
        result = await inv.invoke(event(1, seconds=0))
        return result, single.stats()["throttles"] - throttles

    result, throttled_answers = run(using(invoker, calls))
    assert result == {"slept": 0, "attempt": 0}
    stats = invoker.take_stats()
    assert throttled_answers >= 1 and stats["throttled"] == throttled_answers
    assert (stats["invocations"], stats["relaunches"], stats["failed_calls"]) == (1, 0, 0)


def test_persistently_throttled_invoke_fails_with_a_clear_error(single):
    invoker = LambdaInvoker(single.url, "sleep", concurrency=1, timeout_s=30, fallback_after=1, max_throttle_retries=2)
    hold_the_only_worker(single, 20)  # longer than 2 retries' backoff (at most 1 + 2 s); close() ends it
    with pytest.raises(TaskFailed, match=r"AV interval 0 epoch 5 layer 1 on graph server 0: failed after 1 attempt; "
                                         r"last error: invoke failed: TooManyRequestsException: .*"
                                         r"\(reached max retries: 2\): Rate Exceeded\."):
        run(using(invoker, lambda inv: inv.invoke(event(0, seconds=0))))
    assert single.stats()["throttles"] == 3  # the first send and botocore's 2 retries
    stats = invoker.take_stats()
    assert stats["throttled"] == 3 and (stats["invocations"], stats["failed_calls"]) == (1, 1)


def test_backing_off_does_not_count_towards_the_relaunch_deadline(single):
    invoker = LambdaInvoker(single.url, "sleep", concurrency=1, timeout_s=30, relaunch_min_s=0.2)

    async def calls(inv):
        await inv.invoke(event(0, seconds=0))  # the client exists before the worker is taken
        for _ in range(20):  # quick successes: the deadline is now relaunch_min_s
            inv.note_duration("AV", 0.01)
        assert inv.relaunch_after("AV") == 0.2
        inv.take_stats()
        hold_the_only_worker(single, 1.5)
        return await inv.invoke(event(1, seconds=0))

    assert run(using(invoker, calls)) == {"slept": 0, "attempt": 0}
    stats = invoker.take_stats()
    assert stats["throttled"] >= 1 and (stats["invocations"], stats["relaunches"]) == (1, 0)


def test_read_timeout_is_not_resent_by_botocore(single):
    # The read times out (timeout_s) while the function runs; botocore would resend the same
    # attempt, a second run of the function. It fails the attempt instead.
    invoker = LambdaInvoker(single.url, "sleep", concurrency=1, timeout_s=1.0, fallback_after=1)

    async def calls(inv):
        await inv.invoke(event(0, seconds=0))  # the client exists before the clock starts
        before, started = single.stats(), time.monotonic()
        with pytest.raises(TaskFailed, match="failed after 1 attempt; last error: invoke failed: ReadTimeoutError"):
            await inv.invoke(event(1, seconds=3))
        return before, time.monotonic() - started

    before, elapsed = run(using(invoker, calls))
    assert elapsed < 3.0
    after = single.stats()  # a resend would have met the busy worker: a 429, or a second run
    assert (after["invocations"] - before["invocations"], after["throttles"] - before["throttles"]) == (1, 0)
