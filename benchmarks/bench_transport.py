"""Loopback TCP against Unix sockets: the two transports a local run could use, message for message.

A local run's roles listen on Unix sockets (``ipc://``) in a directory of mode 0700, so that
only the user's processes can reach them (docs/security.md); before, they listened on
``tcp://127.0.0.1``. This compares the two with the messages an epoch sends, through the
project's own sockets (:mod:`dorylus.sockets`) and protocol (zero-copy, validated on receipt):
a server stand-in (ROUTER, separate process) is bound to both ``tcp://127.0.0.1:PORT`` and
``ipc://DIR/sock`` (DIR a new 0700 directory, removed at the end); the client has a DEALER on
each and keeps one request in flight, as a role does.

Patterns: round trips of a parameter server's size (a COMMAND with a ~300-byte document
answered by ACK; PULL_WEIGHTS answered by float32 weights 16x47, 100x16 and 1433x16 (Cora's
first layer); PUSH_GRADS of 16x47 answered by ACK), and row transfers (PUSH of 1, 4 and 16 MB
of float32 rows, answered by ACK). Each round measures every pattern for ``--seconds`` per
transport, alternating the transports message by message in ABBA order (tcp ipc ipc tcp ...),
so that both see the same load; a round's figure is the median time of its messages on each
transport. The table gives the median over rounds of each transport's figure and the median
over rounds of the per-round ratio ipc / tcp (paired), with its lowest and highest round.

    python benchmarks/bench_transport.py [--rounds 15] [--seconds 0.25]

Prints a table and writes benchmarks/results/transport.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from dorylus import protocol as P
from dorylus import sockets
from common import positive_int, routed_requests, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "transport.json"
ROW_COLS = 1024
MAX_ROWS = 4096  # 16 MB of float32 rows
MAX_BYTES = 64 * 2**20
CONTROL_DOC = {"epoch": 3, "part": 0, "loss": 1.2345678, "correct_train": 140, "correct_val": 380,
               "correct_test": 790, "evaluated": True, "staleness_max": 0, "staleness_sum": 0,
               "staleness_reads": 40, "weight_lag_max": 0, "relaunches": 0, "failed_calls": 0,
               "invocations": 20, "task_s": {"ga_s": 0.03, "av_s": 0.05, "av_bwd_s": 0.09}}
WEIGHT_SHAPES = ((16, 47), (100, 16), (1433, 16))
ROW_MB = (1, 4, 16)


def _patterns() -> list[dict]:
    """Name, kind and payload bytes of every measured pattern, in measuring order."""
    out = [{"name": "control ~300 B (COMMAND -> ACK)", "kind": "control",
            "bytes": len(P.encode_doc(CONTROL_DOC))}]
    out += [{"name": f"PULL_WEIGHTS {r}x{c} -> WEIGHTS", "kind": "pull", "shape": (r, c), "bytes": r * c * 4}
            for r, c in WEIGHT_SHAPES]
    r, c = WEIGHT_SHAPES[0]
    out.append({"name": f"PUSH_GRADS {r}x{c} -> ACK", "kind": "push_grads", "shape": (r, c), "bytes": r * c * 4})
    out += [{"name": f"PUSH rows {mb} MB -> ACK", "kind": "rows", "rows": mb * 2**20 // (ROW_COLS * 4),
             "bytes": mb * 2**20} for mb in ROW_MB]
    return out


def _array(shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float32) % 65521.0).reshape(shape)


def serve(ipc: str, ready: mp.connection.Connection) -> None:
    """The server stand-in: one ROUTER bound to ``ipc`` and to a loopback TCP port (sent on
    ``ready``), answering until SHUTDOWN."""
    weights = {shape: _array(shape) for shape in WEIGHT_SHAPES}
    ctx = zmq.Context()
    sock = sockets.server_socket(ctx, None, MAX_BYTES)
    sock.bind(ipc)
    ready.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    bounds = P.Bounds(num_rows=MAX_ROWS)
    try:
        for identity, req, _ in routed_requests(sock, bounds, 120.0):
            if req.op is P.Op.PULL_WEIGHTS:
                shape = (int(req.meta["r"]), int(req.meta["c"]))
                P.send_routed(sock, identity, P.reply_to(req, P.Op.WEIGHTS, version=1, names=("W",)),
                              [weights[shape]])
                continue
            P.send_routed(sock, identity, P.reply_to(req, P.Op.ACK))
            if req.op is P.Op.SHUTDOWN:
                return
    finally:
        sock.close(linger=0)
        ctx.term()


class Client:
    """One request in flight at a time on ``sock``, as a role's peer keeps it."""

    def __init__(self, sock: zmq.Socket):
        self.sock, self.req = sock, 0
        self.rows = _array((MAX_ROWS, ROW_COLS))
        self.grads = {shape: _array(shape) for shape in WEIGHT_SHAPES}

    def message(self, pattern: dict) -> tuple[P.Header, list[np.ndarray]]:
        self.req += 1
        kind = pattern["kind"]
        if kind == "control":
            return P.Header(P.Op.COMMAND, req=self.req, meta={"command": "report"}, doc=CONTROL_DOC), []
        if kind == "pull":
            r, c = pattern["shape"]
            return P.Header(P.Op.PULL_WEIGHTS, req=self.req, layer=0, epoch=3, interval=0, meta={"r": r, "c": c}), []
        if kind == "push_grads":
            return (P.Header(P.Op.PUSH_GRADS, req=self.req, layer=0, epoch=3, interval=0, version=1, names=("W",)),
                    [self.grads[pattern["shape"]]])
        rows = pattern["rows"]
        return (P.Header(P.Op.PUSH, req=self.req, task="AV", epoch=3, layer=0, interval=0, rows=(0, rows),
                         names=("Z",)), [self.rows[:rows]])

    def round_trip(self, pattern: dict) -> int:
        """Send one request, wait for its reply; nanoseconds."""
        header, tensors = self.message(pattern)
        start = time.perf_counter_ns()
        P.send(self.sock, header, tensors)
        reply, got = P.recv(self.sock, timeout=30.0)
        elapsed = time.perf_counter_ns() - start
        if reply.req != header.req or reply.op is P.Op.ERROR:
            raise RuntimeError(f"unexpected reply {reply}")
        if pattern["kind"] == "pull" and got[0].shape != pattern["shape"]:
            raise RuntimeError(f"wrong weights {got[0].shape} for {pattern['shape']}")
        return elapsed


