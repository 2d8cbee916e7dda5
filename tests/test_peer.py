"""dorylus.peer against a scripted ROUTER: a reply reaches the request it answers, a late reply
to a request that timed out is dropped and counted (the next request still gets its own), an
ERROR reply is Refused with its code, silence is NoReply; blocking and asyncio alike."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dorylus import protocol
from dorylus.emulator.physics import NetPhysics
from dorylus.peer import MAX_UNANSWERED, AsyncPeer, NoReply, Peer, Refused
from dorylus.protocol import Header, Op, ProtocolError

WAIT_S = 10.0  # a reply that is due; generous for a loaded machine
LATE_S = 0.6   # how long the server holds a reply it is told to hold
SHORT_S = 0.2  # a timeout that a held reply misses


class Server:
    """A ROUTER on a free 127.0.0.1 port, in a thread. Each request names in ``meta["do"]``
    what to do: ``ack`` (ACK echoing ``meta["n"]`` and the tensors' sum), ``late`` (the same,
    ``LATE_S`` later), ``refuse`` (ERROR ``meta["code"]``) or ``ignore`` (no answer)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[int] = []  # req of every request, in order
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(20):
                continue
            identity, header, tensors = protocol.recv_routed(self.socket)
            self.received.append(header.req)
            do = header.meta["do"]
            if do == "ignore":
                continue
            if do == "refuse":
                protocol.send_routed(self.socket, identity,
                                     protocol.error_reply(header, ProtocolError(header.meta["code"], "not now")))
                continue
            if do == "late":
                self.stop.wait(LATE_S)
            total = float(sum(t.sum() for t in tensors))
            protocol.send_routed(self.socket, identity, protocol.reply_to(header, Op.ACK, meta={
                "n": header.meta["n"], "sum": total}))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close(linger=0)
        self.ctx.term()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def peer(server):
    ctx = zmq.Context()
    p = Peer(ctx, server.endpoint, "test server", server_role="graphserver", keys=None, max_bytes=1 << 20)
    yield p
    p.close()
    ctx.term()


def ask(n: int, do: str = "ack", **meta) -> Header:
    return Header(Op.COMMAND, meta={"command": "test", "n": n, "do": do, **meta})


# ----------------------------------------------------------------------------- blocking


def test_a_reply_answers_its_request_with_a_fresh_req(peer, server):
    reply, _ = peer.request(ask(1), [np.full(3, 2.0, np.float32)], timeout=WAIT_S)
    reply2, _ = peer.request(ask(2), timeout=WAIT_S)
    assert (reply.op, reply.meta["n"], reply.meta["sum"]) == (Op.ACK, 1, 6.0)
    assert reply2.meta["n"] == 2
    assert server.received == [reply.req, reply2.req] and reply.req != reply2.req
    assert peer.stale_replies == 0 and peer.bytes_out == 12


def test_a_late_reply_to_a_timed_out_request_is_dropped_and_counted(peer, server):
    start = time.monotonic()
    with pytest.raises(NoReply, match=rf"test server at {server.endpoint} did not answer COMMAND within 0.2 s"):
        peer.request(ask(1, "late"), timeout=SHORT_S)
    assert SHORT_S <= time.monotonic() - start < LATE_S
    # The server answers 1 (late) before 2: that answer is not taken as 2's.
    reply, _ = peer.request(ask(2), timeout=WAIT_S)
    assert reply.meta["n"] == 2 and peer.stale_replies == 1
    reply, _ = peer.request(ask(3), timeout=WAIT_S)
    assert reply.meta["n"] == 3 and peer.stale_replies == 1


def test_an_error_reply_is_refused_with_its_code(peer):
    with pytest.raises(Refused, match=r"refused COMMAND: epoch_ahead: not now") as err:
        peer.request(ask(1, "refuse", code="epoch_ahead"), timeout=WAIT_S)
    assert (err.value.code, err.value.reason) == ("epoch_ahead", "not now")
    assert peer.request(ask(2), timeout=WAIT_S)[0].meta["n"] == 2  # the peer goes on


def test_requests_in_flight_together_each_get_their_own_reply_in_any_order(server, peer):
    ctx = zmq.Context()
    other = Peer(ctx, server.endpoint, "other", server_role="graphserver", keys=None, max_bytes=1 << 20)
    try:
        first, second = peer.send(ask(1, "late")), other.send(ask(2))
        assert second.reply(WAIT_S)[0].meta["n"] == 2  # awaited in the other order than sent
        assert first.reply(WAIT_S)[0].meta["n"] == 1
        # two on one peer (the function's, when both servers share an endpoint): the server
        # answers 3 first, which is kept while 4 is awaited
        third, fourth = peer.send(ask(3, "late")), peer.send(ask(4))
        assert fourth.reply(WAIT_S)[0].meta["n"] == 4 and third.reply(WAIT_S)[0].meta["n"] == 3
        assert peer.stale_replies == 0
        with pytest.raises(RuntimeError, match="not waited for: it was answered"):
            first.reply(WAIT_S)
    finally:
        other.close()
        ctx.term()


