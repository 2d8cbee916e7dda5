"""A graph server resends ghost rows a peer refused as ``epoch_ahead`` (the peer has not had its
own ``train`` command yet), and only those: any other refusal fails at once, and the resending
stops at the task timeout."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dorylus import protocol
from dorylus.protocol import Op, ProtocolError
from graphserver.invoker import TaskFailed
from graphserver.server import AsyncPeer, GraphServer


class FakePeer:
    """A ROUTER that answers GHOSTS with ERROR ``code`` the first ``refusals`` times, then ACK."""

    def __init__(self, code: str, refusals: int):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.code, self.refusals, self.received = code, refusals, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(20):
                continue
            identity, header, _ = protocol.recv_routed(self.socket)
            self.received += 1
            if self.received <= self.refusals:
                reply = protocol.error_reply(header, ProtocolError(self.code, "not yet"))
            else:
                reply = protocol.reply_to(header, Op.ACK)
            protocol.send_routed(self.socket, identity, reply)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close(linger=0)
        self.ctx.term()


def _send(peer: FakePeer, timeout_s: float) -> dict:
    """GraphServer.send_ghosts of one row block to ``peer``, on a stand-in server."""
    async def main() -> dict:
        ctx = zmq.asyncio.Context()
        counters = defaultdict(float)
        server = SimpleNamespace(config=SimpleNamespace(task_timeout_s=timeout_s), counters=counters, part_id=0,
                                 GHOSTS_RETRY_S=0.01,
                                 peers={1: AsyncPeer(ctx, peer.endpoint, "graph server 1", server_role="graphserver",
                                                     keys=None, max_bytes=1 << 20)})
        try:
            await GraphServer.send_ghosts(server, "SC", "train", 3, 0, "H", {1: np.ones((2, 4), np.float32)})
        finally:
            server.peers[1].close()
            ctx.term()
        return counters

    return asyncio.run(main())


def test_rows_refused_as_epoch_ahead_are_sent_again_until_accepted():
    peer = FakePeer("epoch_ahead", refusals=3)
    try:
        counters = _send(peer, timeout_s=10)
    finally:
        peer.close()
    assert peer.received == 4 and counters["ghosts_resent"] == 3


def test_any_other_refusal_fails_at_once():
    peer = FakePeer("row_count", refusals=1)
    try:
        with pytest.raises(TaskFailed, match="row_count"):
            _send(peer, timeout_s=10)
    finally:
        peer.close()
    assert peer.received == 1


def test_resending_stops_at_the_task_timeout():
    peer = FakePeer("epoch_ahead", refusals=10**6)
    try:
        with pytest.raises(TaskFailed, match="epoch_ahead"):
            _send(peer, timeout_s=0.3)
    finally:
        peer.close()
    assert 2 <= peer.received <= 10
