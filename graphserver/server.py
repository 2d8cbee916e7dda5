"""The graph server process: owns one partition, runs Gather/Scatter and its intervals' epochs.

One asyncio loop serves a ROUTER socket that functions (PULL/PUSH), peer graph servers
(GHOSTS) and the coordinator (COMMAND, STATS, HELLO) talk to. The model's plan says what runs
(:mod:`dorylus.models`), the backend where its tensor work runs (:mod:`graphserver.backends`),
and the scheduler in which order and under which mode (:mod:`graphserver.scheduler`,
:mod:`graphserver.modes`). Commands:

* ``connect`` {peers[, function_name, region, lambda_endpoint]}: dial the other graph servers
  and greet the parameter server (learning the address functions dial it at); in cluster mode
  the coordinator also names the function to invoke, its region and, for the emulator, the
  Invoke endpoint (from the cluster file).
* ``config``: the fields of this server's training config that servers use
  (:func:`dorylus.config.server_view`, in ``meta``), for the coordinator to check against its
  own in cluster mode.
* ``train`` {first, last, epochs, eval_every}: run epochs ``first..last`` in the background.
* ``progress`` {min_epoch}: take the finished epochs' reports, oldest first, as the reply's
  document (a JSON list in its own frame, :mod:`dorylus.protocol` "Documents"); at most
  :data:`protocol.MAX_DOC_BYTES` per reply, ``meta["more"]`` says that more are waiting, so a
  coordinator that fell any number of epochs behind loses none. ``min_epoch`` is the
  coordinator's oldest epoch not finished everywhere (the async gate).

Command fields are checked before anything changes: a missing, null or wrong-typed one is
``bad_command`` naming it. Any exception while handling one message is logged with its
sender, counted (``rejected.<code>`` in STATS; ``internal`` for a failure that is not a
ProtocolError) and answered with ERROR where the sender waits for a reply; the loop goes on.

HELLO's READY says which part this server owns, its store's fingerprint, where functions dial
it (``endpoint``: the ``--advertise`` address, else the bound one), its message limit, and
whether it is ``fresh`` (no coordinator has connected it yet: no earlier run's state).

Transport security (DESIGN §5, :mod:`dorylus.curve`): with keys the ROUTER is a CURVE server
that admits only the coordinator's, the graph servers' and the function's keys, each to its own
operations (a function may PULL and PUSH, a peer send GHOSTS, only the coordinator COMMAND,
STATS or SHUTDOWN); without keys a SHUTDOWN is logged with its sender. In every mode PULL, PUSH
and GHOSTS for an epoch beyond ``current + S + 1`` are refused with ``epoch_ahead`` and
counted (``current``: the oldest epoch this server has not finished), so rows for a future
epoch never wait in the inbox to win over the real ones; frames above the message limit
(twice the largest buffer or weight, :mod:`dorylus.sockets`) are dropped by ZeroMQ.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import sys
import time
import uuid
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import zmq
import zmq.asyncio

import dorylus.peer
from dorylus import atomic, curve, logs, protocol, sockets, spot
from dorylus.config import TrainConfig, load_config_file, server_view
from dorylus.endpoints import advertised_endpoint, check_endpoint
from dorylus.errors import ConfigError
from dorylus.function import FUNCTION_NAME
from dorylus.roleopts import add_server_arguments, server_options, watch_parent
from dorylus.models import get_model
from dorylus.models.spec import ModelSpec
from dorylus.partition import open_store
from dorylus.protocol import Bounds, Header, Op, ProtocolError
from graphserver.invoker import TaskFailed
from graphserver.modes import evaluation_apart, get_mode
from graphserver.scheduler import PASSES, Scheduler

logger = logging.getLogger(__name__)

# A progress request may wait this long for news (meta ``wait_s``): the coordinator asks once per
# epoch instead of polling, and a forged request cannot hold a task for long.
MAX_PROGRESS_WAIT_S = 5.0


class Refused(dorylus.peer.Refused, TaskFailed):
    """A server answered ERROR; ``code`` says why (e.g. ``epoch_ahead``: not yet, try again)."""


class NoReply(dorylus.peer.NoReply, TaskFailed):
    """A server did not answer within the task timeout."""


class AsyncPeer(dorylus.peer.AsyncPeer):
    """A connection to another server (:mod:`dorylus.peer`) whose failures fail the task that
    made the request: this server's training stops with them (``TaskFailed``)."""

    refused, no_reply = Refused, NoReply


