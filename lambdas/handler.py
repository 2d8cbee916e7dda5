"""The Dorylus tensor function, as AWS Lambda calls it: ``handler(event, context)``.

numpy + pyzmq only. The invoke payload carries metadata alone; the function dials out to its
graph server and to the parameter server (it never listens), pulls its interval's rows and the
weights, runs the model's ``compute`` (:mod:`dorylus.models`), pushes the results, and returns
a small summary: the call's ``task``, ``interval``, ``epoch`` and ``layer``, and under ``result``
its meta (the weights' version and lag, the stage's own such as the loss), which is the call's
result where the stage writes no rows. It knows no model: the event names what to pull and push.

Event keys: ``model``; the stage: ``task``, ``layer``, ``reads`` and ``writes`` (buffer
names), ``weights`` (``pin`` | ``stash`` | ``newest`` | null: pull the layer's named
parameters), ``grad`` (push the gradient of each of them),
``args`` (the model's, plus seed, epoch, training, train_count); where: ``graph_server`` and
``param_server`` (ZeroMQ endpoints), ``part``, ``interval``, ``rows`` ([start, stop) of the
graph server's owned rows); when: ``epoch``, ``pass`` (``train`` | ``eval``), ``attempt``; and
``run``, a token of the graph server's run.

A warm container keeps the rows of static inputs (:data:`dorylus.models.base.STATIC`:
features, ids, labels, splits) per (run, part, interval) and pulls them once, the least recently
used evicted past a quarter of its memory. Sparse features
arrive as CSR (:func:`dorylus.protocol.named_rows`) and are kept as
:class:`~dorylus.models.sparse.SparseRows`, whose cached orders then serve every later call.
With the emulator's bandwidth cap (``context.bandwidth_bytes_per_s``), a call's transfers share the
cap: together they take at least their bytes / bandwidth.

Transport security: when the ``DORYLUS_CURVE_*`` environment variables are set (Terraform puts
the function's key pair and the servers' public keys there, :mod:`dorylus.curve`), every
connection is a CURVE client that only talks to servers holding those keys. Replies larger
than half the function's memory are dropped by ZeroMQ (``ZMQ_MAXMSGSIZE``): no legitimate one
fits a function that big, and without the limit one frame could exhaust it.

Logs go through :mod:`logging`, as Lambda's Python runtime expects: its handler on the root logger
writes them to stdout, which CloudWatch keeps (the emulator's worker plays the runtime). This
module's logger says INFO itself, since Lambda leaves the root at WARNING.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from dorylus import curve, protocol
from dorylus.models import get_model
from dorylus.models.base import STATIC
from dorylus.models.sparse import SparseRows
from dorylus.peer import NoReply, Peer, Pending, Refused
from dorylus.protocol import CsrRows, Header, Op

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)
logging.getLogger("dorylus.peer").setLevel(logging.INFO)  # its "dropped a late reply" records too

# Never wait on a server longer than this, nor past the function's own deadline.
MAX_WAIT_S = 120.0
_DEADLINE_MARGIN_MS = 500
# (run, part, interval, name) -> rows, least recently used first, for as long as the container
# is warm; at most a quarter of the function's memory (:func:`_cache_put`). ``run`` is the graph
# server's token, new with every graph server process, so rows of another server, store or
# partitioning never match: static rows of one graph server never change while it lives.
_static_rows: dict[tuple[str, int, int, str], np.ndarray | SparseRows] = {}
# endpoint -> connection, kept by a warm container: a call does not pay for TCP and ZMTP handshakes
_peers: dict[str, "_Peer"] = {}
_SERVER_ROLES = {"graph server": "graphserver", "parameter server": "paramserver"}
DEFAULT_MAX_BYTES = 512 << 20  # without a Lambda context (tests, tools)


class FunctionTaskError(RuntimeError):
    """A server answered with ERROR or did not answer; names the task, interval and epoch."""


class StashReleased(FunctionTaskError):
    """The parameter server holds no stashed weights for the call: a relaunch would be refused
    the same way. Its graph server decides (``graphserver.invoker``: no more attempts): usually
    an earlier attempt's gradient completed the epoch, whose step released the stash."""


