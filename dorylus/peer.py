"""The request/reply client every role uses to talk to a server: :class:`Peer` (blocking) and
:class:`AsyncPeer` (asyncio), one DEALER each (:func:`dorylus.sockets.client_socket`: CURVE
keys and the message limit) speaking :mod:`dorylus.protocol`.

Both share the rules:

* Every request gets a fresh ``req`` (unique in the process) and the reply must carry it: a
  request that timed out may still be answered later, and that late reply would otherwise be
  taken as the answer to the next request. A reply to a request that is not waited for any
  more (it timed out, its wait was stopped, or it is one of more than :data:`MAX_UNANSWERED`
  left unanswered) is dropped, logged and counted (``stale_replies``). A reply that arrives
  while another request's is awaited is kept for its own wait (a :class:`Peer` may have
  several requests in flight; an :class:`AsyncPeer` has one at a time).
* An ERROR reply raises :class:`Refused`, whose ``code`` is the reply's (``epoch_ahead``,
  ``bad_field``, ...); no reply within the timeout raises :class:`NoReply`. Both are
  :class:`PeerError`. A reply that is not a valid message raises ``ProtocolError`` as
  :func:`dorylus.protocol.decode` does. A user that needs its failures to be of its own kind
  (the graph server's are ``TaskFailed``) names subclasses in :attr:`Peer.refused` and
  :attr:`Peer.no_reply`.
* ``physics`` (a :class:`dorylus.emulator.physics.NetPhysics` with a network part, the graph
  server's ``--net-latency-ms``/``--net-bandwidth-mbps``) emulates the link: a request holds
  it for ``transfer_s(its tensor bytes)`` before going out, and its reply for
  ``transfer_s(the reply's)`` after it arrived, so the next request waits for both.

numpy + pyzmq only: the function (Lambda bundle) may import this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import zmq

from dorylus import protocol, sockets
from dorylus.protocol import Header, Op

if TYPE_CHECKING:
    from dorylus.curve import Keyring
    from dorylus.emulator.physics import NetPhysics

logger = logging.getLogger(__name__)

# Unique in the process, so that a log line's request id names one request.
_request_ids = itertools.count(1)
# How often a blocking wait with ``on_wait`` wakes up to call it.
WAIT_TICK_S = 0.05
# Requests sent and neither answered nor given up that a peer keeps, the oldest forgotten
# first: a request nobody waits for (SHUTDOWN at the end) must not hold its reply forever.
MAX_UNANSWERED = 64


class PeerError(RuntimeError):
    """A request got no usable answer: :class:`Refused` or :class:`NoReply`."""


class Refused(PeerError):
    """The server answered ERROR; ``code`` says why (``epoch_ahead``: not yet, try again) and
    ``reason`` is the reply's message."""

    def __init__(self, message: str, code: str, reason: str = ""):
        super().__init__(message)
        self.code, self.reason = code, reason


class NoReply(PeerError):
    """No reply to the request within its timeout."""


Reply = tuple[Header, list[np.ndarray]]


class _Connection:
    """What both peers share: the socket, request stamping and the rules for a reply."""

    refused: type[Refused] = Refused
    no_reply: type[NoReply] = NoReply

    def __init__(self, ctx: zmq.Context, endpoint: str, what: str, *, server_role: str, keys: Keyring | None,
                 max_bytes: int, physics: NetPhysics | None = None):
        self.socket = sockets.client_socket(ctx, endpoint, keys=keys, server_role=server_role, max_bytes=max_bytes)
        self.endpoint, self.keys = endpoint, keys
        self.what = f"{what} at {endpoint}"
        self.physics = physics if physics is not None and physics.network else None
        self.bytes_out = 0  # tensor bytes sent, for the callers' traffic counts
        self.stale_replies = 0
        # req -> its reply once it came (None before): the requests still waited for, oldest first
        self.unanswered: dict[int, Reply | None] = {}

    def _stamp(self, header: Header, tensors: Sequence[np.ndarray]) -> tuple[Header, list[Any], int]:
        header = dataclasses.replace(header, req=next(_request_ids))
        nbytes = sum(np.asarray(t).nbytes for t in tensors)
        self.bytes_out += nbytes
        self.unanswered[header.req] = None
        while len(self.unanswered) > MAX_UNANSWERED:
            del self.unanswered[next(iter(self.unanswered))]
        return header, protocol.encode(header, tensors), nbytes

    def _file(self, frames: list[Any]) -> None:
        """Keep a received reply for the request it answers, or drop and count it."""
        reply, arrays = protocol.decode(frames)
        if reply.req in self.unanswered and self.unanswered[reply.req] is None:
            self.unanswered[reply.req] = (reply, arrays)
            return
        self.stale_replies += 1
        logger.info("dropped a late %s reply from %s to request %s: that request had given up waiting for it",
                    reply.op.value, self.what, reply.req)

    def _answer(self, header: Header) -> Reply | None:
        """The reply to ``header``'s request if it came (it is then no longer waited for)."""
        if self.unanswered.get(header.req) is None:
            return None
        return self.unanswered.pop(header.req)

    def _result(self, header: Header, reply: Header, arrays: list[np.ndarray]) -> Reply:
        if reply.op is Op.ERROR:
            raise self.refused(f"{self.what} refused {header.op.value}: {reply.code}: {reply.message}", reply.code,
                               reply.message)
        return reply, arrays

    def _timed_out(self, header: Header, timeout: float) -> NoReply:
        return self.no_reply(f"{self.what} did not answer {header.op.value} within {timeout:g} s")

    def close(self) -> None:
        self.socket.close(linger=0)


