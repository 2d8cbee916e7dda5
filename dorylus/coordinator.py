"""The coordinator of a local-mode distributed run: starts every role, drives epochs, stops them.

``LocalCluster`` starts the parameter server and one graph server per partition as child
processes (logs in ``<run dir>/logs``), and for the ``lambda`` backend a Lambda emulator whose
worker processes run the function. It stops all of them on success, on error and on Ctrl-C;
children also exit on their own when the coordinator disappears.

``DistributedTrainer`` has the reference trainer's interface (``step(epoch) -> metrics``). In
``sync`` mode an epoch is: forward phases for layers ``0..L-1`` (the last one fused with the
loss and its backward), backward phases for layers ``L-1..1``, one optimizer step on the
parameter server, then (when evaluating) forward phases without dropout for the accuracies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dorylus import protocol
from dorylus.config import TrainConfig
from dorylus.cost import lambda_cost_usd, server_cost_usd
from dorylus.errors import DorylusError
from dorylus.models.spec import ModelSpec
from dorylus.partition import PartitionStore
from dorylus.protocol import Header, Op

FUNCTION_NAME = "dorylus-gcn"
STARTUP_TIMEOUT_S = 120.0


class ClusterError(DorylusError):
    """A role failed to start, reported an error, died or stalled; the message says which and why.
    Not bad input, so the CLI exits with status 1."""

    exit_status = 1


@dataclasses.dataclass
class _Child:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def state(self) -> str:
        """The kernel's word for the process: running, sleeping, stopped (SIGSTOP), ..."""
        try:
            code = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "unknown"
        return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped",
                "Z": "exited"}.get(code, code)


class Watchdog:
    """Finds a role that stopped making progress without exiting.

    * Heartbeat: every role (parameter server, graph servers) is pinged with HELLO over a socket
      of its own every ``PING_S``; one that answers nothing for ``min_s`` is stalled (stopped,
      deadlocked, or starved), whatever it was doing.
    * Phases: a phase (or parameter-server command) may take ``max(min_s, factor x the moving
      mean of the same step)``; a step seen for the first time gets ``first_s`` (the task
      timeout). When it runs over while every role answers, the calls still in flight are the
      stalled ones: the graph servers' STATS name them.
    """

    PING_S = 1.0
    WINDOW = 10  # epochs in the moving mean

    def __init__(self, ctx: zmq.Context, min_s: float, factor: float, first_s: float):
        self.ctx, self.min_s, self.factor, self.first_s = ctx, min_s, factor, first_s
        self.roles: list[tuple[_Child, zmq.Socket]] = []
        self.unanswered_since: dict[str, float | None] = {}  # when the oldest unanswered ping was sent
        self.last_ping: dict[str, float] = {}
        self.durations: dict[str, list[float]] = {}

    def watch(self, child: _Child, endpoint: str) -> None:
        socket = self.ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        self.roles.append((child, socket))
        self.unanswered_since[child.name], self.last_ping[child.name] = None, 0.0

    def bound(self, step: str) -> tuple[float, str]:
        """Seconds ``step`` may take, and why."""
        history = self.durations.get(step)
        if not history:
            return self.first_s, f"the task timeout {self.first_s:g} s, for a step not seen before"
        mean = sum(history) / len(history)
        return (max(self.min_s, self.factor * mean),
                f"max({self.min_s:g} s, {self.factor:g} x its moving mean {mean:.3g} s)")

    def record(self, step: str, seconds: float) -> None:
        history = self.durations.setdefault(step, [])
        history.append(seconds)
        del history[:-self.WINDOW]

    def check_heartbeats(self, doing: str, bound_s: float | None = None) -> None:
        """Raise ClusterError naming a role whose oldest unanswered ping is older than ``bound_s``
        (default ``min_s``)."""
        bound_s = self.min_s if bound_s is None else bound_s
        now = time.monotonic()
        for child, socket in self.roles:
            self._drain(child, socket)
            if now - self.last_ping[child.name] >= self.PING_S:
                protocol.send(socket, Header(Op.HELLO, role="coordinator"))
                self.last_ping[child.name] = now
                if self.unanswered_since[child.name] is None:
                    self.unanswered_since[child.name] = now
            since = self.unanswered_since[child.name]
            if since is not None and (silent := now - since) > bound_s:
                raise ClusterError(f"watchdog: {child.name} (pid {child.process.pid}, {child.state()}) has not "
                                   f"answered a heartbeat for {silent:.0f} s while the run was doing {doing}; "
                                   f"its log: {child.log}")

    def _drain(self, child: _Child, socket: zmq.Socket) -> None:
        """Take the heartbeat replies that arrived: the role answered."""
        while socket.poll(0, zmq.POLLIN):
            socket.recv_multipart()
            self.unanswered_since[child.name] = None

    def in_flight(self) -> str:
        """What the graph servers report as still running, one clause per server."""
        found = []
        for child, socket in self.roles:
            if not child.name.startswith("graph server"):
                continue
            self._drain(child, socket)
            protocol.send(socket, Header(Op.STATS, req=1))
            deadline = time.monotonic() + 2.0
            while (wait := deadline - time.monotonic()) > 0 and socket.poll(int(wait * 1000), zmq.POLLIN):
                reply, _ = protocol.decode(socket.recv_multipart())
                if reply.op is Op.STATS:
                    if reply.meta.get("oldest_call"):
                        found.append(f"{child.name}: {reply.meta['in_flight']} call(s) in flight, the oldest "
                                     f"{reply.meta['oldest_call']} (log: {child.log})")
                    break
        return "; ".join(found) or "no function call in flight"

    def close(self) -> None:
        for _, socket in self.roles:
            socket.close(linger=0)
        self.roles = []