def test_requests_nobody_waits_for_are_forgotten_oldest_first(peer):
    sent = [peer.send(ask(n, "ignore")) for n in range(MAX_UNANSWERED + 1)]
    assert len(peer.unanswered) == MAX_UNANSWERED
    with pytest.raises(RuntimeError, match="forgotten"):
        sent[0].reply(WAIT_S)
    with pytest.raises(NoReply):
        sent[-1].reply(SHORT_S)
    with pytest.raises(RuntimeError, match="given up"):  # a timed-out request is not waited for again
        sent[-1].reply(WAIT_S)


def test_on_wait_runs_while_waiting_and_may_stop_the_wait(peer):
    calls = []

    def watchdog():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise TimeoutError("the watchdog's")

    with pytest.raises(TimeoutError, match="the watchdog's"):
        peer.request(ask(1, "ignore"), on_wait=watchdog)
    assert len(calls) == 3
    calls.clear()
    assert peer.request(ask(2), on_wait=lambda: None)[0].meta["n"] == 2


def test_the_emulated_link_delays_the_request_and_the_reply(peer, server):
    ctx = zmq.Context()
    physics = NetPhysics(latency_ms=50.0, bandwidth_mbps=80.0)
    slow = Peer(ctx, server.endpoint, "slow", server_role="graphserver", keys=None, max_bytes=1 << 22,
                physics=physics)
    rows = np.ones(250_000, np.float32)  # 1 MB: 100 ms at 80 Mbit/s
    try:
        start = time.monotonic()
        slow.request(ask(1), [rows], timeout=WAIT_S)
        # lower bound only: a loaded machine adds time, never removes it
        assert time.monotonic() - start >= physics.transfer_s(rows.nbytes) + physics.transfer_s(0) - 1e-3
        assert Peer(ctx, server.endpoint, "x", server_role="graphserver", keys=None, max_bytes=1,
                    physics=NetPhysics(compute_jitter=1.0)).physics is None  # no network part: no link
    finally:
        slow.close()
        ctx.term()


# ----------------------------------------------------------------------------- asyncio


def run_async(server: Server, body):
    async def main():
        ctx = zmq.asyncio.Context()
        peer = AsyncPeer(ctx, server.endpoint, "test server", server_role="graphserver", keys=None,
                         max_bytes=1 << 20)
        try:
            return await asyncio.wait_for(body(peer), 2 * WAIT_S)
        finally:
            peer.close()
            ctx.term()

    return asyncio.run(main())


def test_async_a_reply_answers_its_request(server):
    async def body(peer):
        return [await peer.request(ask(n), [np.ones(2, np.float32)], timeout=WAIT_S) for n in (1, 2)]

    (first, _), (second, _) = run_async(server, body)
    assert (first.meta["n"], first.meta["sum"], second.meta["n"]) == (1, 2.0, 2)
    assert server.received == [first.req, second.req]


def test_async_a_late_reply_is_dropped_and_concurrent_requests_take_turns(server):
    async def body(peer):
        with pytest.raises(NoReply, match="did not answer COMMAND within 0.2 s"):
            await peer.request(ask(1, "late"), timeout=SHORT_S)
        replies = await asyncio.gather(*(peer.request(ask(n), timeout=WAIT_S) for n in (2, 3, 4)))
        return [r.meta["n"] for r, _ in replies], peer.stale_replies

    assert run_async(server, body) == ([2, 3, 4], 1)


def test_async_an_error_reply_is_refused_with_its_code(server):
    async def body(peer):
        with pytest.raises(Refused, match="bad_field") as err:
            await peer.request(ask(1, "refuse", code="bad_field"), timeout=WAIT_S)
        return err.value.code, (await peer.request(ask(2), timeout=WAIT_S))[0].meta["n"]

    assert run_async(server, body) == ("bad_field", 2)


def test_a_user_names_its_own_failure_types(server):
    class TaskRefused(Refused):
        pass

    class TaskTimedOut(NoReply):
        pass

    class TaskPeer(AsyncPeer):
        refused, no_reply = TaskRefused, TaskTimedOut

    async def main():
        ctx = zmq.asyncio.Context()
        peer = TaskPeer(ctx, server.endpoint, "t", server_role="graphserver", keys=None, max_bytes=1 << 20)
        try:
            with pytest.raises(TaskRefused):
                await peer.request(ask(1, "refuse", code="row_count"), timeout=WAIT_S)
            with pytest.raises(TaskTimedOut):
                await peer.request(ask(2, "ignore"), timeout=SHORT_S)
        finally:
            peer.close()
            ctx.term()

    asyncio.run(main())
