import asyncio
from pathlib import Path

import pytest

from dorylus.emulator import serve
from graphserver.invoker import LambdaInvoker, TaskFailed
from tests.emulator import handlers

HANDLERS = handlers.__name__
CODE_DIR = str(Path(handlers.__file__).parents[HANDLERS.count(".")])


def event(interval: int, **extra) -> dict:
    return {"task": "AV", "interval": interval, "epoch": 5, "layer": 1, "part": 0, **extra}


@pytest.fixture(scope="module")
def emulator():
    server = serve(functions={"sleep": f"{HANDLERS}:sleep", "fail": f"{HANDLERS}:fail"}, concurrency=1,
                   timeout_s=30, code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_throttled_calls_are_retried_until_they_run(emulator):
    async def calls():
        invoker = LambdaInvoker(emulator.url, "sleep", concurrency=3, timeout_s=30, backoff_s=0.05)
        try:
            results = await asyncio.gather(*(invoker.invoke(event(i, seconds=0.3)) for i in range(3)))
        finally:
            await invoker.close()
        return results, invoker.throttled

    results, throttled = run(calls())
    assert results == [{"slept": 0.3}] * 3
    assert throttled >= 2  # one slot: the other two calls met 429 at least once each


def test_function_error_names_the_task(emulator):
    async def call():
        invoker = LambdaInvoker(emulator.url, "fail", concurrency=1, timeout_s=30)
        try:
            await invoker.invoke(event(2, message="bad rows"))
        finally:
            await invoker.close()

    with pytest.raises(TaskFailed, match=r"AV interval 2 epoch 5 layer 1 on graph server 0: function error "
                                         r"ValueError: .*bad rows"):
        run(call())


def test_unreachable_endpoint_is_a_task_failure():
    async def call():
        invoker = LambdaInvoker("http://127.0.0.1:9", "sleep", concurrency=1, timeout_s=5)
        try:
            await invoker.invoke(event(0, seconds=0))
        finally:
            await invoker.close()

    with pytest.raises(TaskFailed, match="AV interval 0 epoch 5 layer 1 on graph server 0: invoke failed"):
        run(call())
