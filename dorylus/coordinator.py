"""The coordinator of a distributed run: reaches every role, drives epochs, stops them.

``Cluster`` is what the training loop needs of the roles, wherever they run: sockets to the
parameter server and the graph servers, commands with the watchdog's bounds, and SHUTDOWN at
the end. ``LocalCluster`` starts the parameter server and one graph server per partition as
child processes (logs in ``<run dir>/logs``), and for the ``lambda`` backend a Lambda emulator
whose worker processes run the function. It stops all of them on success, on error and on
Ctrl-C; children also exit on their own when the coordinator disappears. The roles listen on
Unix sockets (``ipc://``) in a directory of mode 0700, so that only this user's processes can
reach them (docs/security.md). With ``curve`` on, every connection also uses CURVE with
ephemeral keys in ``<run dir>/keys`` (removed at the end).
``RemoteCluster`` (:mod:`dorylus.remote`) connects to servers that are already running.

``DistributedTrainer`` has the reference trainer's interface (``step(epoch) -> metrics``); the
graph servers run the epochs themselves (:mod:`graphserver.scheduler`) and the coordinator
collects their reports, publishes ``min_epoch``, watches the roles and takes checkpoints. A
graph server's spot interruption notice (:mod:`dorylus.spot`) reaches it in ``progress``
replies and is passed to ``on_interruption`` (the epoch loop checkpoints at once). With
``--preempt PART@EPOCH`` a local run plays AWS: graph server PART's watcher polls a
:class:`~dorylus.spot.LocalImds`, which posts the notice when the coordinator starts epoch
EPOCH, and the server is killed once the coordinator has checkpointed on that notice (at most
:data:`PREEMPT_GRACE_S` after it was posted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dorylus import curve, protocol, sockets, spot, zygote
from dorylus.config import TrainConfig
from dorylus.cost import Pricing, epoch_metrics
from dorylus.errors import DorylusError
from dorylus.lifecycle import local_process_environment
from dorylus.models.spec import ModelSpec
from dorylus.partition import PartitionStore
from dorylus.peer import Peer, Pending, Refused
from dorylus.protocol import Header, Op

STARTUP_TIMEOUT_S = 120.0
# --preempt: a preempted server is killed as soon as the coordinator has checkpointed on its
# notice, so that the kill always follows the checkpoint and falls inside even a short run; if
# the notice never reaches the coordinator, this long after it was posted (AWS gives 120 s). And
# the watcher's poll interval.
PREEMPT_GRACE_S = 10.0
PREEMPT_WATCH_S = 0.1
# A Unix socket's path must fit sockaddr_un's 108 bytes; the longest name here is graphserver-1023.
MAX_SOCKET_DIR_CHARS = 108 - 1 - len("/graphserver-1023")


class ClusterError(DorylusError):
    """A role failed to start, reported an error, died or stalled; the message says which and why.
    Not bad input, so the CLI exits with status 1. ``code``: the ERROR reply's code, if one came."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code

    exit_status = 1


class RoleDied(ClusterError):
    """A running role's process exited (``role``: its name). The training loop may restart the
    roles and go on from the last epoch's state (``--max-recoveries``, :func:`dorylus.training._train`)."""

    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role


