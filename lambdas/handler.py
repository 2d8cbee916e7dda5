"""The Dorylus tensor function, as AWS Lambda calls it: ``handler(event, context)``.

numpy + pyzmq only. The invoke payload carries metadata alone; the function dials out to its
graph server and to the parameter server (it never listens), pulls its interval's rows and the
weights, computes (:mod:`lambdas.compute`), pushes the results, and returns a small summary.

Event keys: ``task`` (``AV`` | ``AV_BWD`` | ``AV_LOSS``), ``graph_server`` and
``param_server`` (ZeroMQ endpoints), ``part``, ``interval``, ``rows`` ([start, stop) of the
graph server's owned rows), ``epoch``, ``layer``, ``version`` (weight version), ``attempt``,
``training``, ``seed``, ``next_dropout`` (dropout of layer ``layer + 1``), ``train_count``
(global). Rows pulled and pushed, by task:

=========  =========================  ==========================================
task       pulls                      pushes
=========  =========================  ==========================================
AV         Z_l, ids                   H_{l+1} (dropped with layer l+1's mask)
AV_BWD     Z_l, ids, GH_{l+1}         GZ_l; dW_l to the parameter server
AV_LOSS    Z_l, labels, split         GZ_l (training); dW_l; loss and counts in meta
=========  =========================  ==========================================
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq

from dorylus import protocol
from dorylus.protocol import Header, Op
from lambdas import compute

# Never wait on a server longer than this, nor past the function's own deadline.
MAX_WAIT_S = 120.0
_DEADLINE_MARGIN_MS = 500
_request_ids = itertools.count(1)


class FunctionTaskError(RuntimeError):
    """A server answered with ERROR or did not answer; names the task, interval and epoch."""


class _Peer:
    """A DEALER connection with blocking request/reply and a deadline on every wait."""

    def __init__(self, ctx: zmq.Context, endpoint: str, what: str, context: Any):
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.what = f"{what} {endpoint}"
        self.context = context

    def request(self, header: Header, tensors: Sequence[np.ndarray] = ()) -> tuple[Header, list[np.ndarray]]:
        header = dataclasses.replace(header, req=next(_request_ids))
        protocol.send(self.socket, header, tensors)
        try:
            reply, arrays = protocol.recv(self.socket, timeout=self._timeout())
        except TimeoutError:
            raise FunctionTaskError(f"{self.what} did not answer {header.op.value}") from None
        if reply.op is Op.ERROR:
            raise FunctionTaskError(f"{self.what} refused {header.op.value}: {reply.code}: {reply.message}")
        return reply, arrays

    def _timeout(self) -> float:
        remaining = getattr(self.context, "get_remaining_time_in_millis", None)
        if remaining is None:
            return MAX_WAIT_S
        return max(0.1, min(MAX_WAIT_S, (remaining() - _DEADLINE_MARGIN_MS) / 1000))

    def close(self) -> None:
        self.socket.close(linger=0)


PULL_NAMES = {"AV": ("Z", "ids"), "AV_BWD": ("Z", "ids", "GH"), "AV_LOSS": ("Z", "labels", "split")}


@dataclass
class TaskOutput:
    """What a task sends back: rows for the graph server, a weight gradient, scalars in meta."""

    names: tuple[str, ...]
    rows: list[np.ndarray]
    grad_w: np.ndarray | None
    meta: dict[str, Any]


def compute_task(event: dict[str, Any], rows: dict[str, np.ndarray], w: np.ndarray) -> TaskOutput:
    """The tensor work of one task on its interval's pulled ``rows`` and the weights ``w``.
    Shared by this function and the graph server's in-process ``cpu`` backend."""
    task = event["task"]
    key = dict(seed=int(event["seed"]), epoch=int(event["epoch"]), next_layer=int(event["layer"]) + 1,
               next_dropout=float(event.get("next_dropout", 0.0)))
    training = bool(event.get("training", True))
    if task == "AV":
        h = compute.apply_vertex_forward(rows["Z"], w, vertex_ids=rows["ids"], training=training, **key)
        return TaskOutput(("H",), [h], None, {})
    if task == "AV_BWD":
        grad_w, grad_z = compute.apply_vertex_backward(rows["Z"], w, rows["GH"], vertex_ids=rows["ids"], **key)
        return TaskOutput(("GZ",), [grad_z], grad_w, {})
    if task == "AV_LOSS":
        result = compute.last_layer(rows["Z"], w, rows["labels"], rows["split"],
                                    train_count=int(event["train_count"]), training=training)
        meta = {"loss": float(result.loss_sum), **{f"correct_{k}": int(v) for k, v in result.correct.items()}}
        if training:
            return TaskOutput(("GZ",), [result.grad_z], result.grad_w, meta)
        return TaskOutput((), [], None, meta)
    raise ValueError(f"unknown task {task!r}; expected one of {', '.join(PULL_NAMES)}")


def task_header(op: Op, event: dict[str, Any], **fields: Any) -> Header:
    """The header identifying ``event``'s task in PULL and PUSH messages."""
    start, stop = (int(x) for x in event["rows"])
    return Header(op, task=event["task"], epoch=int(event["epoch"]), layer=int(event["layer"]),
                  interval=int(event["interval"]), part=int(event["part"]), rows=(start, stop),
                  attempt=int(event.get("attempt", 0)), **fields)


def run_task(event: dict[str, Any], graph: _Peer, params: _Peer) -> dict[str, Any]:
    names = PULL_NAMES.get(event["task"])
    if names is None:
        raise ValueError(f"unknown task {event['task']!r}; expected one of {', '.join(PULL_NAMES)}")
    _, pulled = graph.request(task_header(Op.PULL, event, names=names))
    layer, epoch, interval = int(event["layer"]), int(event["epoch"]), int(event["interval"])
    reply, (w,) = params.request(Header(Op.PULL_WEIGHTS, layer=layer, epoch=epoch, interval=interval,
                                        version=event.get("version")))
    out = compute_task(event, dict(zip(names, pulled)), w)
    if out.grad_w is not None:
        params.request(Header(Op.PUSH_GRADS, layer=layer, epoch=epoch, interval=interval, part=int(event["part"]),
                              version=reply.version, attempt=int(event.get("attempt", 0))), [out.grad_w])
    graph.request(task_header(Op.PUSH, event, names=out.names, meta=out.meta), out.rows)
    return {"task": event["task"], "interval": interval, "epoch": epoch, "layer": layer,
            "version": reply.version, **out.meta}


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """AWS Lambda entry point. Raises :class:`FunctionTaskError` (a function error) on failure."""
    ctx = zmq.Context.instance()
    graph = _Peer(ctx, event["graph_server"], "graph server", context)
    params = _Peer(ctx, event["param_server"], "parameter server", context)
    try:
        return run_task(event, graph, params)
    except FunctionTaskError as exc:
        raise FunctionTaskError(
            f"{event.get('task')} interval {event.get('interval')} epoch {event.get('epoch')} "
            f"layer {event.get('layer')} (part {event.get('part')}): {exc}") from None
    finally:
        graph.close()
        params.close()
