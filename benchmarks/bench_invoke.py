"""Lambda emulator invoke overhead: a no-op handler called through aiobotocore (and boto3).

Per-call latency is what the client waits for one ``Invoke`` (HTTP, JSON check, pipe to the
worker process and back); the handler itself does nothing, so this is the emulator's overhead
per call. ``client CPU`` is the CPU time of the client's own thread per call (the emulator runs
in other threads of this process): what an invoke costs the graph server's event loop. The
payload is a Dorylus event of the usual size (about 600 bytes). Prints a table and writes
``benchmarks/results/invoke.json``.

    python benchmarks/bench_invoke.py [--sequential 500] [--concurrent 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from common import write_json


def noop(event, context):
    return None


# A graph server's event as the lambda backend sends it (the no-op handler ignores it).
PAYLOAD = json.dumps({
    "model": "gcn", "task": "AV_BWD", "layer": 0, "reads": ["dP0", "dY0", "X", "ids"], "writes": [],
    "weights": "stash", "grad": True, "args": {"dropout": 0.5, "act_in": None, "project_first": True, "seed": 0,
                                               "epoch": 3, "training": True, "train_count": 25000},
    "graph_server": "tcp://127.0.0.1:40000", "param_server": "tcp://127.0.0.1:40001", "part": 0, "interval": 1,
    "rows": [12500, 25000], "epoch": 3, "pass": "train", "attempt": 0, "run": "0123456789ab"}).encode()


def _summary(name: str, latencies_s: list[float], wall_s: float, in_flight: int, cpu_s: float | None = None) -> dict:
    import numpy as np

    ms = np.asarray(latencies_s) * 1000
    return {"mode": name, "calls": len(ms), "in_flight": in_flight,
            "client_cpu_ms": None if cpu_s is None else cpu_s / len(ms) * 1000,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "max_ms": float(ms.max()),
            "throughput_per_s": len(ms) / wall_s, "wall_s": wall_s}


async def _aio_run(url: str, calls: int, in_flight: int, client=None) -> tuple[list[float], float, float]:
    """Through ``client`` (default: a plain aiobotocore client); -> (latencies, wall, client CPU)."""
    import asyncio
    import contextlib

    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(retries={"max_attempts": 0}, max_pool_connections=max(10, in_flight))
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(get_session().create_client(
                "lambda", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                aws_secret_access_key="x", config=config))
        latencies: list[float] = []
        gate = asyncio.Semaphore(in_flight)

        async def one(record: bool) -> None:
            async with gate:
                start = time.perf_counter()
                response = await client.invoke(FunctionName="noop", Payload=PAYLOAD)
                await response["Payload"].read()
                if "FunctionError" in response:
                    raise RuntimeError("the no-op handler failed")
                if record:
                    latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one(False) for _ in range(2 * in_flight)))  # warm connections
        start, cpu = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(one(True) for _ in range(calls)))
        return latencies, time.perf_counter() - start, time.thread_time() - cpu


async def _invoker_run(url: str, calls: int) -> tuple[list[float], float, float]:
    """Through the graph server's own client (graphserver.invoker.LambdaInvoker's settings)."""
    from graphserver.invoker import LambdaInvoker

    invoker = LambdaInvoker(url, "noop", concurrency=1, timeout_s=60)
    try:
        return await _aio_run(url, calls, 1, await invoker._ensure_client())
    finally:
        await invoker.close()


def _boto3_run(url: str, calls: int) -> tuple[list[float], float]:
    import boto3
    from botocore.config import Config

    client = boto3.client("lambda", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          config=Config(retries={"max_attempts": 0}))
    for _ in range(10):
        client.invoke(FunctionName="noop", Payload=PAYLOAD)["Payload"].read()
    latencies = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        client.invoke(FunctionName="noop", Payload=PAYLOAD)["Payload"].read()
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - start


def _pick(run: tuple[list[float], float, float]) -> tuple:
    """A sequential run's (latencies, wall, 1 in flight, client CPU) for :func:`_summary`."""
    latencies, wall, cpu = run
    return latencies, wall, 1, cpu


def main(argv: list[str] | None = None) -> int:
    import asyncio

    from dorylus.emulator import serve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=500, help="calls one at a time")
    parser.add_argument("--concurrent", type=int, default=2000, help="calls with many in flight")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="emulator workers = calls in flight in the concurrent run")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "invoke.json")
    args = parser.parse_args(argv)

    here = str(Path(__file__).resolve().parent)
    with serve(functions={"noop": "bench_invoke:noop"}, concurrency=args.concurrency,
               code_dirs=[here]) as server:
        rows = [
            _summary("aiobotocore sequential", *_pick(asyncio.run(_aio_run(server.url, args.sequential, 1)))),
            _summary("LambdaInvoker sequential", *_pick(asyncio.run(_invoker_run(server.url, args.sequential)))),
            _summary("boto3 sequential", *_boto3_run(server.url, args.sequential), 1),
            _summary("aiobotocore concurrent",
                     *asyncio.run(_aio_run(server.url, args.concurrent, args.concurrency))[:2],
                     args.concurrency),
        ]
        stats = server.stats()

    header = (f"{'mode':<26}{'calls':>7}{'in flight':>10}{'p50 ms':>9}{'p99 ms':>9}{'calls/s':>9}"
              f"{'client CPU ms':>15}")
    print(header)
    print("-" * len(header))
    for row in rows:
        cpu = "" if row["client_cpu_ms"] is None else f"{row['client_cpu_ms']:.2f}"
        print(f"{row['mode']:<26}{row['calls']:>7}{row['in_flight']:>10}{row['p50_ms']:>9.2f}"
              f"{row['p99_ms']:>9.2f}{row['throughput_per_s']:>9.0f}{cpu:>15}")
    print(f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus)")
    print(f"handler billed {stats['billed_ms']} ms over {stats['invocations']} calls "
          f"(1 ms minimum per call), throttles {stats['throttles']}")

    result = {"benchmark": "invoke", "rows": rows, "emulator_stats": stats,
              "python": platform.python_version(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