class _Link:
    """A call's share of the network under the emulator's bandwidth cap: its transfers, in the
    order they are sent, each hold the link for bytes / bandwidth."""

    def __init__(self, bandwidth_bytes_per_s: float | None):
        self.bandwidth = bandwidth_bytes_per_s
        self.free_at = 0.0

    def hold(self, started: float, nbytes: int) -> None:
        if self.bandwidth:
            self.free_at = max(self.free_at, started) + nbytes / self.bandwidth
            time.sleep(max(0.0, self.free_at - time.monotonic()))


class _Pending:
    """A request sent and not yet answered: :meth:`reply` waits for its answer within the
    call's deadline, then holds the call's link for the bytes both ways."""

    def __init__(self, peer: "_Peer", pending: Pending):
        self.peer, self.pending = peer, pending

    def reply(self) -> tuple[Header, list[np.ndarray]]:
        header = self.pending.header
        try:
            reply, arrays = self.pending.reply(self.peer._timeout())
        except Refused as exc:
            stash = header.op is Op.PULL_WEIGHTS and header.meta.get("weights") == "stash"
            raise (StashReleased if stash and exc.code == "out_of_range" else FunctionTaskError)(str(exc)) from None
        except NoReply as exc:
            raise FunctionTaskError(str(exc)) from None
        self.peer.link.hold(self.pending.sent_at, self.pending.nbytes_out + sum(a.nbytes for a in arrays))
        return reply, arrays


class _Peer(Peer):
    """A connection of a warm container (:class:`dorylus.peer.Peer`), whose waits end by the
    call's deadline (``context``) and whose transfers share the call's link. A call sends to
    its two peers before it waits for either, so the two round trips overlap."""

    def __init__(self, ctx: zmq.Context, endpoint: str, what: str, context: Any,
                 keys: curve.Keyring | None = None):
        super().__init__(ctx, endpoint, what, server_role=_SERVER_ROLES[what], keys=keys,
                         max_bytes=_max_bytes(context))
        self.context = context
        self.link = _Link(None)

    def send(self, header: Header, tensors: Sequence[np.ndarray] = ()) -> _Pending:
        return _Pending(self, super().send(header, tensors))

    def request(self, header: Header, tensors: Sequence[np.ndarray] = ()) -> tuple[Header, list[np.ndarray]]:
        return self.send(header, tensors).reply()

    def _timeout(self) -> float:
        remaining = getattr(self.context, "get_remaining_time_in_millis", None)
        if remaining is None:
            return MAX_WAIT_S
        return max(0.1, min(MAX_WAIT_S, (remaining() - _DEADLINE_MARGIN_MS) / 1000))


def task_header(op: Op, event: dict[str, Any], rows: tuple[int, int] | None = None, **fields: Any) -> Header:
    """The header identifying ``event``'s task in PULL and PUSH messages (of its interval's
    rows, or of ``rows`` inside them)."""
    start, stop = rows or (int(x) for x in event["rows"])
    meta = {"pass": event.get("pass", "train"), **fields.pop("meta", {})}
    return Header(op, task=event["task"], epoch=int(event["epoch"]), layer=int(event["layer"]),
                  interval=int(event["interval"]), part=int(event["part"]), rows=(start, stop),
                  attempt=int(event.get("attempt", 0)), meta=meta, **fields)


