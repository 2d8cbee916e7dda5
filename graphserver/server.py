"""The graph server process: owns one partition, runs Gather/Scatter, drives the tensor tasks.

One asyncio loop serves a ROUTER socket that functions (PULL/PUSH), peer graph servers
(GHOSTS) and the coordinator (COMMAND) all talk to. The coordinator runs training as phases;
each COMMAND is one phase on every graph server:

* ``forward`` (epoch, layer, training, version): per interval, GA of its rows and then its AV
  task (the fused AV_LOSS on the last layer), intervals overlapping; then SC: send the new rows
  that peers hold as ghosts and wait for theirs. The wait is the synchronous barrier.
* ``backward`` (epoch, layer >= 1, version): GA_BWD (``A_hat^T · dZ_l``), SC_BWD (ghost-row
  gradients go back to their owners and are summed in peer order), then AV_BWD of layer l-1.

The phase structure is the scheduling policy: pipelining and bounded staleness (DESIGN §3) change
what a phase waits for (per-interval readiness instead of the Scatter barrier), not the tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import zmq
import zmq.asyncio

from dorylus import protocol
from dorylus.config import TrainConfig, load_config_file
from dorylus.endpoints import check_endpoint
from dorylus.errors import ConfigError
from dorylus.lifecycle import stop_with_parent
from dorylus.models.spec import ModelSpec
from dorylus.partition import open_store
from dorylus.protocol import Bounds, Header, Op, ProtocolError
from dorylus.runs import atomic_write_text
from graphserver.invoker import LambdaInvoker, TaskFailed, describe
from lambdas.handler import PULL_NAMES, compute_task, task_header


PASSES = ("setup", "train", "eval")  # kinds of ghost exchange: features once, then per epoch


class AsyncPeer:
    """A DEALER connection to a server, one request in flight at a time."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, what: str):
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.what = f"{what} at {endpoint}"
        self.lock = asyncio.Lock()
        self.bytes_out = 0

    async def request(self, header: Header, tensors: Sequence[np.ndarray] = (), *,
                      timeout: float) -> tuple[Header, list[np.ndarray]]:
        header = dataclasses.replace(header, req=next(self._ids))
        async with self.lock:
            frames = protocol.encode(header, tensors)
            self.bytes_out += sum(np.asarray(t).nbytes for t in tensors)
            await self.socket.send_multipart(frames, copy=False)
            if not await self.socket.poll(int(timeout * 1000), zmq.POLLIN):
                raise TaskFailed(f"{self.what} did not answer {header.op.value} within {timeout:.0f} s")
            reply, arrays = protocol.decode(await self.socket.recv_multipart(copy=False))
        if reply.op is Op.ERROR:
            raise TaskFailed(f"{self.what} refused {header.op.value}: {reply.code}: {reply.message}")
        return reply, arrays

    def close(self) -> None:
        self.socket.close(linger=0)