def interleaved(clients: dict[str, Client], pattern: dict, seconds: float,
                min_messages: int = 6) -> dict[str, list[int]]:
    """Round-trip times (ns) of ``pattern`` on each transport, the transports taking turns
    message by message in ABBA order for about ``seconds`` each."""
    for client in clients.values():
        for _ in range(3):  # warm up: the connection, the allocator
            client.round_trip(pattern)
    first, second = clients
    times: dict[str, list[int]] = {t: [] for t in clients}
    deadline, turn = time.perf_counter() + 2 * seconds, 0
    while time.perf_counter() < deadline or len(times[first]) < min_messages:
        for t in ((first, second) if turn % 2 == 0 else (second, first)):
            times[t].append(clients[t].round_trip(pattern))
        turn += 1
    return times


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3


def summarize(patterns: list[dict], rounds: list[dict]) -> list[dict]:
    out = []
    for p in patterns:
        name = p["name"]
        per_round = {t: [r[name][t] for r in rounds] for t in ("tcp", "ipc")}
        ratios = [r[name]["ipc"] / r[name]["tcp"] for r in rounds]
        tcp_us, ipc_us = statistics.median(per_round["tcp"]), statistics.median(per_round["ipc"])
        out.append({
            "pattern": name, "bytes": p["bytes"], "rounds": len(rounds),
            "tcp_us": tcp_us, "ipc_us": ipc_us, "ipc_minus_tcp_us": ipc_us - tcp_us,
            "tcp_gb_per_s": p["bytes"] / tcp_us / 1e3, "ipc_gb_per_s": p["bytes"] / ipc_us / 1e3,
            "ratio_ipc_tcp": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ipc_faster_rounds": sum(x < 1 for x in ratios),
            "per_round_us": per_round,
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=15,
                        help="rounds, each measuring every pattern on both transports (default: 15)")
    parser.add_argument("--seconds", type=float, default=0.25,
                        help="measuring time per pattern, transport and round, > 0 (default: 0.25)")
    args = parser.parse_args()
    if not 0 < args.seconds <= 60:
        parser.error(f"--seconds must be in (0, 60], got {args.seconds}")

    patterns = _patterns()
    load_before = os.getloadavg()
    socket_dir = Path(tempfile.mkdtemp(prefix="dorylus-bench-"))  # mode 0700, as a run's
    mp_ctx = mp.get_context("spawn")
    ready_in, ready_out = mp_ctx.Pipe(duplex=False)
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}
    server = None
    rounds: list[dict] = []
    try:
        ipc = f"ipc://{socket_dir}/sock"
        server = mp_ctx.Process(target=serve, args=(ipc, ready_out), daemon=True)
        server.start()
        if not ready_in.poll(60):
            raise RuntimeError("the server did not start")
        endpoints = {"tcp": f"tcp://127.0.0.1:{ready_in.recv()}", "ipc": ipc}
        clients = {}
        for transport, endpoint in endpoints.items():
            socks[transport] = sockets.client_socket(ctx, endpoint, keys=None, server_role="paramserver",
                                                     max_bytes=MAX_BYTES)
            clients[transport] = Client(socks[transport])
        for k in range(args.rounds):
            result: dict[str, dict[str, float]] = {}
            for p in patterns:
                times = interleaved(clients, p, args.seconds)
                result[p["name"]] = {t: _median_us(ts) for t, ts in times.items()}
            rounds.append(result)
            print(f"round {k + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
        P.send(socks["tcp"], P.Header(P.Op.SHUTDOWN))
        P.recv(socks["tcp"], timeout=10.0)
    finally:
        for s in socks.values():
            s.close(linger=0)
        ctx.term()
        if server is not None:
            server.join(timeout=10)
            if server.is_alive():
                server.terminate()
                server.join(timeout=5)
        shutil.rmtree(socket_dir, ignore_errors=True)
    load_after = os.getloadavg()

    summary = summarize(patterns, rounds)
    print(f"\n{'pattern':<34} {'tcp us':>9} {'ipc us':>9} {'ipc-tcp us':>10} {'tcp GB/s':>8} {'ipc GB/s':>8} "
          f"{'ipc/tcp':>7} {'(min-max)':>11}")
    for s in summary:
        print(f"{s['pattern']:<34} {s['tcp_us']:>9.1f} {s['ipc_us']:>9.1f} {s['ipc_minus_tcp_us']:>10.1f} "
              f"{s['tcp_gb_per_s']:>8.3f} {s['ipc_gb_per_s']:>8.3f} {s['ratio_ipc_tcp']:>7.3f} "
              f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); {args.rounds} rounds "
          f"x {args.seconds} s per pattern and transport")
    out = {
        "benchmark": "transport", "transports": ["tcp://127.0.0.1", "ipc:// (0700 directory)"],
        "pattern": "DEALER -> ROUTER, 1 request in flight, zero-copy, protocol-validated", "rounds": args.rounds,
        "seconds": args.seconds,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "numpy": np.__version__,
                    "load_average_before": load_before, "load_average_after": load_after},
        "results": summary,
    }
    write_json(out, RESULTS)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