def _pull_rows(event: dict[str, Any], graph: _Peer) -> Callable[[], list[np.ndarray]]:
    """Send the pull of the rows not cached; the returned function waits for them and returns
    the rows of ``event["reads"]`` in order."""
    reads = list(event["reads"])
    run, part, interval = str(event.get("run", "")), int(event["part"]), int(event["interval"])
    start, stop = (int(x) for x in event["rows"])
    cached = {n: _cache_get((run, part, interval, n), stop - start) for n in reads if n in STATIC}
    missing = [n for n in reads if cached.get(n) is None]
    block = int(event.get("static_rows_per_pull") or 0)
    in_blocks = [n for n in missing if n in STATIC] if 0 < block < stop - start else []
    whole = [n for n in missing if n not in in_blocks]
    sums = ",".join(n for n in event.get("summed", ()) if n in whole)  # one row each, not the interval's
    pending = (graph.send(task_header(Op.PULL, event, names=tuple(whole), meta={"sums": sums} if sums else {}))
               if whole else None)
    first = (graph.send(task_header(Op.PULL, event, (start, start + block), names=tuple(in_blocks)))
             if in_blocks else None)

    def keep(name: str, rows) -> None:
        if name in STATIC:
            _cache_put((run, part, interval, name), rows, _max_bytes(graph.context) // 2)
        cached[name] = rows

    def rows() -> list[np.ndarray]:
        if pending is not None:
            reply, arrays = pending.reply()
            for name, rows in zip(whole, protocol.named_rows(reply, arrays)):
                if isinstance(rows, CsrRows):
                    rows = SparseRows(rows.data, rows.indices, rows.indptr, (len(rows.indptr) - 1, rows.width))
                keep(name, rows)
        if first is not None:
            for name, rows in zip(in_blocks, _pull_in_blocks(event, graph, in_blocks, first, block)):
                keep(name, rows)
        return [cached[n] for n in reads]

    return rows


def _pull_in_blocks(event: dict[str, Any], graph: _Peer, names: list[str], first: _Pending,
                    block: int) -> list[np.ndarray]:
    """The interval's dense static rows of ``names``, ``block`` rows per pull (the graph server
    says how many fit :data:`graphserver.state.STATIC_PULL_BYTES`), ``first`` the first pull:
    the server reads each block from its store for the pull and holds no more than one."""
    start, stop = (int(x) for x in event["rows"])
    out: list[np.ndarray] = []
    for lo in range(start, stop, block):
        hi = min(lo + block, stop)
        pull = first if lo == start else graph.send(task_header(Op.PULL, event, (lo, hi), names=tuple(names)))
        reply, arrays = pull.reply()
        blocks = protocol.named_rows(reply, arrays)
        for name, rows in zip(names, blocks):
            if isinstance(rows, CsrRows) or rows.shape[0] != hi - lo:
                raise FunctionTaskError(f"{event['task']} interval {event['interval']}: the graph server sent "
                                        f"{name} rows [{lo}, {hi}) as {type(rows).__name__} "
                                        f"{getattr(rows, 'shape', '')}, not {hi - lo} dense rows")
        if lo == start:
            out = [np.empty((stop - start, *rows.shape[1:]), rows.dtype) for rows in blocks]
        for whole, rows in zip(out, blocks):
            whole[lo - start:hi - start] = rows
    return out


def _rows_nbytes(rows: np.ndarray | SparseRows) -> int:
    if isinstance(rows, SparseRows):
        return int(rows.data.nbytes + rows.indices.nbytes + rows.indptr.nbytes)
    return int(rows.nbytes)


def _cache_get(key: tuple[str, int, int, str], num_rows: int) -> np.ndarray | SparseRows | None:
    """The cached static rows of ``key`` (marked most recently used), or None. Rows of another
    length than the call's interval are not used (an interval's bounds never change under one
    run token; the check costs nothing)."""
    rows = _static_rows.pop(key, None)
    if rows is None or rows.shape[0] != num_rows:
        return None
    _static_rows[key] = rows  # re-inserted: the dict's order is the recency order
    return rows


def _cache_put(key: tuple[str, int, int, str], rows: np.ndarray | SparseRows, limit: int) -> None:
    """Keep ``rows``, evicting the least recently used rows past ``limit`` bytes. The rows of
    every graph server that calls this container stay: the emulator and Lambda place calls of
    all of a run's graph servers on the same warm sandboxes, and clearing the cache on another
    run token (as before) made every call of a 2-part run pull its interval's X again."""
    _static_rows.pop(key, None)
    size = _rows_nbytes(rows)
    if size > limit:
        return
    total = sum(_rows_nbytes(r) for r in _static_rows.values())
    while _static_rows and total + size > limit:
        total -= _rows_nbytes(_static_rows.pop(next(iter(_static_rows))))
    _static_rows[key] = rows


def run_task(event: dict[str, Any], graph: _Peer, params: _Peer) -> dict[str, Any]:
    """Pull (rows and weights at once), compute, push (gradient and rows at once). Pushing the
    rows does not wait for the gradient's acknowledgement: the call succeeds only once both are
    acknowledged, and a call that fails after either was accepted is relaunched, whose repeated
    push the server that has it acknowledges and drops, so each is still applied exactly once."""
    model = get_model(event["model"])
    layer, epoch, interval, part = (int(event[k]) for k in ("layer", "epoch", "interval", "part"))
    rows = _pull_rows(event, graph)
    weights = params.send(Header(Op.PULL_WEIGHTS, layer=layer, epoch=epoch, interval=interval, part=part,
                                 meta={"weights": event["weights"]})) if event.get("weights") else None
    rows = rows()
    layer_params, meta = None, {}
    if weights is not None:
        reply, tensors = weights.reply()
        layer_params = dict(zip(reply.names, tensors))
        meta = {"version": reply.version, "weight_lag": int(reply.meta.get("newest", reply.version)) - reply.version}
    result = model.compute(event["task"], layer, rows, layer_params, event["args"])
    grads = None
    if event.get("grad") and result.grads is not None:
        grads = params.send(Header(Op.PUSH_GRADS, layer=layer, epoch=epoch, interval=interval, part=part,
                                   version=meta["version"], attempt=int(event.get("attempt", 0)),
                                   names=tuple(result.grads)), list(result.grads.values()))
    meta.update(result.meta)
    # A stage that writes no rows (layer 0's backward) has nothing to push: its meta travels in the
    # invoke's answer, whose success says the gradient was acknowledged.
    pushed = (graph.send(task_header(Op.PUSH, event, names=tuple(event["writes"]), meta=meta), result.rows)
              if event["writes"] else None)
    if grads is not None:
        grads.reply()
    if pushed is not None:
        pushed.reply()
    return {"task": event["task"], "interval": interval, "epoch": epoch, "layer": layer, "result": meta}


def _max_bytes(context: Any) -> int:
    """Half the function's memory: the largest reply it accepts."""
    memory_mb = getattr(context, "memory_limit_in_mb", None)
    return int(memory_mb) << 19 if memory_mb else DEFAULT_MAX_BYTES


def _peer(endpoint: str, what: str, context: Any) -> _Peer:
    keys = curve.keys_from_env("function")
    peer = _peers.get(endpoint)
    if peer is not None and peer.keys != keys:  # the keys were changed: connect again with the new ones
        _peers.pop(endpoint).close()
        peer = None
    if peer is None:
        peer = _peers[endpoint] = _Peer(zmq.Context.instance(), endpoint, what, context, keys)
        logger.info("connecting to %s%s", peer.what, " with CURVE" if keys is not None else "")
    peer.context = context
    return peer


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """AWS Lambda entry point. Raises :class:`FunctionTaskError` (a function error) on failure."""
    graph = _peer(event["graph_server"], "graph server", context)
    params = _peer(event["param_server"], "parameter server", context)
    graph.link = params.link = _Link(getattr(context, "bandwidth_bytes_per_s", None))
    try:
        return run_task(event, graph, params)
    except FunctionTaskError as exc:
        logger.warning("the call failed: closing the connections to both servers, the next call connects afresh")
        for endpoint in (event["graph_server"], event["param_server"]):
            peer = _peers.pop(endpoint, None)
            if peer is not None:
                peer.close()
        raise type(exc)(  # the type is the function error's errorType, which the invoker reads
            f"{event.get('task')} interval {event.get('interval')} epoch {event.get('epoch')} "
            f"layer {event.get('layer')} (part {event.get('part')}): {exc}") from None
