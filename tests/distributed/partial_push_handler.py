"""A function that fails half-way through its pushes (issue 21: a call whose gradient reached the
parameter server while its rows never reached the graph server, or the reverse).

``$DORYLUS_TEST_PLAN`` is JSON, ``{epoch: [how, layer]}``: attempt 0 of that epoch's ``AV_BWD``
calls of that layer (every interval on every graph server) runs the real function
(:func:`lambdas.handler.run_task`) and fails ``how``:

* ``crash_after_gradient``: the sandbox dies (``Runtime.ExitError``) once the parameter server
  acknowledged the gradient, before the rows are pushed;
* ``raise_after_gradient``: the rows push fails there instead (a function error);
* ``rows_without_gradient``: the rows are pushed and acknowledged, the gradient never leaves the
  function, and the call fails (as a timeout on the gradient's acknowledgement would).

Relaunches and every other call run the real function untouched."""

from __future__ import annotations

import json
import os

from dorylus.protocol import Op
from lambdas import handler as function


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


def handler(event, context=None):
    how, layer = json.loads(os.environ["DORYLUS_TEST_PLAN"]).get(str(event["epoch"]), (None, None))
    if how is None or event["task"] != "AV_BWD" or event["layer"] != layer or event.get("attempt", 0):
        return function.handler(event, context)
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