class GraphServer:
    GHOSTS_RETRY_S = 0.02  # first wait before a GHOSTS refused as epoch_ahead is sent again

    def __init__(self, store_path: str, part_id: int, config: TrainConfig, *, param_server: str,
                 lambda_endpoint: str | None = None, function_name: str = FUNCTION_NAME, region: str | None = None,
                 keys: curve.Keyring | None = None, advertise: str | None = None):
        store = open_store(store_path, verify=False, parts=[part_id])
        store.verify([part_id])
        self.meta = store.meta
        self.store_fingerprint = store.fingerprint()
        self.keys = keys
        self.advertise = advertise
        self.part_id = part_id
        self.num_parts = store.num_parts
        self.config = config
        self.spec = ModelSpec.from_config(config, self.meta.num_features, self.meta.num_classes)
        self.model = get_model(config.model)
        self.mode = get_mode(config.mode, config.staleness)
        self.plan = self.model.build_plan(self.spec)
        if self.mode.evaluates_beside_training():
            self.plan = evaluation_apart(self.plan)
        self.stages = {(p, s.task, s.layer): s for p, stages in (("train", self.plan.train),
                                                                  ("eval", self.plan.evaluate)) for s in stages}
        self.physics = config.graph_server_physics()
        from graphserver.backends import make_backend, make_state  # torch: kept out so `--help` is fast

        # The backend decides where the partition's rows live (host numpy, or a torch device).
        self.state = make_state(config, store.load_part(part_id), self.plan, parts=self.num_parts)
        self.bounds = Bounds(num_rows=self.state.n_owned, intervals=self.state.intervals,
                             num_layers=len(self.spec.layers))
        # What this server receives at most in one frame: rows of one of its buffers (PUSH,
        # GHOSTS), or a weight matrix (WEIGHTS, cpu backend).
        largest = max([b.nbytes for b in self.state.buffers.values()]
                      + [sockets.largest_weight_bytes(self.spec.named_shapes().values())])
        self.max_message_bytes = sockets.message_limit(largest, config.max_message_mb)
        self.param_server = param_server
        self.param_server_advertised = param_server  # the address functions dial; the server's own word at connect
        self.run_token = uuid.uuid4().hex[:12]
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, config.intervals))
        self.backend = make_backend(config.backend, self, concurrency=config.functions or config.intervals,
                                    options={"lambda_endpoint": lambda_endpoint, "function_name": function_name,
                                             "region": region})
        self.ctx = zmq.asyncio.Context()
        self.router: zmq.asyncio.Socket | None = None
        self.peers: dict[int, AsyncPeer] = {}
        self.ps: AsyncPeer | None = None
        self.ps_wait: AsyncPeer | None = None  # wait_version requests block: not on the pulls' socket
        self.endpoint = ""
        # Ghost rows from peers: (pass, SC | SC_BWD, buffer) -> peer -> (epoch, rows); the newest kept.
        self.inbox: dict[tuple[str, str, str], dict[int, tuple[int, np.ndarray]]] = defaultdict(dict)
        # --stale-correction: (SC | SC_BWD, buffer, peer) -> (newest epoch folded in, running average).
        self.smoothed: dict[tuple[str, str, int], tuple[int, np.ndarray]] = {}
        # Ghost sends not waited for (async, S >= 1): (SC | SC_BWD, pass, buffer) -> task.
        self.sending: dict[tuple[str, str, str], asyncio.Task] = {}
        self.inbox_changed = asyncio.Event()
        self.min_epoch = 0
        self.gate_changed = asyncio.Event()
        self.reports: list[dict[str, Any]] = []
        self.first_epoch = 1  # of the run being trained (``train``); the epoch gate before it starts
        self.scheduler = None
        self.training: asyncio.Task | None = None
        self.failure: str | None = None
        # The last spot/termination notice of this machine (dorylus.spot, --spot-watch), passed to
        # the coordinator in every progress reply so that it checkpoints at once.
        self.interruption: str | None = None
        self.interruption_sent: str | None = None  # the notice the last progress reply carried
        self.progress_news = asyncio.Event()  # set by progress_changed
        self.detached: set[asyncio.Task] = set()  # requests answered beside the receive loop (_detach)
        self.in_flight: dict[str, float] = {}  # function calls running: description -> start (monotonic)
        self.counters: dict[str, float] = defaultdict(float)
        self.rejected = protocol.ProtocolCounters()
        self.stopping = asyncio.Event()
        self.auth = None
        self.advertised = ""

    # ------------------------------------------------------------------ message loop

    def peer(self, endpoint: str, what: str, server_role: str) -> AsyncPeer:
        """A connection to another server, with this server's keys and message limit."""
        return AsyncPeer(self.ctx, endpoint, what, server_role=server_role, keys=self.keys,
                         max_bytes=self.max_message_bytes, physics=self.physics)

    async def serve(self, bind: str, ready_file: str | None = None) -> None:
        if self.keys is not None:
            self.auth = curve.start_authenticator(self.ctx, self.keys, asyncio=True)
        self.router = sockets.server_socket(self.ctx, self.keys, self.max_message_bytes)
        try:
            self.router.bind(bind)
            self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to :0
            self.advertised = advertised_endpoint(self.endpoint, self.advertise)
        except (zmq.ZMQError, ConfigError) as exc:
            self.close()
            why = zmq.strerror(exc.errno).lower() if isinstance(exc, zmq.ZMQError) else str(exc)
            raise ConfigError(f"graph server {self.part_id}: cannot bind {bind}: {why}") from None
        self.ps = self.peer(self.param_server, "parameter server", "paramserver")
        self.ps_wait = self.peer(self.param_server, "parameter server", "paramserver")
        if ready_file:
            atomic.write_text(Path(ready_file), self.endpoint)
        logger.info("listening on %s%s%s", self.endpoint,
                    f", advertised as {self.advertised}" if self.advertised != self.endpoint else "",
                    ", CURVE on" if self.keys is not None else "")
        from graphserver.state import format_memory  # torch: kept out so `--help` is fast

        logger.info("part %d state: %s", self.part_id, format_memory(self.state.memory))
        receiver = asyncio.create_task(self._receive_loop())
        await self.stopping.wait()
        receiver.cancel()
        if self.training is not None:
            self.training.cancel()
        for task in (receiver, self.training):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.backend.close()
        self.close()

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart(copy=False)
            identity = bytes(frames[0].buffer)
            header = None
            try:
                header, tensors = protocol.decode(frames[1:], check_finite=True)
                curve.authorize("graphserver", f"graph server {self.part_id}", self.keys is not None, identity, header,
                                frames[1])
                await self._dispatch(identity, header, tensors)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever one message does, the server keeps serving the others
                await self._refuse(identity, header, exc)

    async def _refuse(self, identity: bytes, header: Header | None, exc: Exception) -> None:
        """Count and log a message that failed, and answer ERROR if its sender waits for a reply."""
        expected = isinstance(exc, (ProtocolError, TaskFailed))
        # A TaskFailed is this server's training failure, answered to the coordinator's progress.
        counted = exc if isinstance(exc, ProtocolError) else ProtocolError(
            "task_failed" if isinstance(exc, TaskFailed) else "internal", str(exc))
        self.rejected.count(counted)
        code_count = self.rejected.as_dict().get(counted.code, 0)
        # The first few of each kind, then every thousandth: a flood of bad messages must not fill the disk.
        if code_count <= 10 or code_count % 1000 == 0:
            what = f"{header.op.value} req {header.req}" if header is not None else "an undecodable message"
            logger.warning("refused %s from peer %s (%d %s so far): %s", what, identity.hex(), code_count,
                           counted.code, exc if expected else f"{type(exc).__name__}: {exc}")
        if header is not None and header.op not in protocol.REQUESTS:
            return
        try:
            await self._reply(identity, protocol.error_reply(header, exc))
        except Exception as reply_exc:  # the peer is gone or the reply unencodable: nothing more to do
            logger.warning("could not answer peer %s: %s: %s", identity.hex(), type(reply_exc).__name__, reply_exc)

    def current_epoch(self) -> int:
        """The oldest epoch this server has not finished: the base of the epoch window."""
        if self.scheduler is not None:
            return self.scheduler.oldest_unfinished
        return max(self.first_epoch, self.min_epoch)

    def check_epoch(self, header: Header) -> None:
        protocol.check_epoch(header, self.current_epoch(), self.mode.staleness)

    async def _reply(self, identity: bytes, header: Header, tensors: Sequence[np.ndarray] = ()) -> None:
        self.counters["bytes_out"] += sum(np.asarray(t).nbytes for t in tensors)
        await self.router.send_multipart([identity, *protocol.encode(header, tensors)], copy=False)

    async def _dispatch(self, identity: bytes, header: Header, tensors: list[np.ndarray]) -> None:
        if header.op is Op.PULL:
            self.bounds.check(header)
            self.check_epoch(header)
            await self._reply(identity, *protocol.rows_reply(header, self._read_rows(header)))
        elif header.op is Op.PUSH:
            self.bounds.check(header)
            self.check_epoch(header)
            self.counters["bytes_in"] += sum(t.nbytes for t in tensors)
            duplicate = self._accept_push(header, tensors)
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta={"duplicate": duplicate}))
        elif header.op is Op.GHOSTS:
            self.check_epoch(header)
            self._accept_ghosts(header, tensors)
            await self._reply(identity, protocol.reply_to(header, Op.ACK))
        elif header.op is Op.COMMAND:
            await self._command(identity, header)
        elif header.op is Op.HELLO:
            await self._reply(identity, protocol.reply_to(header, Op.READY, meta={
                "part": self.part_id, "parts": self.num_parts, "store": self.store_fingerprint,
                "endpoint": self.advertised, "max_message_bytes": self.max_message_bytes,
                "fresh": self.scheduler is None and not self.peers}))
        elif header.op is Op.STATS:
            meta = {**self.counters, **{f"rejected.{k}": v for k, v in self.rejected.as_dict().items()},
                    "in_flight": len(self.in_flight), "buffered_ghosts": sum(map(len, self.inbox.values()))}
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

    def _read_rows(self, header: Header) -> list:
        """The rows of ``header.names``: arrays, or ``SparseRows`` for sparse features (sent as CSR);
        for a name in the PULL's ``meta["sums"]`` (comma-separated: a stage's ``summed`` reads), the
        float32 sum of its rows, ``[1, width]``."""
        start, stop = header.rows
        unknown = [n for n in header.names if n not in self.state.static and n not in self.state.buffers]
        if unknown:
            raise ProtocolError("bad_field", f"unknown tensor name(s) {unknown}", req=header.req)
        sums = protocol.summed_names(header)
        if any(n not in header.names or n not in self.state.buffers for n in sums):
            raise ProtocolError("bad_field", f"PULL sums must name row buffers among its names {list(header.names)}, "
                                f"got {header.meta['sums']!r}", req=header.req)
        return [self.state.host_rows(name, start, stop).sum(0, keepdims=True) if name in sums
                else self.state.host_rows(name, start, stop) for name in header.names]

    def _accept_push(self, header: Header, tensors: list[np.ndarray]) -> bool:
        """A function's result rows; True if it was a duplicate (or for no known stage) and dropped."""
        pass_ = header.meta.get("pass", "train")
        stage = self.stages.get((pass_, header.task, header.layer))
        if stage is None:
            raise ProtocolError("bad_field", f"no stage {header.task} layer {header.layer} in the {pass_!r} pass",
                                req=header.req)
        if tuple(header.names) != stage.writes:
            raise ProtocolError("bad_field", f"{header.task} layer {header.layer} must push {list(stage.writes)}, "
                                f"got {list(header.names)}", req=header.req)
        for name, rows in zip(header.names, tensors):
            buffer = self.state.buffers[name]
            if rows.ndim != 2 or rows.shape[1] != buffer.shape[1] or rows.dtype != np.float32:
                raise ProtocolError("dest_mismatch", f"{name} rows must be float32 [n, {buffer.shape[1]}], got "
                                    f"{rows.dtype}{list(rows.shape)}", req=header.req)
        # The first push for a call in progress resolves it (graphserver.backends: Backend.awaiting);
        # any other push is acknowledged and dropped.
        pending = self.backend.awaiting((pass_, header.task, header.layer, header.epoch, header.interval))
        if pending is None:
            self.counters["duplicate_pushes"] += 1
            return True
        self.write_result((pass_, header.task, header.layer, header.epoch, header.interval), tensors,
                          rows_range=header.rows)
        pending.set_result({k: v for k, v in header.meta.items() if k != "pass"})
        return False

    def write_result(self, key: tuple, rows: Sequence[np.ndarray], *, rows_range=None) -> None:
        """A call's result rows (``key``: graphserver.backends.call_key) into the stage's buffers."""
        pass_, task, layer, _, interval = key
        stage = self.stages[(pass_, task, layer)]
        a, b = self.state.intervals[interval] if rows_range is None else rows_range
        for name, values in zip(stage.writes, rows):
            self.state.buffers[name][a:b] = values

    # ------------------------------------------------------------------ the scheduler's graph work

    async def vertex(self, stage, pass_: str, epoch: int, interval: int) -> None:
        await self._stage_in_thread(stage, pass_, epoch, interval, self.state.vertex, self.model, stage, interval,
                                    self.stage_args(stage, pass_, epoch))

    async def gather(self, stage, pass_: str, epoch: int, interval: int) -> None:
        await self._stage_in_thread(stage, pass_, epoch, interval, self.state.gather, self.model, stage, interval,
                                    self.stage_args(stage, pass_, epoch))

    async def _stage_in_thread(self, stage, pass_: str, epoch: int, interval: int, fn, *args):
        """``fn(*args)`` in a thread, then --compute-jitter's extra time for it, on the loop."""
        if not self.physics.compute_jitter:
            return await self.run_in_thread(fn, *args)

        def timed():
            start = time.perf_counter()
            return fn(*args), time.perf_counter() - start

        result, seconds = await self.run_in_thread(timed)
        factor = self.physics.slowdown(self.config.seed, self.part_id, PASSES.index(pass_), epoch,
                                       zlib.crc32(stage.task.encode()), stage.layer, interval)
        self.counters["jitter_s"] += seconds * (factor - 1)
        await asyncio.sleep(seconds * (factor - 1))
        return result

    async def scatter(self, stage, pass_: str, epoch: int, oldest: int) -> list[int]:
        """SC: peers get our rows of the Gather's inputs that they hold as ghosts; theirs, of
        epoch ``oldest`` or later, fill ours (while ours are on the way). Returns the ages
        (epochs) of the rows used."""
        state, ages = self.state, []
        outgoing = [(name, await state.rows_for_peers(name, self.peers)) for name in stage.reads]
        sent = self._send_all("SC", pass_, epoch, stage.layer, outgoing, wait=oldest >= epoch)
        try:
            for name in stage.reads:
                received = await self._receive("SC", pass_, epoch, stage.layer, name, oldest, ages)
                for j, rows in received.items():
                    state.set_ghost_rows(name, j, rows)
        except BaseException:
            sent.cancel()  # the exchange failed or training stops: waiting for acknowledgements is pointless
            raise
        await sent
        return ages

    async def gather_backward(self, stage, pass_: str, epoch: int, oldest: int) -> list[int]:
        """GATHER_BACKWARD for every local row, then SC_BWD: ghost rows' contributions go to their
        owners, and the peers' contributions (epoch ``oldest`` or later) are summed into ours in
        peer order. Returns the ages (epochs) of the contributions used."""
        state, ages = self.state, []
        local = await self._stage_in_thread(stage, pass_, epoch, len(state.intervals), state.gather_backward,
                                            self.model, stage, self.stage_args(stage, pass_, epoch))
        outgoing = [(name, await state.contributions_for_peers(contribution, self.peers))
                    for name, contribution in zip(stage.writes, local)]
        sent = self._send_all("SC_BWD", pass_, epoch, stage.layer, outgoing, wait=oldest >= epoch)
        try:
            for name, contribution in zip(stage.writes, local):
                state.set_owned_rows(name, contribution)
                received = await self._receive("SC_BWD", pass_, epoch, stage.layer, name, oldest, ages)
                for j in sorted(received):  # fixed order: the sum does not depend on arrival order
                    state.add_peer_contribution(name, j, received[j])
        except BaseException:
            sent.cancel()
            raise
        await sent
        return ages

    def _send_all(self, task: str, pass_: str, epoch: int, layer: int,
                  outgoing: list[tuple[str, dict[int, np.ndarray]]], *, wait: bool) -> asyncio.Future:
        """Start sending ``outgoing`` ((buffer, rows by peer) pairs); the returned future is what
        the caller awaits. ``wait``: it is the sends themselves (the peers need this epoch's rows).
        Otherwise (older rows will do) they go on in the background and the future is done at
        once: one send per buffer in flight, a failure raised by the next exchange or at the end."""
        self.raise_failed_sends()
        sends = {}
        for name, rows_by_peer in outgoing:
            key = (task, pass_, name)
            previous = self.sending.pop(key, None)
            sends[key] = asyncio.ensure_future(self._send_after(previous, task, pass_, epoch, layer, name,
                                                                rows_by_peer))
        if wait:
            return asyncio.ensure_future(asyncio.gather(*sends.values()))
        self.sending.update(sends)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def _send_after(self, previous: asyncio.Task | None, *args) -> None:
        if previous is not None:  # rows of one buffer reach a peer in epoch order, one send at a time
            await previous
        await self.send_ghosts(*args)

    def raise_failed_sends(self) -> None:
        """Raise the failure of a background ghost send that failed, forgetting the finished ones."""
        for key, task in list(self.sending.items()):
            if task.done():
                del self.sending[key]
                task.result()

    async def finish_sends(self) -> None:
        """Wait for every background ghost send (the end of training); raises a failed one's error."""
        while self.sending:
            key, task = next(iter(self.sending.items()))
            try:
                await task
            finally:
                self.sending.pop(key, None)

    async def _receive(self, task: str, pass_: str, epoch: int, layer: int, name: str, oldest: int,
                       ages: list[int]) -> dict[int, np.ndarray]:
        """Every peer's newest rows of ``name``, waiting until each is of epoch ``oldest`` or later."""
        timeout = self.config.task_timeout_s
        deadline = time.monotonic() + timeout
        inbox = self.inbox[(pass_, task, name)]
        while True:
            missing = [j for j in self.peers if j not in inbox or inbox[j][0] < oldest or inbox[j][1] is None]
            if not missing:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TaskFailed(f"graph server {self.part_id}: {task} of {name} ({pass_} epoch {epoch} layer "
                                 f"{layer}): no rows of epoch >= {oldest} from graph server(s) {missing} within "
                                 f"{timeout:.0f} s")
            self.inbox_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.inbox_changed.wait(), remaining)
        received = {}
        for j in self.peers:
            tag, rows = inbox[j]
            ages.append(max(0, epoch - tag))
            received[j] = self._smooth(task, name, j, tag, rows, stale=tag < epoch) if self._corrects(pass_) else rows
            if tag < self.mode.oldest_ghosts(epoch + 1, pass_):
                # No later exchange can take these rows (the next needs newer ones: always with
                # S = 0 and in evaluation): let them go now instead of holding a ghost-sized copy
                # per buffer, pass and direction until the next epoch's (7 x 64 MiB per
                # ogbn-products graph server). The tag stays: a late duplicate is still
                # recognised as one.
                inbox[j] = (tag, None)
        return received

    def _corrects(self, pass_: str) -> bool:
        # The training pass only: evaluation wants the newest rows, not a smoothed estimate.
        return self.config.stale_correction and pass_ == "train"

    def _smooth(self, task: str, name: str, peer: int, tag: int, rows: np.ndarray, *, stale: bool) -> np.ndarray:
        """--stale-correction: for ``stale`` rows (of an epoch before the reader's), the running
        average g = gamma g + (1 - gamma) rows over the versions (epochs) of ``peer``'s rows of
        ``name`` received so far, each folded in once; it starts at the first version received
        (not at zero, which would bias it for ~1 / (1 - gamma) epochs). Rows of the reader's own
        epoch are folded in and used as received: they need no correction, and the average
        would only lag them (and blur their dropout masks)."""
        key = (task, name, peer)
        held = self.smoothed.get(key)
        if held is None:
            self.smoothed[key] = (tag, rows.copy())
        elif tag > held[0]:
            gamma = np.float32(self.config.stale_gamma)
            self.smoothed[key] = (tag, gamma * held[1] + (np.float32(1) - gamma) * rows)
            self.counters["stale_corrections"] += 1
        return self.smoothed[key][1] if stale else rows

    def stage_args(self, stage, pass_: str, epoch: int) -> dict[str, Any]:
        return {**dict(stage.args), "seed": self.config.seed, "epoch": epoch, "training": pass_ == "train",
                "train_count": self.meta.train_count}

    def event(self, stage, pass_: str, epoch: int, interval: int) -> dict[str, Any]:
        """The invoke payload of ``stage`` on ``interval`` (see :mod:`lambdas.handler`)."""
        start, stop = self.state.intervals[interval]
        return {
            "model": self.config.model, "task": stage.task, "layer": stage.layer, "reads": list(stage.reads),
            "writes": list(stage.writes), "summed": list(stage.summed), "weights": stage.weights,
            "grad": stage.grad and pass_ == "train",
            "args": self.stage_args(stage, pass_, epoch),
            "graph_server": self.advertised, "param_server": self.param_server_advertised, "part": self.part_id,
            "interval": interval, "rows": [start, stop], "epoch": epoch, "pass": pass_, "attempt": 0,
            "run": self.run_token, "static_rows_per_pull": self.state.static_rows_per_pull,
        }

    def _accept_ghosts(self, header: Header, tensors: list[np.ndarray]) -> None:
        pass_ = header.meta.get("pass", "train")
        if pass_ not in PASSES:
            raise ProtocolError("bad_field", f"GHOSTS pass {pass_!r} is not one of {', '.join(PASSES)}",
                                req=header.req)
        peer = header.part
        if peer is None or not 0 <= peer < self.num_parts or peer == self.part_id:
            raise ProtocolError("out_of_range", f"GHOSTS from invalid part {peer}", req=header.req)
        if len(header.names) != 1 or header.names[0] not in self.state.buffers:
            raise ProtocolError("bad_field", f"GHOSTS must name one buffer, got {list(header.names)}", req=header.req)
        name = header.names[0]
        part = self.state.part
        expected = (len(range(*part.ghost_rows(peer).indices(part.n_local))) if header.task == "SC"
                    else len(part.send_rows(peer)))
        if header.rows != (0, expected):
            raise ProtocolError("row_count", f"GHOSTS {header.task} from part {peer} must carry rows [0, {expected})",
                                req=header.req)
        rows = tensors[0]
        width = self.state.buffers[name].shape[1]
        if rows.ndim != 2 or rows.shape[1] != width or rows.dtype != np.float32:
            raise ProtocolError("dest_mismatch", f"GHOSTS rows must be float32 [n, {width}], got "
                                f"{rows.dtype}{list(rows.shape)}", req=header.req)
        slot = self.inbox[(pass_, header.task, name)]
        if peer in slot and slot[peer][0] >= header.epoch:
            self.counters["duplicate_ghosts"] += 1
            return
        slot[peer] = (header.epoch, rows)  # a read-only view of the frame: read, never written
        self.inbox_changed.set()

    async def send_ghosts(self, task: str, pass_: str, epoch: int, layer: int, name: str,
                          rows_by_peer: dict[int, np.ndarray]) -> None:
        timeout = self.config.task_timeout_s

        async def send(j: int, rows: np.ndarray) -> None:
            rows = np.ascontiguousarray(rows)
            self.counters["ghost_bytes_out"] += rows.nbytes
            header = Header(Op.GHOSTS, task=task, epoch=epoch, layer=layer, part=self.part_id,
                            rows=(0, rows.shape[0]), names=(name,), meta={"pass": pass_})
            deadline, wait = time.monotonic() + timeout, self.GHOSTS_RETRY_S
            while True:
                try:
                    await self.peers[j].request(header, [rows], timeout=timeout)
                    return
                except Refused as exc:
                    # A peer refuses an epoch it cannot be at yet: at the start of a run our rows
                    # may reach it before its own ``train`` command does. Only then, and only
                    # until the task timeout, is sending again right.
                    if exc.code != "epoch_ahead" or time.monotonic() + wait > deadline:
                        raise
                    self.counters["ghosts_resent"] += 1
                    await asyncio.sleep(wait)
                    wait = min(1.0, 2 * wait)

        await asyncio.gather(*(send(j, rows) for j, rows in rows_by_peer.items()))

    async def wait_version(self, version: int) -> int:
        """Block until the parameter server has weight version ``version``; returns its newest."""
        if version < 0:
            return version
        reply, _ = await self.ps_wait.request(Header(Op.COMMAND, meta={"command": "wait_version",
                                                                        "version": version}),
                                              timeout=self.config.task_timeout_s)
        return int(reply.meta["version"])

    async def run_in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def take_traffic(self) -> dict[str, int]:
        """Tensor bytes moved since the last report, by kind of peer."""
        traffic = {"bytes_functions": int(self.counters.pop("bytes_in", 0) + self.counters.pop("bytes_out", 0)),
                   "bytes_ghosts": int(self.counters.pop("ghost_bytes_out", 0))}
        if self.ps is not None:
            traffic["bytes_params"] = int(self.ps.bytes_out)
            self.ps.bytes_out = 0
        return traffic

    # ------------------------------------------------------------------ commands

    async def _command(self, identity: bytes, header: Header) -> None:
        m = header.meta
        command = m.get("command")
        if command == "connect":
            peers = command_field(header, "peers", str)
            self._detach(self._connect(identity, header, peers.split(",")))
            return
        if command == "config":
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta=server_view(self.config.to_dict())))
        elif command == "train":
            first = command_field(header, "first", int, minimum=1)
            last = command_field(header, "last", int, minimum=first)
            epochs = command_field(header, "epochs", int, minimum=last)
            eval_every = command_field(header, "eval_every", int, minimum=1)
            if self.training is not None and not self.training.done():
                raise ProtocolError("bad_command", "already training", req=header.req)
            self.first_epoch = first
            self.scheduler = Scheduler(self, first=first, last=last, epochs=epochs, eval_every=eval_every)
            self.failure = None
            self.training = asyncio.create_task(self._train())
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta={"intervals": len(self.state.intervals)}))
        elif command == "progress":
            min_epoch = command_field(header, "min_epoch", int, minimum=0, default=0)
            wait_s = min(float(command_field(header, "wait_s", (int, float), minimum=0, default=0)), MAX_PROGRESS_WAIT_S)
            if min_epoch > self.min_epoch:
                self.min_epoch = min_epoch
                self.gate_changed.set()
            if wait_s > 0 and not self._progress_ready():
                # Answered when there is news, from a task of its own: the loop serves the others meanwhile.
                self._detach(self._progress_later(identity, header, wait_s))
            else:
                await self._progress_reply(identity, header)
        else:
            raise ProtocolError("bad_command", f"unknown command {command!r:.40}", req=header.req)

    def _detach(self, coroutine) -> None:
        """Run a request's handler beside the receive loop, held until it ends (the event loop
        keeps only a weak reference to a task: one nobody holds may vanish mid-request)."""
        task = asyncio.create_task(coroutine)
        self.detached.add(task)
        task.add_done_callback(self.detached.discard)

    def _progress_ready(self) -> bool:
        """Whether a progress reply would carry news: reports, a failure, the end of training or
        an interruption notice not yet passed on."""
        return bool(self.reports or self.failure is not None or (self.training is not None and self.training.done())
                    or self.interruption != self.interruption_sent)

    def add_report(self, report: dict[str, Any]) -> None:
        """Queue a finished epoch's report for the coordinator's progress requests."""
        self.reports.append(report)
        self.progress_changed()

    def progress_changed(self) -> None:
        """Wake the progress requests waiting for news (a report, a failure, a notice)."""
        self.progress_news.set()

    async def _progress_later(self, identity: bytes, header: Header, wait_s: float) -> None:
        try:
            deadline = asyncio.get_running_loop().time() + wait_s
            while not self._progress_ready() and (left := deadline - asyncio.get_running_loop().time()) > 0:
                self.progress_news.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.progress_news.wait(), left)
            await self._progress_reply(identity, header)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._refuse(identity, header, exc)

    async def _progress_reply(self, identity: bytes, header: Header) -> None:
        if self.failure is not None:
            raise TaskFailed(self.failure)
        # Oldest first and bounded per reply: what does not fit waits for the next progress.
        count = protocol.take_fitting(self.reports)
        reports, self.reports = self.reports[:count], self.reports[count:]
        done = self.training is not None and self.training.done()
        self.interruption_sent = self.interruption
        await self._reply(identity, protocol.reply_to(header, Op.ACK, meta={
            "done": done, "more": bool(self.reports), "interruption": self.interruption}, doc=reports))

    def notice_interruption(self, notice: str) -> None:
        """This machine's spot/termination notice (:mod:`dorylus.spot`): passed to the coordinator
        in every progress reply from now on, and at once to a progress request waiting."""
        self.interruption = notice
        self.progress_changed()

    async def _connect(self, identity: bytes, header: Header, endpoints: list[str]) -> None:
        try:
            if len(endpoints) != self.num_parts:
                raise ValueError(f"connect needs {self.num_parts} endpoints, got {len(endpoints)}")
            for j, endpoint in enumerate(endpoints):
                if j != self.part_id and j not in self.peers:
                    check_endpoint(f"connect: graph server {j}", endpoint)
                    self.peers[j] = self.peer(endpoint, f"graph server {j}", "graphserver")
            target = {k: header.meta[k] for k in ("function_name", "region", "lambda_endpoint") if k in header.meta}
            if target:
                self.backend.retarget(**target)
            # The parameter server says where functions dial it (its --advertise address); this
            # also proves, before any epoch, that it answers this server (keys included).
            ready, _ = await self.ps.request(Header(Op.HELLO, role="graphserver"),
                                             timeout=min(30.0, self.config.task_timeout_s))
            self.param_server_advertised = str(ready.meta.get("endpoint") or self.param_server)
            await self._reply(identity, protocol.reply_to(header, Op.ACK, meta={
                "ghosts": int(self.state.part.n_ghost), "intervals": len(self.state.intervals),
                "param_server": self.param_server_advertised}))
        except Exception as exc:
            await self._reply(identity, protocol.error_reply(header, exc))

    async def _train(self) -> None:
        try:
            await self.scheduler.run()
            await self.finish_sends()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the coordinator at its next poll; it stops the run
            message = str(exc) if isinstance(exc, TaskFailed) else \
                f"graph server {self.part_id}: {type(exc).__name__}: {exc}"
            self.failure = message[: protocol.MAX_MESSAGE_CHARS]
            logger.error("training failed: %s", message)
        finally:
            for task in self.sending.values():  # a failed or stopped run sends nothing more
                task.cancel()
            self.sending.clear()
            self.progress_changed()  # done (or failed): a waiting progress request answers now

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        for peer in (self.ps, self.ps_wait):
            if peer is not None:
                peer.close()
        if self.router is not None:
            self.router.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.ctx.term()