class LocalCluster:
    """Every process of a local-mode run; use as a context manager."""

    def __init__(self, config: TrainConfig, store: PartitionStore, run_dir: Path, config_file: Path):
        self.config = config
        self.store = store
        self.run_dir = Path(run_dir)
        self.config_file = config_file
        self.children: list[_Child] = []
        self.emulator = None
        self.ctx = zmq.Context()
        self.servers: list[zmq.Socket] = []
        self.ps: zmq.Socket | None = None
        self.ps_endpoint = ""
        self.intervals = 0
        self._ids = itertools.count(1)
        self.watchdog = Watchdog(self.ctx, config.watchdog_min_s, config.watchdog_factor, config.task_timeout_s)

    # ------------------------------------------------------------------ start and stop

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        meta = self.store.meta
        ps_ready = logs / "paramserver.endpoint"
        self._spawn("parameter server", logs / "paramserver.log", [
            "-m", "dorylus.paramserver", "--config", str(self.config_file), "--num-features", str(meta.num_features),
            "--num-classes", str(meta.num_classes), "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ps_ready)], ps_ready)
        self.ps_endpoint = self._wait_ready(ps_ready, self.children[-1])
        self.ps = self._dealer(self.ps_endpoint)
        self.watchdog.watch(self.children[-1], self.ps_endpoint)

        lambda_args: list[str] = []
        if self.config.backend == "lambda":
            from dorylus.emulator import serve

            self.emulator = serve(functions={FUNCTION_NAME: self.config.function_handler},
                                  concurrency=self.store.num_parts * self.config.functions,
                                  memory_mb=self.config.lambda_memory_mb, timeout_s=self.config.task_timeout_s,
                                  start_latency_ms=self.config.lambda_start_latency_ms)
            lambda_args = ["--lambda-endpoint", self.emulator.url, "--function-name", FUNCTION_NAME]

        ready_files = []
        threads = max(1, len(os.sched_getaffinity(0)) // self.store.num_parts)
        for i in range(self.store.num_parts):
            ready = logs / f"graphserver-{i}.endpoint"
            ready_files.append(ready)
            self._spawn(f"graph server {i}", logs / f"graphserver-{i}.log", [
                "-m", "graphserver.server", "--store", str(self.store.path), "--part", str(i),
                "--config", str(self.config_file), "--param-server", self.ps_endpoint, "--ready-file", str(ready),
                "--threads", str(threads), *lambda_args], ready)
        endpoints = [self._wait_ready(f, child) for f, child in zip(ready_files, self.children[1:])]
        self.servers = [self._dealer(e) for e in endpoints]
        for child, endpoint in zip(self.children[1:], endpoints):
            self.watchdog.watch(child, endpoint)
        replies = self.phase("connect", peers=",".join(endpoints))
        self.intervals = sum(r["intervals"] for r in replies)

    def _spawn(self, name: str, log: Path, args: list[str], ready_file: Path) -> None:
        ready_file.unlink(missing_ok=True)  # a resumed run's directory holds the previous roles' files
        with open(log, "a") as out:  # appended: a resumed run keeps the logs of its earlier attempts
            process = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=os.getcwd())
        self.children.append(_Child(name, process, log))

    def _wait_ready(self, ready_file: Path, child: _Child) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready_file.exists():
            if child.process.poll() is not None:
                raise ClusterError(f"{child.name} exited with code {child.process.returncode} while starting; "
                                   f"its log ({child.log}) ends with:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{child.name} did not start within {STARTUP_TIMEOUT_S:.0f} s (log: {child.log})")
            time.sleep(0.05)
        return ready_file.read_text().strip()

    def _dealer(self, endpoint: str) -> zmq.Socket:
        socket = self.ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        return socket

    def close(self) -> None:
        """Stop every role: ask politely, then terminate, then kill. Safe to call twice."""
        for socket in [*self.servers, *([self.ps] if self.ps else [])]:
            try:
                protocol.send(socket, Header(Op.SHUTDOWN, req=next(self._ids)))
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5.0
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.terminate()
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGCONT)  # a stopped role must run to see SIGTERM
        for child in self.children:
            try:
                child.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(timeout=5.0)
        self.children = []
        self.watchdog.close()
        for socket in [*self.servers, *([self.ps] if self.ps else [])]:
            socket.close(linger=0)
        self.servers, self.ps = [], None
        if self.emulator is not None:
            self.emulator.close()
            self.emulator = None
        self.ctx.term()

    # ------------------------------------------------------------------ commands

    def _check_alive(self) -> None:
        for child in self.children:
            if child.process.poll() is not None:
                raise ClusterError(f"{child.name} exited with code {child.process.returncode}; "
                                   f"its log ({child.log}) ends with:\n{child.tail()}")

    def _await(self, socket: zmq.Socket, req: int, what: str, step: str) -> tuple[Header, list[np.ndarray]]:
        """The reply to ``req``, while the watchdog checks the roles' heartbeats and that the
        ``step`` (a phase kind) finishes within its bound."""
        start = time.monotonic()
        bound, why = self.watchdog.bound(step)
        while True:
            if socket.poll(200, zmq.POLLIN):
                reply, tensors = protocol.recv(socket)
                if reply.req != req:
                    continue  # a late answer to an earlier request
                if reply.op is Op.ERROR:
                    raise ClusterError(f"{what} failed: {reply.message}")
                return reply, tensors
            self._check_alive()
            self.watchdog.check_heartbeats(what)
            if time.monotonic() - start > bound:
                # A role that stopped answering is the likelier culprit than the calls it waits on.
                self.watchdog.check_heartbeats(what, bound_s=3 * Watchdog.PING_S)
                raise ClusterError(f"watchdog: {what} made no progress for {time.monotonic() - start:.0f} s "
                                   f"(bound {bound:.0f} s: {why}); {self.watchdog.in_flight()}")

    def phase(self, command: str, **meta: Any) -> list[dict[str, Any]]:
        """Run one phase on every graph server at once; returns their replies' meta, by part."""
        start = time.monotonic()
        reqs = []
        for socket in self.servers:
            req = next(self._ids)
            protocol.send(socket, Header(Op.COMMAND, req=req, meta={"command": command, **meta}))
            reqs.append(req)
        what = (f"{command} epoch {meta['epoch']} layer {meta['layer']}" + ("" if meta.get("training", True)
                else " (evaluation)")) if "epoch" in meta else command
        step = f"{command} {meta.get('layer')} {meta.get('training')}"
        replies = [dict(self._await(s, r, what, step)[0].meta) for s, r in zip(self.servers, reqs)]
        self.watchdog.record(step, time.monotonic() - start)
        return replies

    def ps_request(self, header: Header, tensors: list[np.ndarray] = ()) -> tuple[Header, list[np.ndarray]]:
        start = time.monotonic()
        header = dataclasses.replace(header, req=next(self._ids))
        protocol.send(self.ps, header, tensors)
        step = f"parameter server {header.meta.get('command', header.op.value)}"
        reply = self._await(self.ps, header.req, step, step)
        self.watchdog.record(step, time.monotonic() - start)
        return reply

    def emulator_stats(self) -> dict[str, Any]:
        return self.emulator.stats() if self.emulator is not None else {}


class DistributedTrainer:
    """Drives a :class:`LocalCluster` epoch by epoch; ``step`` returns the epoch's metrics."""

    def __init__(self, config: TrainConfig, cluster: LocalCluster):
        self.config = config
        self.cluster = cluster
        meta = cluster.store.meta
        self.spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
        self.counts = {"train": meta.train_count, "val": meta.val_count, "test": meta.test_count}
        self.version = int(cluster.ps_request(Header(Op.HELLO, role="coordinator"))[0].meta.get("version", 0))

    def _forward(self, epoch: int, training: bool, timings: dict[str, float]) -> dict[str, Any]:
        for layer in range(len(self.spec.layers)):
            replies = self.cluster.phase("forward", epoch=epoch, layer=layer, training=training, version=self.version)
            _add_timings(timings, replies)
        return {k: sum(r[k] for r in replies) for k in ("loss", "correct_train", "correct_val", "correct_test")}

    def step(self, epoch: int) -> dict[str, Any]:
        start = time.perf_counter()
        before = self.cluster.emulator_stats()
        timings: dict[str, float] = {}
        train = self._forward(epoch, True, timings)
        for layer in range(len(self.spec.layers) - 1, 0, -1):
            _add_timings(timings, self.cluster.phase("backward", epoch=epoch, layer=layer, version=self.version))
        wu = time.perf_counter()
        reply, _ = self.cluster.ps_request(Header(Op.COMMAND, meta={
            "command": "step", "epoch": epoch, "expected": self.cluster.intervals}))
        self.version = int(reply.meta["version"])
        timings["wu_s"] = time.perf_counter() - wu
        metrics: dict[str, Any] = {"epoch": epoch, "loss": float(train["loss"])}
        if epoch % self.config.eval_every == 0 or epoch == self.config.epochs:
            evaluated = self._forward(epoch, False, timings)
            metrics.update({f"{k}_acc": evaluated[f"correct_{k}"] / v if v else float("nan")
                            for k, v in self.counts.items()})
        else:
            metrics.update(train_acc=None, val_acc=None, test_acc=None)
        metrics["epoch_s"] = time.perf_counter() - start
        metrics.update(self._cost(before, self.cluster.emulator_stats(), metrics["epoch_s"]))
        metrics["task_s"] = {k: v for k, v in timings.items() if k.endswith("_s")}
        metrics["bytes"] = {k[len("bytes_"):]: v for k, v in timings.items() if k.startswith("bytes_")}
        return metrics

    def _cost(self, before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
        invocations = int(after.get("invocations", 0) - before.get("invocations", 0))
        billed_gb_s = float(after.get("billed_gb_s", 0.0) - before.get("billed_gb_s", 0.0))
        servers = server_cost_usd(self.config.graph_server_instance, seconds, self.cluster.store.num_parts)
        servers += server_cost_usd(self.config.param_server_instance, seconds, 1)
        return {"invocations": invocations, "billed_gb_s": billed_gb_s,
                "cost_usd": lambda_cost_usd(billed_gb_s, invocations) + servers}

    def state(self) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """The parameter server's weights and optimizer state (see :mod:`dorylus.optim`)."""
        reply, tensors = self.cluster.ps_request(Header(Op.COMMAND, meta={"command": "get_state"}))
        arrays = {name: np.array(t) for name, t in zip(reply.names, tensors)}
        weights = [arrays.pop(f"W{layer}") for layer in range(len(self.spec.layers))]
        return weights, arrays

    def restore(self, weights: list[np.ndarray], optimizer: dict[str, np.ndarray], epoch: int) -> None:
        """Load a checkpoint's state into the parameter server; its version counts epochs (one
        step each), so the restored version is ``epoch``."""
        arrays = {**{f"W{layer}": np.asarray(w, np.float32) for layer, w in enumerate(weights)}, **optimizer}
        self.cluster.ps_request(Header(Op.COMMAND, names=tuple(arrays), meta={
            "command": "set_state", "version": epoch, "epoch": epoch, "optimizer": self.config.optimizer}),
            list(arrays.values()))
        self.version = epoch


def _add_timings(timings: dict[str, float], replies: list[dict[str, Any]]) -> None:
    """Per task kind, the slowest server's time (the phase waits for it); bytes are summed."""
    for key in {k for r in replies for k in r if k.endswith("_s")}:
        timings[key] = timings.get(key, 0.0) + max(r.get(key, 0.0) for r in replies)
    for key in {k for r in replies for k in r if k.startswith("bytes_")}:
        timings[key] = timings.get(key, 0) + sum(r.get(key, 0) for r in replies)
