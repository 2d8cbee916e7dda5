"""A function that fails half-way through its pushes (issue 21: a call whose gradient reached the
parameter server while its rows never reached the graph server, or the reverse).

``$DORYLUS_TEST_PLAN`` is JSON, ``{epoch: [how, layer]}``: attempt 0 of that epoch's ``AV_BWD``
calls of that layer (every interval on every graph server) runs the real function
(:func:`lambdas.handler.run_task`) and fails ``how``:

* ``crash_after_gradient``: the sandbox dies (``Runtime.ExitError``) once the parameter server
  acknowledged the gradient, before the rows are pushed;
* ``raise_after_gradient``: the rows push fails there instead (a function error);
* ``rows_without_gradient``: the rows are pushed and acknowledged, the gradient never leaves the
  function, and the call fails (as a timeout on the gradient's acknowledgement would);
* ``late_rows``: the gradient is pushed, the rows are held back and the call fails; the rows, each
  plus one, are pushed late, while the next epoch's call of the same stage and interval is in
  progress (that call waits for the late push's answer, which is written to
  ``$DORYLUS_TEST_MARKERS/late-<part>-<interval>``: the graph server must drop it as a duplicate).

Relaunches and every other call run the real function untouched."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import zmq

from dorylus import protocol, sockets
from dorylus.protocol import Op
from lambdas import handler as function

WAIT_S = 60.0  # for the other half of late_rows; a test that sees no answer file fails


class _Answered:
    def __init__(self, reply):
        self.answer = reply

    def reply(self):
        return self.answer


class _Params:
    """The connection to the parameter server, with the gradient push made synchronous (so that
    ``after_ack`` runs once the server holds it, before the rows are pushed) or dropped."""

    def __init__(self, peer, after_ack=None, drop=False):
        self.peer, self.after_ack, self.drop = peer, after_ack, drop

    def send(self, header, tensors=()):
        if header.op is not Op.PUSH_GRADS:
            return self.peer.send(header, tensors)
        if self.drop:
            return _Answered(None)
        reply = self.peer.send(header, tensors).reply()
        self.after_ack()
        return _Answered(reply)


def _crash():
    os._exit(3)


def _fail():
    raise function.FunctionTaskError("injected: the rows push to the graph server failed")


class _HeldRows:
    """The connection to the graph server, with the rows push kept back: ``rows`` has them."""

    def __init__(self, peer):
        self.peer, self.rows = peer, None

    def send(self, header, tensors=()):
        if header.op is not Op.PUSH:
            return self.peer.send(header, tensors)
        self.rows = (header, [t + 1 for t in tensors])
        return _Answered(None)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _push_late(event, header, rows) -> None:
    """Once the next epoch's call is in progress, push ``rows`` on a connection of our own and
    write the answer where that call (and the test) read it."""
    markers, where = Path(os.environ["DORYLUS_TEST_MARKERS"]), f"{event['part']}-{event['interval']}"
    _wait_for(markers / f"next-{where}")
    socket = sockets.client_socket(zmq.Context.instance(), event["graph_server"], keys=None,
                                   server_role="graphserver", max_bytes=function.DEFAULT_MAX_BYTES)
    try:
        protocol.send(socket, header, rows)
        reply, _ = protocol.recv(socket, timeout=WAIT_S)
        answer = {"op": reply.op.value, "epoch": header.epoch, **reply.meta}
    except TimeoutError:
        answer = {"op": None}
    finally:
        socket.close(linger=0)
    (markers / f"late-{where}.tmp").write_text(json.dumps(answer))
    (markers / f"late-{where}.tmp").rename(markers / f"late-{where}")


def _late_rows(event, context):
    graph = function._peer(event["graph_server"], "graph server", context)
    params = function._peer(event["param_server"], "parameter server", context)
    graph.link = params.link = function._Link(None)
    held = _HeldRows(graph)
    function.run_task(event, held, _Params(params, after_ack=lambda: None))
    threading.Thread(target=_push_late, args=(event, *held.rows), daemon=True).start()
    raise function.FunctionTaskError("injected: the rows push is late")


def handler(event, context=None):
    plan = json.loads(os.environ["DORYLUS_TEST_PLAN"])
    how, layer = plan.get(str(event["epoch"]), (None, None))
    before = plan.get(str(event["epoch"] - 1), (None, None))
    if before[0] == "late_rows" and event["task"] == "AV_BWD" and event["layer"] == before[1]:
        # the next epoch's call: in progress at the graph server while the late push arrives
        markers, where = Path(os.environ["DORYLUS_TEST_MARKERS"]), f"{event['part']}-{event['interval']}"
        (markers / f"next-{where}").touch()
        _wait_for(markers / f"late-{where}")
    if how is None or event["task"] != "AV_BWD" or event["layer"] != layer or event.get("attempt", 0):
        return function.handler(event, context)
    if how == "late_rows":
        return _late_rows(event, context)
    graph = function._peer(event["graph_server"], "graph server", context)
    params = function._peer(event["param_server"], "parameter server", context)
    graph.link = params.link = function._Link(None)
    wrapped = {"crash_after_gradient": _Params(params, after_ack=_crash),
               "raise_after_gradient": _Params(params, after_ack=_fail),
               "rows_without_gradient": _Params(params, drop=True)}[how]
    try:
        result = function.run_task(event, graph, wrapped)
    finally:  # a failed call's connections may hold unread replies: the next call connects afresh
        for endpoint in (event["graph_server"], event["param_server"]):
            function._peers.pop(endpoint).close()
    raise function.FunctionTaskError(f"injected: the gradient of {result['task']} was lost")