class Pending:
    """A request :meth:`Peer.send` sent; :meth:`reply` waits for its answer."""

    def __init__(self, peer: Peer, header: Header, nbytes_out: int, sent_at: float):
        self.peer, self.header, self.nbytes_out, self.sent_at = peer, header, nbytes_out, sent_at

    def reply(self, timeout: float | None = None, *, on_wait: Callable[[], None] | None = None) -> Reply:
        """The reply, or :class:`Refused` for an ERROR one; :class:`NoReply` when none arrived
        ``timeout`` seconds after the request was sent (None: no limit). ``on_wait`` is called
        every :data:`WAIT_TICK_S` while waiting and may raise to stop waiting (the
        coordinator's watchdog)."""
        peer, header = self.peer, self.header
        if header.req not in peer.unanswered:
            raise RuntimeError(f"{peer.what}: request {header.req} ({header.op.value}) is not waited for: it was "
                               f"answered, given up, or forgotten (more than {MAX_UNANSWERED} unanswered)")
        deadline = None if timeout is None else self.sent_at + timeout
        try:
            while (answer := peer._answer(header)) is None:
                wait = WAIT_TICK_S if on_wait is not None else None
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
                    wait = left if wait is None else min(wait, left)
                if peer.socket.poll(None if wait is None else math.ceil(wait * 1000), zmq.POLLIN):
                    peer._file(peer.socket.recv_multipart(copy=False))
                elif deadline is not None and time.monotonic() >= deadline:
                    raise peer._timed_out(header, timeout)
                elif on_wait is not None:
                    on_wait()
        except BaseException:
            peer.unanswered.pop(header.req, None)  # given up: a reply that still comes is stale
            raise
        reply, arrays = answer
        if peer.physics is not None:
            time.sleep(peer.physics.transfer_s(sum(a.nbytes for a in arrays)))
        return peer._result(header, reply, arrays)


class Peer(_Connection):
    """A blocking connection to a server: :meth:`send` then the returned :class:`Pending`'s
    ``reply()`` (so that requests to several peers, or several to one, overlap), or
    :meth:`request` for both. Not thread-safe: one thread per peer."""

    def send(self, header: Header, tensors: Sequence[np.ndarray] = ()) -> Pending:
        header, frames, nbytes = self._stamp(header, tensors)
        if self.physics is not None:
            time.sleep(self.physics.transfer_s(nbytes))
        sent_at = time.monotonic()
        self.socket.send_multipart(frames, copy=False)
        return Pending(self, header, nbytes, sent_at)

    def request(self, header: Header, tensors: Sequence[np.ndarray] = (), *, timeout: float | None = None,
                on_wait: Callable[[], None] | None = None) -> Reply:
        return self.send(header, tensors).reply(timeout, on_wait=on_wait)


class AsyncPeer(_Connection):
    """An asyncio connection to a server (``ctx`` a ``zmq.asyncio.Context``): requests wait for
    each other, one in flight at a time."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lock = asyncio.Lock()

    async def request(self, header: Header, tensors: Sequence[np.ndarray] = (), *, timeout: float) -> Reply:
        async with self.lock:
            header, frames, nbytes = self._stamp(header, tensors)
            try:
                if self.physics is not None:  # the request holds its link while its bytes are on it
                    await asyncio.sleep(self.physics.transfer_s(nbytes))
                await self.socket.send_multipart(frames, copy=False)
                deadline = time.monotonic() + timeout
                while (answer := self._answer(header)) is None:
                    left = max(0.0, deadline - time.monotonic())
                    if not await self.socket.poll(math.ceil(left * 1000), zmq.POLLIN):
                        raise self._timed_out(header, timeout)
                    self._file(await self.socket.recv_multipart(copy=False))
            except BaseException:  # timed out or cancelled: a reply that still comes is stale
                self.unanswered.pop(header.req, None)
                raise
        reply, arrays = answer
        if self.physics is not None:  # the reply comes back the other way: the next request may go out
            await asyncio.sleep(self.physics.transfer_s(sum(a.nbytes for a in arrays)))
        return self._result(header, reply, arrays)