@dataclasses.dataclass
class _Child:
    name: str
    process: subprocess.Popen | zygote.Role
    log: Path
    preempted: bool = False  # killed by --preempt

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def where(self) -> str:
        """How a report names it: pid, state and log."""
        return f"pid {self.process.pid}, {self.state()}; its log: {self.log}"

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

    def __init__(self, ctx: zmq.Context, min_s: float, factor: float, first_s: float,
                 keys: curve.Keyring | None = None):
        self.ctx, self.min_s, self.factor, self.first_s, self.keys = ctx, min_s, factor, first_s, keys
        self.roles: list[tuple[Any, zmq.Socket]] = []  # (a role with .name and .where(), its socket)
        self.unanswered_since: dict[str, float | None] = {}  # when the oldest unanswered ping was sent
        self.last_ping: dict[str, float] = {}
        self.durations: dict[str, list[float]] = {}

    def watch(self, child: Any, endpoint: str, server_role: str) -> None:
        socket = sockets.client_socket(self.ctx, endpoint, keys=self.keys, server_role=server_role,
                                       max_bytes=sockets.message_limit(0))
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
                raise ClusterError(f"watchdog: {child.name} ({child.where()}) has not answered a heartbeat for "
                                   f"{silent:.0f} s while the run was doing {doing}")

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
                                     f"{reply.meta['oldest_call']} ({child.where()})")
                    break
        return "; ".join(found) or "no function call in flight"

    def close(self) -> None:
        for _, socket in self.roles:
            socket.close(linger=0)
        self.roles = []


class Cluster:
    """The roles of one run as the training loop sees them (:class:`DistributedTrainer`): a
    socket to the parameter server and one per graph server (CURVE clients with the
    coordinator's key when ``keys`` is given), commands awaited under the watchdog's bounds,
    and SHUTDOWN for every role at the end. Subclasses start or find the roles (:meth:`start`)
    and may check that they are alive (:meth:`_check_alive`). Use as a context manager."""

    def __init__(self, config: TrainConfig, store, run_dir: Path | None, keys: curve.Keyring | None):
        self.config = config
        self.store = store
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keys = keys
        self.ctx = zmq.Context()
        self.servers: list[Peer] = []
        self.ps: Peer | None = None
        self.ps_endpoint = ""
        self.intervals = 0
        self.watchdog = Watchdog(self.ctx, config.watchdog_min_s, config.watchdog_factor, config.task_timeout_s,
                                 keys=keys)
        meta = store.meta
        spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
        # What the coordinator receives: weights and optimizer state from the parameter server
        # (get_state), headers alone from the graph servers.
        self.ps_max_bytes = sockets.message_limit(sockets.largest_weight_bytes(spec.named_shapes().values()),
                                                  config.max_message_mb)
        self.graph_max_bytes = sockets.message_limit(0, config.max_message_mb)

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _peer(self, endpoint: str, server_role: str) -> Peer:
        ps = server_role == "paramserver"
        return Peer(self.ctx, endpoint, "parameter server" if ps else "graph server", server_role=server_role,
                    keys=self.keys, max_bytes=self.ps_max_bytes if ps else self.graph_max_bytes)

    def _connect_graph_servers(self, endpoints: list[str], **meta: Any) -> list[dict[str, Any]]:
        """Tell every graph server its peers (and, in cluster mode, the function to invoke)."""
        replies = self.command("connect", peers=",".join(endpoints), **meta)
        self.intervals = sum(r["intervals"] for r in replies)
        return replies

    def _shutdown_roles(self) -> list[Pending]:
        """Send SHUTDOWN to every role; returns the requests, whose acknowledgements a caller
        may await."""
        sent = []
        for peer in [*self.servers, *([self.ps] if self.ps else [])]:
            with contextlib.suppress(zmq.ZMQError):
                sent.append(peer.send(Header(Op.SHUTDOWN)))
        return sent

    def _close_sockets(self) -> None:
        self.watchdog.close()
        for peer in [*self.servers, *([self.ps] if self.ps else [])]:
            peer.close()
        self.servers, self.ps = [], None

    # ------------------------------------------------------------------ commands

    def _check_alive(self) -> None:
        """Raise ClusterError if a role is known to be gone (local mode: its process exited)."""

    def _await(self, pending: Pending, what: str, step: str) -> tuple[Header, list[np.ndarray]]:
        """The reply to ``pending``, while the watchdog checks the roles' heartbeats and that the
        ``step`` finishes within its bound."""
        start = time.monotonic()
        bound, why = self.watchdog.bound(step)
        try:
            return pending.reply(on_wait=lambda: self.check(what, time.monotonic() - start, bound, why))
        except Refused as exc:
            raise ClusterError(f"{what} failed: {exc.reason}", exc.code) from None

    def check(self, what: str, elapsed: float, bound: float, why: str) -> None:
        """Raise ClusterError if a role died or stalled, or ``what`` ran past its bound."""
        self._check_alive()
        self.watchdog.check_heartbeats(what)
        if elapsed > bound:
            # A role that stopped answering is the likelier culprit than the calls it waits on.
            self.watchdog.check_heartbeats(what, bound_s=3 * Watchdog.PING_S)
            raise ClusterError(f"watchdog: {what} made no progress for {elapsed:.0f} s "
                               f"(bound {bound:.0f} s: {why}); {self.watchdog.in_flight()}")

    def command(self, command: str, **meta: Any) -> list[dict[str, Any]]:
        """Send one command to every graph server at once; returns their replies' meta, by part."""
        return [dict(reply.meta) for reply in self.command_replies(command, **meta)]

    def command_replies(self, command: str, **meta: Any) -> list[Header]:
        """Send one command to every graph server at once; returns their reply headers (``doc``
        included), by part."""
        sent = [peer.send(Header(Op.COMMAND, meta={"command": command, **meta})) for peer in self.servers]
        return [self._await(pending, command, command)[0] for pending in sent]

    def ps_request(self, header: Header, tensors: list[np.ndarray] = ()) -> tuple[Header, list[np.ndarray]]:
        start = time.monotonic()
        step = f"parameter server {header.meta.get('command', header.op.value)}"
        reply = self._await(self.ps.send(header, tensors), step, step)
        self.watchdog.record(step, time.monotonic() - start)
        return reply

    def emulator_stats(self) -> dict[str, Any]:
        return {}

    def epoch_begins(self, epoch: int) -> None:
        """The training loop starts waiting for ``epoch`` (LocalCluster: ``--preempt``)."""

    def interruption_handled(self, part: int) -> None:
        """The coordinator acted on graph server ``part``'s interruption notice (LocalCluster:
        a ``--preempt`` kill is due now)."""