_MISSING = object()


def command_field(header: Header, name: str, kind: type | tuple[type, ...], *, minimum: int | None = None, default: Any = _MISSING) -> Any:
    """``header.meta[name]`` of a COMMAND, checked: present (or ``default`` when absent; null is
    never accepted), of ``kind`` (an int is not a bool), at least ``minimum``; else ``bad_command``
    naming the command and the field."""
    command = header.meta.get("command")
    value = header.meta.get(name, default)
    if value is _MISSING:
        raise ProtocolError("bad_command", f"command {command!r} needs meta[{name!r}]", req=header.req)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (int in kinds and isinstance(value, bool)):
        raise ProtocolError("bad_command", f"command {command!r}: meta[{name!r}] must be "
                            f"{' or '.join(k.__name__ for k in kinds)}, got {value!r:.40}", req=header.req)
    if minimum is not None and value < minimum:
        raise ProtocolError("bad_command", f"command {command!r}: meta[{name!r}] must be >= {minimum}, got {value}",
                            req=header.req)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="partition store directory, or s3://BUCKET/PREFIX")
    parser.add_argument("--part", type=int, required=True, help="partition id this server owns")
    parser.add_argument("--config", required=True, help="the training config (.json or .toml; config.json of a "
                                                        "run directory); in cluster mode the coordinator's must agree")
    parser.add_argument("--param-server", required=True, help="parameter server endpoint, tcp://HOST:PORT")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ROUTER endpoint to bind (port 0: any free port)")
    parser.add_argument("--ready-file", help="write the bound endpoint into this file once listening")
    parser.add_argument("--lambda-endpoint", help="Lambda Invoke API endpoint URL (the emulator's, or omit for AWS); "
                                                  "in cluster mode the cluster file's, sent by the coordinator")
    parser.add_argument("--function-name", default=FUNCTION_NAME, help="name of the deployed function (default: "
                                                                       f"{FUNCTION_NAME}; in cluster mode the cluster "
                                                                       "file's)")
    parser.add_argument("--region", help="AWS region of the function (default: AWS_REGION / AWS_DEFAULT_REGION; in "
                                         "cluster mode the cluster file's)")
    add_server_arguments(parser, "graphserver")
    spot.add_argument(parser)
    logs.add_argument(parser)
    parser.add_argument("--threads", type=int, help="threads for Gather (default: torch's, all cores); local mode "
                                                    "gives each of P servers its share so they do not oversubscribe")


