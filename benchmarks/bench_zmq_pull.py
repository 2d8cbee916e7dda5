"""ZeroMQ PULL -> ROWS throughput: the round trip a tensor function makes for its interval's rows.

A graph-server stand-in (ROUTER, separate process) owns ``Z float32 [4096, 1024]`` and answers
each PULL with the requested rows as one ROWS message; a function stand-in (DEALER) issues one
PULL at a time over tcp://127.0.0.1. For intervals of 1, 4 and 16 MB (256, 1024, 4096 rows of
1024 float32) it measures round trips per second and payload GB/s (1 GB = 1e9 bytes), with the
zero-copy path (``copy=False`` on both ends, the protocol's default) and with ``copy=True``.

    python benchmarks/bench_zmq_pull.py [--seconds 1.5]

Prints a table and writes benchmarks/results/zmq_pull.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path

import numpy as np
import zmq

from dorylus import protocol as P
from common import routed_requests, write_json

COLS = 1024
MAX_ROWS = 4096
RESULTS = Path(__file__).resolve().parent / "results" / "zmq_pull.json"


def make_z() -> np.ndarray:
    """``float32 [MAX_ROWS, COLS]`` with distinct values, so a wrong row would be noticed."""
    return (np.arange(MAX_ROWS * COLS, dtype=np.float32) % 65521.0).reshape(MAX_ROWS, COLS)


def serve(port_out: mp.connection.Connection) -> None:
    z = make_z()
    bounds = P.Bounds(num_rows=MAX_ROWS)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port_out.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    try:
        for identity, req, _ in routed_requests(sock, bounds, 60.0):
            if req.op is P.Op.SHUTDOWN:
                P.send_routed(sock, identity, P.reply_to(req, P.Op.ACK))
                return
            start, stop = req.rows
            copy = bool(req.meta.get("copy", False))
            # Z's rows are a contiguous view: with copy=False ZeroMQ sends straight from Z.
            P.send_routed(sock, identity, P.reply_to(req, P.Op.ROWS), [z[start:stop]], copy=copy)
    finally:
        sock.close(linger=0)
        ctx.term()


def pull(sock: zmq.Socket, req_id: int, rows: int, copy: bool) -> np.ndarray:
    header = P.Header(P.Op.PULL, req=req_id, task="AV", epoch=0, layer=0, interval=0,
                      rows=(0, rows), names=("Z",), meta={"copy": copy})
    P.send(sock, header, copy=copy)
    reply, (got,) = P.recv(sock, timeout=30.0, copy=copy)
    if reply.op is not P.Op.ROWS or reply.req != req_id:
        raise RuntimeError(f"unexpected reply {reply}")
    return got


def measure(sock: zmq.Socket, rows: int, copy: bool, seconds: float) -> dict:
    expected = make_z()[:rows]
    if not np.array_equal(pull(sock, 0, rows, copy), expected):
        raise RuntimeError(f"wrong rows received for {rows} rows, copy={copy}")
    for i in range(3):  # warm up
        pull(sock, i, rows, copy)
    n, t0 = 0, time.perf_counter()
    while True:
        got = pull(sock, n, rows, copy)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 10:
            break
    del got
    nbytes = rows * COLS * 4
    return {
        "megabytes": nbytes / 2**20, "rows": rows, "cols": COLS, "copy": copy, "round_trips": n,
        "seconds": elapsed, "round_trips_per_s": n / elapsed, "gb_per_s": n * nbytes / elapsed / 1e9,
        "ms_per_round_trip": 1e3 * elapsed / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="measuring time per configuration")
    args = parser.parse_args()

    mp_ctx = mp.get_context("spawn")
    port_in, port_out = mp_ctx.Pipe(duplex=False)
    server = mp_ctx.Process(target=serve, args=(port_out,), daemon=True)
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    results = []
    try:
        if not port_in.poll(30):
            raise RuntimeError("server did not start")
        sock.connect(f"tcp://127.0.0.1:{port_in.recv()}")
        for rows in (256, 1024, 4096):
            for copy in (False, True):
                results.append(measure(sock, rows, copy, args.seconds))
        P.send(sock, P.Header(P.Op.SHUTDOWN))
        P.recv(sock, timeout=10.0)
    finally:
        sock.close(linger=0)
        ctx.term()
        server.join(timeout=10)
        if server.is_alive():
            server.terminate()
            server.join(timeout=5)

    print(f"{'interval':>9} {'copy':>6} {'round trips/s':>14} {'GB/s':>7} {'ms/round trip':>14}")
    for r in results:
        print(f"{r['megabytes']:>6.0f} MB {str(r['copy']):>6} {r['round_trips_per_s']:>14.1f} "
              f"{r['gb_per_s']:>7.2f} {r['ms_per_round_trip']:>14.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "zmq_pull", "transport": "tcp://127.0.0.1", "pattern": "DEALER PULL -> ROUTER ROWS, 1 in flight",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "numpy": np.__version__},
        "results": results,
    }
    write_json(out, RESULTS)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