class GraphServer:
    def __init__(self, store_path: str, part_id: int, config: TrainConfig, *, param_server: str,
                 lambda_endpoint: str | None = None, function_name: str = "dorylus-gcn"):
        store = open_store(store_path, verify=False)
        store.verify([part_id])
        self.meta = store.meta
        self.part_id = part_id
        self.num_parts = store.num_parts
        self.config = config
        self.spec = ModelSpec.from_config(config, self.meta.num_features, self.meta.num_classes)
        from graphserver.state import PartitionState  # torch: kept out of the module so `--help` is fast

        self.state = PartitionState(store.load_part(part_id), self.spec, seed=config.seed,
                                    row_normalize_features=config.row_normalize_features,
                                    num_intervals=config.functions)
        self.bounds = Bounds(num_rows=self.state.n_owned, intervals=self.state.intervals,
                             num_layers=len(self.spec.layers))
        self.param_server = param_server
        self.backend = config.backend
        self.invoker = LambdaInvoker(lambda_endpoint, function_name, concurrency=config.functions,
                                     timeout_s=config.task_timeout_s) if config.backend == "lambda" else None
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=config.functions)
        self.ctx = zmq.asyncio.Context()
        self.router: zmq.asyncio.Socket | None = None
        self.peers: dict[int, AsyncPeer] = {}
        self.ps: AsyncPeer | None = None
        self.endpoint = ""
        # The phase in progress: pushes for any other (task, epoch, layer) are stale and dropped.
        self.active: set[tuple[str, int, int]] = set()
        self.pushed: dict[tuple, dict[str, Any]] = {}
        self.inbox: dict[tuple[str, str, int, int], dict[int, np.ndarray]] = defaultdict(dict)
        self.inbox_changed = asyncio.Event()
        self.in_flight: dict[str, float] = {}  # function calls running: description -> start (monotonic)
        self.counters: dict[str, float] = defaultdict(float)
        self.rejected = protocol.ProtocolCounters()
        self.stopping = asyncio.Event()

    # ------------------------------------------------------------------ message loop

    async def serve(self, bind: str, ready_file: str | None = None) -> None:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        try:
            self.router.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"graph server {self.part_id}: cannot bind {bind}: "
                              f"{zmq.strerror(exc.errno).lower()}") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to :0
        self.ps = AsyncPeer(self.ctx, self.param_server, "parameter server")
        if ready_file:
            atomic_write_text(Path(ready_file), self.endpoint)
        print(f"graph server {self.part_id} listening on {self.endpoint}", flush=True)
        receiver = asyncio.create_task(self._receive_loop())
        await self.stopping.wait()
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        self.close()

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart(copy=False)
            identity = bytes(frames[0].buffer)
            header = None
            try:
                header, tensors = protocol.decode(frames[1:], check_finite=True)
                await self._dispatch(identity, header, tensors)
            except (ProtocolError, TaskFailed, ValueError, KeyError) as exc:
                if isinstance(exc, ProtocolError):
                    self.rejected.count(exc)
                if header is None or header.op in protocol.REQUESTS:
                    await self._reply(identity, protocol.error_reply(header, exc))

    async def _reply(self, identity: bytes, header: Header, tensors: Sequence[np.ndarray] = ()) -> None:
        self.counters["bytes_out"] += sum(np.asarray(t).nbytes for t in tensors)
        await self.router.send_multipart([identity, *protocol.encode(header, tensors)], copy=False)

    async def _dispatch(self, identity: bytes, header: Header, tensors: list[np.ndarray]) -> None:
        if header.op is Op.PULL:
            self.bounds.check(header)
            rows = self._read_rows(header)
            await self._reply(identity, protocol.reply_to(header, Op.ROWS), rows)
        elif header.op is Op.PUSH:
            self.bounds.check(header)
            self.counters["bytes_in"] += sum(t.nbytes for t in tensors)
            duplicate = self._accept_push(header, tensors)
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta={"duplicate": duplicate}))
        elif header.op is Op.GHOSTS:
            self._accept_ghosts(header, tensors)
            await self._reply(identity, protocol.reply_to(header, Op.ACK))
        elif header.op is Op.COMMAND:
            asyncio.create_task(self._run_command(identity, header))
        elif header.op is Op.HELLO:
            await self._reply(identity, protocol.reply_to(header, Op.READY, meta={"part": self.part_id}))
        elif header.op is Op.STATS:
            meta = {**self.counters, **{f"rejected.{k}": v for k, v in self.rejected.as_dict().items()},
                    "in_flight": len(self.in_flight)}
            if self.in_flight:  # for the coordinator's watchdog: what has been running longest
                call, since = min(self.in_flight.items(), key=lambda item: item[1])
                meta["oldest_call"] = f"{call}, running for {time.monotonic() - since:.0f} s"
            await self._reply(identity, protocol.reply_to(header, Op.STATS, meta=meta))
        elif header.op is Op.SHUTDOWN:
            await self._reply(identity, protocol.reply_to(header, Op.ACK))
            self.stopping.set()
        else:
            raise ProtocolError("unknown_op", f"graph server does not handle {header.op.value}", req=header.req)

    # ------------------------------------------------------------------ rows in and out

    def _read_rows(self, header: Header) -> list[np.ndarray]:
        start, stop = header.rows
        s = self.state
        sources = {
            "Z": lambda: s.Z[header.layer],
            "ids": lambda: s.owned_ids,
            "GH": lambda: s.GH[header.layer + 1],
            "labels": lambda: s.labels,
            "split": lambda: s.split,
        }
        unknown = [n for n in header.names if n not in sources]
        if unknown:
            raise ProtocolError("bad_field", f"unknown tensor name(s) {unknown}", req=header.req)
        if "GH" in header.names and header.layer + 1 not in s.GH:
            raise ProtocolError("out_of_range", f"no GH for layer {header.layer + 1}", req=header.req)
        return [sources[name]()[start:stop] for name in header.names]

    def _accept_push(self, header: Header, tensors: list[np.ndarray]) -> bool:
        """Store a task's result rows; True if it was a duplicate (or stale) and was dropped."""
        key = header.key
        if (header.task, header.epoch, header.layer) not in self.active or key in self.pushed:
            self.counters["duplicate_pushes"] += 1
            return True
        s = self.state
        # What each task pushes, and where it goes: AV the next layer's input rows, the others dL/dZ.
        if header.task == "AV":
            expected, dest = ("H",), s.H[header.layer + 1][: s.n_owned]
        elif header.task == "AV_BWD":
            expected, dest = ("GZ",), s.GZ[header.layer]
        else:  # AV_LOSS; an evaluation pass pushes only its counts
            expected, dest = (("GZ",) if header.names else ()), s.GZ[header.layer]
        if tuple(header.names) != expected:
            raise ProtocolError("bad_field", f"{header.task} must push {list(expected)}, got {list(header.names)}",
                                req=header.req)
        if expected:
            protocol.write_rows(dest, header, tensors[0])
        self.pushed[key] = dict(header.meta)
        return False

    def _accept_ghosts(self, header: Header, tensors: list[np.ndarray]) -> None:
        tag = header.meta.get("pass", "train")
        if tag not in PASSES:
            raise ProtocolError("bad_field", f"GHOSTS pass {tag!r} is not one of {', '.join(PASSES)}", req=header.req)
        peer = header.part
        if peer is None or not 0 <= peer < self.num_parts or peer == self.part_id:
            raise ProtocolError("out_of_range", f"GHOSTS from invalid part {peer}", req=header.req)
        part = self.state.part
        expected = (len(range(*part.ghost_rows(peer).indices(part.n_local))) if header.task == "SC"
                    else len(part.send_rows(peer)))
        if header.rows != (0, expected):
            raise ProtocolError("row_count", f"GHOSTS {header.task} from part {peer} must carry rows [0, {expected})",
                                req=header.req)
        rows = tensors[0]
        width = self._width(header.layer)
        if rows.ndim != 2 or rows.shape[1] != width or rows.dtype != np.float32:
            raise ProtocolError("dest_mismatch", f"GHOSTS rows must be float32 [n, {width}], got {rows.dtype}{list(rows.shape)}",
                                req=header.req)
        key = (tag, header.task, header.epoch, header.layer)
        if peer in self.inbox[key]:
            self.counters["duplicate_ghosts"] += 1
        else:
            self.inbox[key][peer] = rows.copy()
            self.inbox_changed.set()

    def _width(self, layer: int) -> int:
        if layer is None or not 0 <= layer < len(self.spec.layers):
            raise ProtocolError("out_of_range", f"layer {layer} out of range")
        return self.spec.layers[layer].in_dim

    # ------------------------------------------------------------------ phases

    async def _run_command(self, identity: bytes, header: Header) -> None:
        m = header.meta
        try:
            command = m.get("command")
            if command == "connect":
                result = await self.connect([e for e in str(m["peers"]).split(",")])
            elif command == "forward":
                result = await self.forward(int(m["epoch"]), int(m["layer"]), bool(m["training"]), int(m["version"]))
            elif command == "backward":
                result = await self.backward(int(m["epoch"]), int(m["layer"]), int(m["version"]))
            else:
                raise ValueError(f"unknown command {command!r}")
            result.update(self._take_traffic())
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta=result))
        except Exception as exc:  # reported to the coordinator, which stops the run
            message = f"graph server {self.part_id}: {type(exc).__name__}: {exc}" if not isinstance(exc, TaskFailed) else str(exc)
            reply = Header(Op.ERROR, req=header.req, code="internal", message=message[: protocol.MAX_MESSAGE_CHARS])
            await self._reply(identity, reply)

    def _take_traffic(self) -> dict[str, int]:
        """Tensor bytes moved since the last phase reply, by kind of peer."""
        traffic = {"bytes_functions": int(self.counters.pop("bytes_in", 0) + self.counters.pop("bytes_out", 0)),
                   "bytes_ghosts": int(self.counters.pop("ghost_bytes_out", 0))}
        if self.ps is not None:
            traffic["bytes_params"] = int(self.ps.bytes_out)
            self.ps.bytes_out = 0
        return traffic

    async def connect(self, endpoints: list[str]) -> dict[str, Any]:
        if len(endpoints) != self.num_parts:
            raise ValueError(f"connect needs {self.num_parts} endpoints, got {len(endpoints)}")
        for j, endpoint in enumerate(endpoints):
            if j != self.part_id and j not in self.peers:
                self.peers[j] = AsyncPeer(self.ctx, endpoint, f"graph server {j}")
        # Static features of ghost vertices travel once; dropout is applied locally per epoch.
        await self._scatter(0, 0, self.state.X, "setup")
        return {"ghosts": int(self.state.part.n_ghost), "intervals": len(self.state.intervals)}

    async def _scatter(self, epoch: int, layer: int, buffer: np.ndarray, tag: str) -> None:
        """SC: peers get our rows of ``buffer`` that they hold as ghosts; theirs fill our ghost rows."""
        await self._exchange("SC", epoch, layer, buffer, tag)
        received = self.inbox.pop((tag, "SC", epoch, layer), {})
        for j in self.peers:
            buffer[self.state.part.ghost_rows(j)] = received[j]

    async def forward(self, epoch: int, layer: int, training: bool, version: int) -> dict[str, Any]:
        s, L = self.state, len(self.spec.layers)
        last = layer == L - 1
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        source = await loop.run_in_executor(self.executor, s.gather_input, layer, epoch, training)
        gather_s = time.perf_counter() - start

        async def gather(interval: int) -> None:  # GA of an interval; its AV starts right after
            nonlocal gather_s
            t = time.perf_counter()
            await loop.run_in_executor(self.executor, s.gather, layer, interval, source)
            gather_s += time.perf_counter() - t

        results = await self._run_tasks("AV_LOSS" if last else "AV", epoch, layer, training, version, gather)
        av = time.perf_counter()
        out: dict[str, Any] = {"ga_s": gather_s, "av_s": av - start}
        if last:
            for name in ("loss", "correct_train", "correct_val", "correct_test"):
                out[name] = sum(r[name] for r in results)
        else:
            await self._scatter(epoch, layer + 1, s.H[layer + 1], "train" if training else "eval")
            out["sc_s"] = time.perf_counter() - av
        return out

    async def backward(self, epoch: int, layer: int, version: int) -> dict[str, Any]:
        if layer < 1:
            raise ValueError("backward phases run for layers >= 1 (no gradient flows into the input features)")
        s = self.state
        start = time.perf_counter()
        local = await asyncio.get_running_loop().run_in_executor(self.executor, s.gather_backward, layer)
        ga = time.perf_counter()
        await self._exchange("SC_BWD", epoch, layer, local, "train")
        grad = s.GH[layer]
        grad[:] = local[: s.n_owned]
        received = self.inbox.pop(("train", "SC_BWD", epoch, layer), {})
        for j in sorted(self.peers):  # fixed order: the sum does not depend on arrival order
            grad[s.part.send_rows(j)] += received[j]
        sc = time.perf_counter()
        await self._run_tasks("AV_BWD", epoch, layer - 1, True, version)
        return {"ga_bwd_s": ga - start, "sc_bwd_s": sc - ga, "av_bwd_s": time.perf_counter() - sc}

    async def _exchange(self, task: str, epoch: int, layer: int, source: np.ndarray, tag: str) -> None:
        """Send every peer its rows of ``source`` and wait until every peer's rows arrived.
        ``tag`` (one of PASSES) keeps the exchanges of one epoch's training and evaluation passes apart."""
        s = self.state
        timeout = self.config.task_timeout_s

        async def send(j: int) -> None:
            rows = source[s.part.send_rows(j)] if task == "SC" else source[s.part.ghost_rows(j)]
            self.counters["ghost_bytes_out"] += rows.nbytes
            await self.peers[j].request(Header(Op.GHOSTS, task=task, epoch=epoch, layer=layer, part=self.part_id,
                                               rows=(0, rows.shape[0]), meta={"pass": tag}), [rows], timeout=timeout)

        await asyncio.gather(*(send(j) for j in self.peers))
        key = (tag, task, epoch, layer)
        deadline = time.monotonic() + timeout
        while len(self.inbox[key]) < len(self.peers):
            self.inbox_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(self.peers) - set(self.inbox[key]))
                raise TaskFailed(f"graph server {self.part_id}: {task} epoch {epoch} layer {layer}: "
                                 f"no rows from graph server(s) {missing} within {timeout:.0f} s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.inbox_changed.wait(), remaining)

    async def _run_tasks(self, task: str, epoch: int, layer: int, training: bool, version: int,
                         before=None) -> list[dict]:
        """One task per interval, through the backend, each after ``await before(interval)`` if
        given (so graph work on one interval overlaps function work on another); returns each
        interval's pushed meta."""
        phase = (task, epoch, layer)
        self.active = {phase}
        events = [self._event(task, epoch, layer, i, training, version) for i in range(len(self.state.intervals))]
        run = self._run_local if self.backend == "cpu" else self._run_remote

        async def pipeline(event: dict[str, Any]) -> None:
            if before is not None:
                await before(event["interval"])
            call = describe(event)
            self.in_flight[call] = time.monotonic()
            try:
                await run(event)
            finally:
                del self.in_flight[call]

        try:
            await asyncio.gather(*(pipeline(e) for e in events))
            results = []
            for e in events:
                key = (task, e["interval"], epoch, layer)
                if key not in self.pushed:
                    raise TaskFailed(f"{task} interval {e['interval']} epoch {epoch} layer {layer} on graph server "
                                     f"{self.part_id}: the function returned without pushing its result")
                results.append(self.pushed.pop(key))
            return results
        finally:
            self.active = set()
            for key in [k for k in self.pushed if (k[0], k[2], k[3]) == phase]:
                del self.pushed[key]

    def _event(self, task: str, epoch: int, layer: int, interval: int, training: bool, version: int) -> dict[str, Any]:
        layers = self.spec.layers
        start, stop = self.state.intervals[interval]
        next_dropout = layers[layer + 1].dropout if layer + 1 < len(layers) else 0.0
        return {
            "task": task, "graph_server": self.endpoint, "param_server": self.param_server,
            "part": self.part_id, "interval": interval, "rows": [start, stop], "epoch": epoch, "layer": layer,
            "version": version, "attempt": 0, "training": training, "seed": self.config.seed,
            "next_dropout": next_dropout, "train_count": self.meta.train_count,
        }

    async def _run_remote(self, event: dict[str, Any]) -> None:
        self.counters["invocations"] += 1
        await self.invoker.invoke(event)

    async def _run_local(self, event: dict[str, Any]) -> None:
        """The ``cpu`` backend: the function's math in this process, no invoke and no tensor hop."""
        timeout = self.config.task_timeout_s
        pull = task_header(Op.PULL, event, names=PULL_NAMES[event["task"]])
        rows = dict(zip(pull.names, self._read_rows(pull)))
        reply, (w,) = await self.ps.request(Header(Op.PULL_WEIGHTS, layer=event["layer"], epoch=event["epoch"],
                                                   interval=event["interval"], version=event["version"]),
                                            timeout=timeout)
        out = await asyncio.get_running_loop().run_in_executor(self.executor, compute_task, event, rows, w)
        if out.grad_w is not None:
            await self.ps.request(Header(Op.PUSH_GRADS, layer=event["layer"], epoch=event["epoch"],
                                         interval=event["interval"], part=self.part_id, version=reply.version),
                                  [out.grad_w], timeout=timeout)
        self._accept_push(task_header(Op.PUSH, event, names=out.names, meta=out.meta), out.rows)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        if self.ps is not None:
            self.ps.close()
        if self.router is not None:
            self.router.close(linger=0)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.ctx.term()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="partition store directory")
    parser.add_argument("--part", type=int, required=True, help="partition id this server owns")
    parser.add_argument("--config", required=True, help="the run's config file (config.json of the run directory)")
    parser.add_argument("--param-server", required=True, help="parameter server endpoint, tcp://HOST:PORT")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ROUTER endpoint to bind (port 0: any free port)")
    parser.add_argument("--ready-file", help="write the bound endpoint into this file once listening")
    parser.add_argument("--lambda-endpoint", help="Lambda Invoke API endpoint URL (the emulator's, or omit for AWS)")
    parser.add_argument("--function-name", default="dorylus-gcn", help="name of the deployed function")
    parser.add_argument("--threads", type=int, help="threads for Gather (default: torch's, all cores); local mode "
                                                    "gives each of P servers its share so they do not oversubscribe")


def run_from_args(args: argparse.Namespace) -> int:
    check_endpoint("--bind", args.bind)
    check_endpoint("--param-server", args.param_server)
    if args.ready_file and not Path(args.ready_file).parent.is_dir():
        raise ConfigError(f"--ready-file {args.ready_file}: directory {Path(args.ready_file).parent} does not exist")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads} must be >= 1")
    config = TrainConfig.from_dict(load_config_file(args.config), where=args.config)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    async def main() -> None:
        server = GraphServer(args.store, args.part, config, param_server=args.param_server,
                             lambda_endpoint=args.lambda_endpoint, function_name=args.function_name)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stopping.set)
        watch = stop_with_parent(lambda: loop.call_soon_threadsafe(server.stopping.set))
        try:
            await server.serve(args.bind, args.ready_file)
        finally:
            watch.set()
            if server.invoker is not None:
                await server.invoker.close()

    asyncio.run(main())
    return 0


if __name__ == "__main__":
    from dorylus.cli import main

    # The same parser and the same one-line errors as `dorylus graphserver`.
    sys.exit(main(["graphserver", *sys.argv[1:]]))
