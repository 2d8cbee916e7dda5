"""Lambda emulator invoke overhead: a no-op handler called through aiobotocore (and boto3).

Per-call latency is what the client waits for one ``Invoke`` (HTTP, JSON check, pipe to the
worker process and back); the handler itself does nothing, so this is the emulator's overhead
per call. Prints a table and writes ``benchmarks/results/invoke.json``.

    python benchmarks/bench_invoke.py [--sequential 500] [--concurrent 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from common import write_json


def noop(event, context):
    return None


def _summary(name: str, latencies_s: list[float], wall_s: float, in_flight: int) -> dict:
    import numpy as np

    ms = np.asarray(latencies_s) * 1000
    return {"mode": name, "calls": len(ms), "in_flight": in_flight,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "max_ms": float(ms.max()),
            "throughput_per_s": len(ms) / wall_s, "wall_s": wall_s}


async def _aio_run(url: str, calls: int, in_flight: int) -> tuple[list[float], float]:
    import asyncio

    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(retries={"max_attempts": 0}, max_pool_connections=max(10, in_flight))
    async with get_session().create_client(
            "lambda", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
            aws_secret_access_key="x", config=config) as client:
        latencies: list[float] = []
        gate = asyncio.Semaphore(in_flight)

        async def one(record: bool) -> None:
            async with gate:
                start = time.perf_counter()
                response = await client.invoke(FunctionName="noop", Payload=b"{}")
                await response["Payload"].read()
                if "FunctionError" in response:
                    raise RuntimeError("the no-op handler failed")
                if record:
                    latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one(False) for _ in range(2 * in_flight)))  # warm connections
        start = time.perf_counter()
        await asyncio.gather(*(one(True) for _ in range(calls)))
        return latencies, time.perf_counter() - start


def _boto3_run(url: str, calls: int) -> tuple[list[float], float]:
    import boto3
    from botocore.config import Config

    client = boto3.client("lambda", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          config=Config(retries={"max_attempts": 0}))
    for _ in range(10):
        client.invoke(FunctionName="noop", Payload=b"{}")["Payload"].read()
    latencies = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        client.invoke(FunctionName="noop", Payload=b"{}")["Payload"].read()
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - start


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
            _summary("aiobotocore sequential",
                     *asyncio.run(_aio_run(server.url, args.sequential, 1)), 1),
            _summary("boto3 sequential", *_boto3_run(server.url, args.sequential), 1),
            _summary("aiobotocore concurrent",
                     *asyncio.run(_aio_run(server.url, args.concurrent, args.concurrency)),
                     args.concurrency),
        ]
        stats = server.stats()

    header = f"{'mode':<24}{'calls':>7}{'in flight':>10}{'p50 ms':>9}{'p99 ms':>9}{'calls/s':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['mode']:<24}{row['calls']:>7}{row['in_flight']:>10}{row['p50_ms']:>9.2f}"
              f"{row['p99_ms']:>9.2f}{row['throughput_per_s']:>9.0f}")
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