class LocalCluster(Cluster):
    """Every process of a local-mode run; use as a context manager."""

    def __init__(self, config: TrainConfig, store: PartitionStore, run_dir: Path, config_file: Path):
        self.keys_dir = Path(run_dir) / "keys" if config.curve else None
        keys = self._make_keys() if self.keys_dir is not None else None
        super().__init__(config, store, run_dir, keys)
        self.config_file = config_file
        self.children: list[_Child] = []
        self._services = contextlib.ExitStack()  # what the backend starts beside the roles (lambda: the emulator)
        self.services = None
        self.socket_dir: Path | None = None
        # --preempt: the (part, epoch) notices not yet posted, each preempted part's metadata
        # service, and the kills that are due (monotonic time, part).
        self.preempts = set(config.preemptions())
        self.imds: dict[int, spot.LocalImds] = {}
        self.kills: list[tuple[float, int]] = []

    def _make_keys(self) -> curve.Keyring:
        """Ephemeral keys for this run (a resumed run makes new ones), removed by :meth:`close`."""
        shutil.rmtree(self.keys_dir, ignore_errors=True)  # left by a run that was killed
        curve.write_keys(self.keys_dir)
        return curve.load_keys(self.keys_dir, "coordinator")

    # ------------------------------------------------------------------ start and stop

    def _make_socket_dir(self) -> Path:
        """A new directory for the roles' Unix sockets, mode 0700 (mkdtemp's): the kernel lets
        no other user (root aside) connect to a socket in it. The run directory's path may be
        too long for a socket's address; the system's temporary directory usually is not."""
        for parent in (None, "/tmp"):
            path = Path(tempfile.mkdtemp(prefix="dorylus-", dir=parent))
            if len(str(path)) <= MAX_SOCKET_DIR_CHARS:
                return path
            path.rmdir()
        raise ClusterError(f"no directory for the roles' sockets: {path.parent} and /tmp make paths over "
                           f"{MAX_SOCKET_DIR_CHARS} characters (set TMPDIR to a shorter directory)")

    def start(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.socket_dir = self._make_socket_dir()
        meta = self.store.meta
        keys_args = ["--keys", str(self.keys_dir)] if self.keys_dir is not None else []
        ps_ready = logs / "paramserver.endpoint"
        self._spawn("parameter server", logs / "paramserver.log", "dorylus.paramserver", [
            "--config", str(self.config_file), "--num-features", str(meta.num_features),
            "--num-classes", str(meta.num_classes), "--bind", f"ipc://{self.socket_dir}/paramserver",
            "--ready-file", str(ps_ready), *keys_args], ps_ready)
        self.ps_endpoint = self._wait_ready(ps_ready, self.children[-1])
        self.ps = self._peer(self.ps_endpoint, "paramserver")
        self.watchdog.watch(self.children[-1], self.ps_endpoint, "paramserver")

        from graphserver.backends import backend_class

        self.services = self._services.enter_context(backend_class(self.config.backend).local_services(
            self.config, self.store.num_parts, self.keys_dir))

        ready_files = []
        threads = max(1, len(os.sched_getaffinity(0)) // self.store.num_parts)
        for i in range(self.store.num_parts):
            ready = logs / f"graphserver-{i}.endpoint"
            ready_files.append(ready)
            watch_args: list[str] = []
            if any(part == i for part, _ in self.preempts):  # a fresh instance: no notice yet
                self.imds[i] = spot.LocalImds()
                watch_args = ["--spot-watch", self.imds[i].url, "--spot-watch-interval-s", str(PREEMPT_WATCH_S)]
            self._spawn(f"graph server {i}", logs / f"graphserver-{i}.log", "graphserver.server", [
                "--store", str(self.store.path), "--part", str(i),
                "--config", str(self.config_file), "--param-server", self.ps_endpoint, "--ready-file", str(ready),
                "--bind", f"ipc://{self.socket_dir}/graphserver-{i}", "--threads", str(threads), *self.services.graph_server_args,
                *keys_args, *watch_args], ready)
        endpoints = [self._wait_ready(f, child) for f, child in zip(ready_files, self.children[1:])]
        self.servers = [self._peer(e, "graphserver") for e in endpoints]
        for child, endpoint in zip(self.children[1:], endpoints):
            self.watchdog.watch(child, endpoint, "graphserver")
        self._connect_graph_servers(endpoints)

    def _spawn(self, name: str, log: Path, module: str, args: list[str], ready_file: Path) -> None:
        """Start ``python -m module *args``: forked from this process's zygote (:mod:`dorylus.zygote`),
        or a plain subprocess with ``DORYLUS_ZYGOTE=0``. Either way the role stops once its
        parent (the zygote, or this process) is gone."""
        ready_file.unlink(missing_ok=True)  # a resumed run's directory holds the previous roles' files
        env = local_process_environment()
        with open(log, "a") as out:  # appended: a resumed run keeps the logs of its earlier attempts
            try:
                if zygote.enabled():
                    launcher = zygote.shared(env)
                    process = launcher.spawn(module, [*args, "--exit-with-parent", str(launcher.pid)], out,
                                             cwd=os.getcwd(), env=env)
                else:
                    process = subprocess.Popen([sys.executable, "-m", module, *args, "--exit-with-parent",
                                                str(os.getpid())], stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=env)
            except zygote.ZygoteError as exc:
                raise ClusterError(f"{name}: {exc}") from None
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

    def close(self) -> None:
        """Stop every role: ask politely, then terminate, then kill. Safe to call twice."""
        self._shutdown_roles()
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
        self._close_sockets()
        self._services.close()
        self.services = None
        if not self.ctx.closed:
            self.ctx.term()
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None
        for imds in self.imds.values():
            imds.close()
        self.imds, self.kills = {}, []

    def epoch_begins(self, epoch: int) -> None:
        """``--preempt``: post the notices of ``epoch`` (once: a recovered run trains it again)
        and schedule each server's kill."""
        for part, at in sorted(self.preempts):
            if at == epoch:
                self.preempts.discard((part, at))
                self.imds[part].interrupt(seconds=PREEMPT_GRACE_S)
                self.kills.append((time.monotonic() + PREEMPT_GRACE_S, part))
                print(f"--preempt {part}@{epoch}: spot interruption notice posted to graph server {part}, which is "
                      f"killed once the run has checkpointed (within {PREEMPT_GRACE_S:g} s)", file=sys.stderr,
                      flush=True)

    def interruption_handled(self, part: int) -> None:
        self.kills = [(0.0 if p == part else due, p) for due, p in self.kills]

    def _preempt_due(self) -> None:
        """Kill (SIGKILL: the instance is gone, nothing runs after) the servers whose grace ran out."""
        now = time.monotonic()
        for due in [k for k in self.kills if k[0] <= now]:
            self.kills.remove(due)
            child = self.children[1 + due[1]]
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait(timeout=5.0)
            child.preempted = True

    def _check_alive(self) -> None:
        if self.kills:
            self._preempt_due()
        for child in self.children:
            if child.process.poll() is not None:
                why = " (preempted: --preempt)" if child.preempted else ""
                if isinstance(child.process, zygote.Role) and child.process.returncode == zygote.STATUS_LOST:
                    why = f" (unknown: the role zygote, pid {child.process.zygote.pid}, that started it is gone)"
                raise RoleDied(f"{child.name} exited with code {child.process.returncode}{why}; "
                               f"its log ({child.log}) ends with:\n{child.tail()}", child.name)

    def restart(self) -> None:
        """Stop every role that is left and start them all again, fresh (a new parameter server
        without state, graph servers without epochs, a new emulator and keys): the training
        loop then restores its last state into them. The watchdog keeps what it learned of
        each step's duration."""
        durations = self.watchdog.durations
        self.close()
        self.ctx = zmq.Context()
        if self.keys_dir is not None:  # close() removed the run's keys: a restarted run makes new ones
            self.keys = self._make_keys()
        self.watchdog = Watchdog(self.ctx, self.config.watchdog_min_s, self.config.watchdog_factor,
                                 self.config.task_timeout_s, keys=self.keys)
        self.watchdog.durations = durations
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def emulator_stats(self) -> dict[str, Any]:
        return self.services.stats() if self.services is not None else {}


class DistributedTrainer:
    """Starts the graph servers' epochs and collects them; ``step(epoch)`` returns epoch
    ``epoch``'s metrics once every graph server reported it.

    The graph servers run their epochs themselves (``train`` command); the coordinator polls
    their ``progress`` every :data:`POLL_S`, which carries ``min_epoch`` (the oldest epoch some
    server has not finished: async mode's gate) one way and the finished epochs' reports the
    other. The parameter server steps by itself once an epoch's gradients are all in.
    """

    POLL_S = 0.005

    def __init__(self, config: TrainConfig, cluster: Cluster):
        self.config = config
        self.cluster = cluster
        meta = cluster.store.meta
        self.spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
        self.counts = {"train": meta.train_count, "val": meta.val_count, "test": meta.test_count}
        cluster.ps_request(Header(Op.COMMAND, meta={"command": "configure", "expected": cluster.intervals}))
        self.started = False
        self.reports: dict[int, list[dict[str, Any]]] = {}  # epoch -> reports, one per graph server so far
        self.finished = [0] * len(cluster.servers)           # last epoch each graph server reported
        self.epoch_end = time.perf_counter()
        self.before = cluster.emulator_stats()
        self.pricing = Pricing.of_run(config, cluster.store.num_parts)
        self.since_epoch = 1  # the parameter server's counts (grad_counts) start here
        # Called once per graph server and notice with (part, the notice's words), from step().
        self.on_interruption = lambda part, notice: None
        self.notices: set[tuple[int, str]] = set()

    @property
    def can_recover(self) -> bool:
        """Whether the cluster can bring its roles back (local mode restarts them; cluster mode
        waits for them at their addresses)."""
        return hasattr(self.cluster, "restart")

    def recover(self, latest) -> None:
        """Restart every role and load ``latest`` (a :class:`~dorylus.runs.Checkpoint` of the last
        finished epoch; None: no epoch finished, the fresh parameter server's seeded weights are
        the start), so that the next ``step`` trains the epoch after it."""
        self.cluster.restart()
        self.cluster.ps_request(Header(Op.COMMAND, meta={"command": "configure", "expected": self.cluster.intervals}))
        self.started = False
        self.reports = {}
        self.finished = [0] * len(self.cluster.servers)
        self.before = self.cluster.emulator_stats()
        self.notices = set()  # new instances
        if latest is not None:
            self.restore(latest.params, latest.optimizer, latest.epoch)
        self.since_epoch = (latest.epoch if latest is not None else 0) + 1

    def _start(self, first: int) -> None:
        self.finished = [first - 1] * len(self.cluster.servers)
        self.cluster.command("train", first=first, last=self.config.epochs, epochs=self.config.epochs,
                             eval_every=self.config.eval_every)
        self.started = True
        self.epoch_end = time.perf_counter()

    def _poll(self) -> None:
        """Take every report the graph servers hold. A server sends its reports oldest first and
        at most a document's worth per reply (``more``: some still wait), so a coordinator that
        was stopped for a while asks again at once until it has caught up."""
        more = True
        while more:
            min_epoch = min(self.finished) + 1
            replies = self.cluster.command_replies("progress", min_epoch=min_epoch)
            more = False
            for part, reply in enumerate(replies):
                reports = reply.doc if reply.doc is not None else []
                if not isinstance(reports, list) or not all(isinstance(r, dict) and isinstance(r.get("epoch"), int)
                                                            for r in reports):
                    raise ClusterError(f"graph server {part} answered progress with a malformed report list "
                                       f"({str(reports)[:80]})")
                for report in reports:
                    self.reports.setdefault(report["epoch"], []).append(report)
                    self.finished[part] = max(self.finished[part], report["epoch"])
                more = more or reply.meta.get("more") is True
                notice = reply.meta.get("interruption")
                if isinstance(notice, str) and (part, notice) not in self.notices:
                    self.notices.add((part, notice))
                    self.on_interruption(part, notice)
                    self.cluster.interruption_handled(part)

    def step(self, epoch: int) -> dict[str, Any]:
        if not self.started:
            self._start(epoch)
        self.cluster.epoch_begins(epoch)
        start = time.monotonic()
        bound, why = self.cluster.watchdog.bound("epoch")
        while len(self.reports.get(epoch, ())) < len(self.cluster.servers):
            self._poll()
            self.cluster.check(f"epoch {epoch}", time.monotonic() - start, bound, why)
            # Every POLL_S: in sync mode the graph servers do not wait for the coordinator, so
            # epoch_s is when this loop sees each epoch; sleeping through part of an epoch (tried:
            # 3/4 of the last one, half the shortest of the last 3) saved polls but made epoch_s
            # come in bunches (0.26, 0.13, 0.002, 0.03 s) once one epoch was seen late.
            time.sleep(self.POLL_S)
        self.cluster.watchdog.record("epoch", time.monotonic() - start)
        reports = self.reports.pop(epoch)
        now = time.perf_counter()
        seconds, self.epoch_end = now - self.epoch_end, now
        metrics: dict[str, Any] = {"epoch": epoch, "loss": float(sum(r["loss"] for r in reports))}
        if reports[0]["evaluated"]:
            metrics.update({f"{k}_acc": sum(r[f"correct_{k}"] for r in reports) / v if v else float("nan")
                            for k, v in self.counts.items()})
        else:
            metrics.update(train_acc=None, val_acc=None, test_acc=None)
        metrics["epoch_s"] = seconds
        after = self.cluster.emulator_stats()
        metrics.update(self._cost(self.before, after, seconds))
        self.before = after
        reads = sum(r["staleness_reads"] for r in reports)
        metrics.update(
            staleness_max=max(r["staleness_max"] for r in reports),
            staleness_mean=sum(r["staleness_sum"] for r in reports) / reads if reads else 0.0,
            weight_lag_max=max(r["weight_lag_max"] for r in reports),
            relaunches=sum(r["relaunches"] for r in reports), failed_calls=sum(r["failed_calls"] for r in reports),
            fallback_calls=sum(r.get("fallback_calls", 0) for r in reports),
            calls=sum(r["invocations"] for r in reports), concurrency=[r["concurrency"] for r in reports])
        # Failed function attempts by kind (graphserver.invoker.FAILURE_KINDS); empty off the lambda backend.
        metrics["failures"] = {k: sum(r.get("failures", {}).get(k, 0) for r in reports)
                               for k in sorted({k for r in reports for k in r.get("failures", {})})}
        metrics["task_s"] = {k: max(r["task_s"].get(k, 0.0) for r in reports)
                             for k in sorted({k for r in reports for k in r["task_s"]})}
        metrics["bytes"] = {k[len("bytes_"):]: sum(r.get(k, 0) for r in reports)
                            for k in ("bytes_functions", "bytes_ghosts", "bytes_params")}
        return metrics

    def grad_counts(self) -> dict[str, int]:
        """Gradient pushes the parameter server applied and dropped (duplicates), run totals."""
        reply, _ = self.cluster.ps_request(Header(Op.STATS))
        counts = {"applied": int(reply.meta["applied"]), "dropped": int(reply.meta["dropped"])}
        if self.since_epoch > 1:  # a recovered run: the counts of the parameter server started then
            counts["since_epoch"] = self.since_epoch
        return counts

    def _cost(self, before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The epoch's function bill (the emulator's counters since the last epoch) and its
        dollars and value (:func:`dorylus.cost.epoch_metrics`)."""
        invocations = int(after.get("invocations", 0) - before.get("invocations", 0))
        billed_gb_s = float(after.get("billed_gb_s", 0.0) - before.get("billed_gb_s", 0.0))
        return {"invocations": invocations, "billed_gb_s": billed_gb_s,
                **epoch_metrics(self.pricing, seconds, billed_gb_s, invocations)}

    def state(self, epoch: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The parameters (``layers.<l>.<name>``) and optimizer state right after epoch
        ``epoch``'s step (see :mod:`dorylus.optim`)."""
        reply, tensors = self.cluster.ps_request(Header(Op.COMMAND, meta={"command": "get_state", "version": epoch}))
        arrays = {name: np.array(t) for name, t in zip(reply.names, tensors)}
        params = {name: arrays.pop(name) for name in self.spec.named_shapes()}
        return params, arrays

    def restore(self, params: dict[str, np.ndarray], optimizer: dict[str, np.ndarray], epoch: int) -> None:
        """Load a checkpoint's state into the parameter server; its version counts epochs (one
        step each), so the restored version is ``epoch``."""
        arrays = {**{name: np.asarray(w, np.float32) for name, w in params.items()}, **optimizer}
        self.cluster.ps_request(Header(Op.COMMAND, names=tuple(arrays), meta={
            "command": "set_state", "version": epoch, "epoch": epoch, "optimizer": self.config.optimizer}),
            list(arrays.values()))