def run_from_args(args: argparse.Namespace) -> int:
    logs.setup(f"graphserver-{args.part}", args.log_level)
    check_endpoint("--bind", args.bind)
    check_endpoint("--param-server", args.param_server)
    if args.ready_file and not Path(args.ready_file).parent.is_dir():
        raise ConfigError(f"--ready-file {args.ready_file}: directory {Path(args.ready_file).parent} does not exist")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads} must be >= 1")
    config = TrainConfig.from_dict(load_config_file(args.config), where=args.config)
    keys, advertise = server_options(args, "graphserver")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    async def main() -> None:
        server = GraphServer(args.store, args.part, config, param_server=args.param_server,
                             lambda_endpoint=args.lambda_endpoint, function_name=args.function_name,
                             region=args.region, keys=keys, advertise=advertise)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stopping.set)
        watch = watch_parent(args, lambda: loop.call_soon_threadsafe(server.stopping.set))
        watcher = spot.start_from_args(args, lambda notice: loop.call_soon_threadsafe(
            server.notice_interruption, notice.describe()), f"graph server {args.part}")
        try:
            await server.serve(args.bind, args.ready_file)
        finally:
            if watch is not None:
                watch.set()
            if watcher is not None:
                watcher.stop()

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m graphserver.server ...``: the same parser and one-line errors as ``dorylus graphserver``."""
    from dorylus.commandline import role_main

    return role_main("graphserver", add_arguments, run_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
