"""The control plane cannot be knocked over (issue 21, item 6).

* Reports travel as a document frame, bounded per reply: any number of epochs' reports fit
  and round-trip.
* A COMMAND with a null or wrong-typed field gets ERROR ``bad_command`` and the graph server
  keeps serving (it used to raise TypeError out of its receive loop and never answer again).
* Fuzz: random commands and messages against a graph server and a parameter server; both still
  answer a valid request at the end. 10k each in the default suite, 100k under ``slow``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time

import numpy as np
import pytest
import zmq

from dorylus import protocol as P
from dorylus.config import TrainConfig
from dorylus.models.spec import ModelSpec
from dorylus.paramserver import ParameterServer
from dorylus.partition import assign_parts, write_store
from dorylus.protocol import Header, Op, ProtocolError
from tests.graphs import random_graph

TIMEOUT = 10.0  # seconds; every wait in this file
CHECK_EVERY = 500  # fuzzed messages between liveness checks: below ZeroMQ's 1000-message queue


def report(epoch: int) -> dict:
    """A graph server's report of one epoch, with the fields and sizes a real one has (~650 chars)."""
    return {"epoch": epoch, "loss": 1.2345678901234567, "evaluated": True, "correct_train": 123,
            "correct_val": 234, "correct_test": 456, "staleness_reads": 0, "staleness_sum": 0, "staleness_max": 0,
            "weight_lag_max": 0, "relaunches": 0, "failed_calls": 0, "invocations": 12, "concurrency": 2,
            "task_s": {k: 0.0123456789 for k in ("AV", "AV_BWD", "AV_LOSS", "GA", "GA_BWD", "SC", "SC_BWD")},
            "bytes_functions": 123456789, "bytes_ghosts": 12345678, "bytes_params": 1234567,
            "train_s": 0.123456789, "eval_s": 0.0123456789, "gate_wait_s": 0.0, "weight_wait_s": 0.001234}


# ----------------------------------------------------------------------------- documents


def test_reports_of_many_epochs_fit_and_round_trip():
    reports = [report(e) for e in range(1, 5001)]
    assert len(json.dumps(reports[0])) > P.MAX_MESSAGE_CHARS // 2  # two epochs behind overflowed meta
    received = []
    pending = reports
    while pending:  # what a graph server does per progress reply
        count = P.take_fitting(pending)
        header, _ = P.decode(P.encode(P.Header(Op.ACK, req=3, meta={"more": count < len(pending)},
                                               doc=pending[:count])))
        assert header.doc == pending[:count] and header.meta["more"] == (count < len(pending))
        assert len(P.encode_doc(header.doc)) <= P.MAX_DOC_BYTES
        received += header.doc
        pending = pending[count:]
    assert received == reports


def test_document_beside_tensors_round_trips():
    doc = {"nested": [1, 2.5, None, True, "x" * 5000], "empty": {}}
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    header, tensors = P.decode(P.encode(Header(Op.WEIGHTS, layer=0, version=1, names=("weight",), doc=doc),
                                        [weights]))
    assert header.doc == doc and np.array_equal(tensors[0], weights)


def test_take_fitting_respects_the_limit():
    items = [{"i": i, "pad": "y" * 90} for i in range(100)]
    count = P.take_fitting(items, limit=1000)
    assert len(P.encode_doc(items[:count])) <= 1000 < len(P.encode_doc(items[:count + 1]))
    assert P.take_fitting([], limit=10) == 0
    assert P.take_fitting([{"big": "z" * 100}], limit=10) == 1  # one item always goes; encode_doc judges it


@pytest.mark.parametrize("frames, why", [
    ([b'{"v":1,"op":"ACK","doc":4}', b"[1,2"], "not finite utf-8 json"),
    ([b'{"v":1,"op":"ACK","doc":3}', b"NaN"], "not finite"),
    ([b'{"v":1,"op":"ACK","doc":2}', b"\xff\xfe"], "not finite utf-8 json"),
    ([b'{"v":1,"op":"ACK","doc":4}', b"[1]"], "header says 4"),
    ([b'{"v":1,"op":"ACK","doc":%d}' % (P.MAX_DOC_BYTES + 1), b"0" * (P.MAX_DOC_BYTES + 1)], "at most"),
    ([b'{"v":1,"op":"ACK","doc":"3"}', b"[1]"], "byte length"),
    ([b'{"v":1,"op":"ACK","doc":true}', b"1"], "byte length"),
    ([b'{"v":1,"op":"ACK","doc":%d}' % 20000, b"[" * 10000 + b"]" * 10000], "not finite utf-8 json"),
])
def test_bad_documents_are_refused(frames, why):
    with pytest.raises(ProtocolError) as info:
        P.decode(frames)
    assert info.value.code == "bad_doc" and why in info.value.message.lower()


def test_document_frame_missing_or_extra_is_frame_count():
    with pytest.raises(ProtocolError) as info:
        P.decode([b'{"v":1,"op":"ACK","doc":3}'])
    assert info.value.code == "frame_count"
    with pytest.raises(ProtocolError) as info:
        P.decode([b'{"v":1,"op":"ACK"}', b"[1]"])
    assert info.value.code == "frame_count"


def test_encode_refuses_documents_it_cannot_send():
    with pytest.raises(ProtocolError, match="bad_doc"):
        P.encode(Header(Op.ACK, doc={"x": float("nan")}))
    with pytest.raises(ProtocolError, match="bad_doc"):
        P.encode(Header(Op.ACK, doc="z" * (P.MAX_DOC_BYTES + 1)))
    with pytest.raises(ProtocolError, match="bad_doc"):
        P.encode(Header(Op.ACK, doc={"x": object()}))


# ----------------------------------------------------------------------------- servers

F, C = 5, 3


def train_config(**overrides) -> TrainConfig:
    return TrainConfig(backend="cpu", hidden=4, intervals=2, epochs=3, **overrides)


class GraphServerThread:
    """A real :class:`~graphserver.server.GraphServer` serving on 127.0.0.1 in a thread of this
    process (its own asyncio loop), stopped and joined by :meth:`stop`."""

    def __init__(self, store, config: TrainConfig):
        from graphserver.server import GraphServer

        self.endpoint = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        # A parameter server nobody listens at: commands that would reach it fail in the background.
        self.server = None

        async def main() -> None:
            self.server = GraphServer(str(store), 0, config, param_server="tcp://127.0.0.1:9")
            self.loop = asyncio.get_running_loop()
            serving = asyncio.create_task(self.server.serve("tcp://127.0.0.1:0"))
            while not self.server.endpoint and not serving.done():
                await asyncio.sleep(0.01)
            self.endpoint = self.server.endpoint
            self.ready.set()
            await serving

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by the test that waits on it
                self.error = exc
            finally:
                self.ready.set()

        self.thread = threading.Thread(target=run, name="graphserver", daemon=True)
        self.thread.start()
        assert self.ready.wait(60), "the graph server did not start"
        assert self.error is None and self.endpoint, self.error

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stopping.set)
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the graph server did not stop"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    graph = random_graph(num_nodes=40, num_edges=120, num_features=F, num_classes=C)
    write_store(graph, assign_parts(graph.num_nodes, graph.src, graph.dst, 2, "random"), root / "parts",
                method="random", seed=0)
    return root / "parts"


@pytest.fixture
def graph_server(store):
    server = GraphServerThread(store, train_config())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def param_server():
    spec = ModelSpec.from_config(train_config(), F, C)
    server = ParameterServer(spec, 0, "adam", 0.01).start()
    try:
        yield server
    finally:
        server.close(timeout=TIMEOUT)


class Peer:
    """A DEALER that sends raw frames and waits (with a timeout) for the reply to one request."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.req = 1 << 60

    def request(self, header: Header) -> Header:
        self.req += 1
        header = Header(**{**header.__dict__, "req": self.req})
        P.send(self.sock, header)
        return self.reply_to(self.req)

    def reply_to(self, req: int) -> Header:
        """The reply to ``req``; replies to earlier (fuzzed) messages are skipped."""
        deadline = time.monotonic() + TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000), zmq.POLLIN):
                break
            frames = self.sock.recv_multipart()
            try:
                reply, _ = P.decode(frames)
            except ProtocolError:
                continue
            if reply.req == req:
                return reply
        raise AssertionError(f"no reply to request {req} within {TIMEOUT} s: the server went deaf")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peer_of():
    peers = []

    def make(endpoint: str) -> Peer:
        peers.append(Peer(endpoint))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


def command(name: str, **meta) -> Header:
    return Header(Op.COMMAND, meta={"command": name, **meta})


def assert_serving(peer: Peer) -> None:
    reply = peer.request(Header(Op.HELLO, role="coordinator"))
    assert reply.op is Op.READY, reply


@pytest.mark.parametrize("meta, field", [
    ({"min_epoch": None}, "min_epoch"),
    ({"min_epoch": "3"}, "min_epoch"),
    ({"min_epoch": 1.5}, "min_epoch"),
    ({"min_epoch": True}, "min_epoch"),
    ({"min_epoch": -1}, "min_epoch"),
    ({"min_epoch": 0, "wait_s": None}, "wait_s"),
    ({"min_epoch": 0, "wait_s": "1"}, "wait_s"),
    ({"min_epoch": 0, "wait_s": True}, "wait_s"),
    ({"min_epoch": 0, "wait_s": -0.5}, "wait_s"),
])
def test_progress_with_a_bad_field_is_refused_and_the_server_keeps_serving(graph_server, peer_of, meta, field):
    peer = peer_of(graph_server.endpoint)
    for _ in range(3):  # the old server answered the first at best, and nothing after it
        reply = peer.request(command("progress", **meta))
        assert reply.op is Op.ERROR and reply.code == "bad_command", reply
        assert field in reply.message and "progress" in reply.message
        assert_serving(peer)
    ok = peer.request(command("progress", min_epoch=0))
    assert ok.op is Op.ACK and ok.doc == [] and ok.meta["more"] is False
    stats = peer.request(Header(Op.STATS))
    assert stats.meta["rejected.bad_command"] == 3
    assert graph_server.alive()


def test_progress_waits_for_news_while_the_server_serves_others(graph_server, peer_of):
    """A progress with ``wait_s`` is answered at the server's next report (with it), or once
    ``wait_s`` passed with nothing; meanwhile the server answers other requests."""
    coordinator, other = peer_of(graph_server.endpoint), peer_of(graph_server.endpoint)
    gs = graph_server.server
    coordinator.req += 1
    waiting = coordinator.req
    P.send(coordinator.sock, Header(Op.COMMAND, req=waiting, meta={"command": "progress", "min_epoch": 0,
                                                                    "wait_s": 30.0}))
    time.sleep(0.3)
    assert not coordinator.sock.poll(0, zmq.POLLIN), "answered before any news"
    assert_serving(other)  # the waiting request does not hold the receive loop

    sent = time.monotonic()
    graph_server.loop.call_soon_threadsafe(gs.add_report, report(1))
    reply = coordinator.reply_to(waiting)
    assert time.monotonic() - sent < 5.0
    assert reply.op is Op.ACK and [r["epoch"] for r in reply.doc] == [1] and reply.meta["more"] is False
    start = time.monotonic()
    empty = coordinator.request(command("progress", min_epoch=0, wait_s=0.4))
    assert empty.op is Op.ACK and empty.doc == [] and 0.35 <= time.monotonic() - start < 5.0


def test_progress_wait_is_capped(graph_server, peer_of, monkeypatch):
    import graphserver.server

    monkeypatch.setattr(graphserver.server, "MAX_PROGRESS_WAIT_S", 0.5)
    peer = peer_of(graph_server.endpoint)
    start = time.monotonic()
    reply = peer.request(command("progress", min_epoch=0, wait_s=1e9))
    assert reply.op is Op.ACK and 0.45 <= time.monotonic() - start < TIMEOUT


@pytest.mark.parametrize("meta, field", [
    ({"first": None, "last": 3, "epochs": 3, "eval_every": 1}, "first"),
    ({"first": 1, "last": "3", "epochs": 3, "eval_every": 1}, "last"),
    ({"first": 1, "last": 3, "epochs": 3}, "eval_every"),
    ({"first": 2, "last": 1, "epochs": 3, "eval_every": 1}, "last"),
    ({"first": 1, "last": 3, "epochs": 2, "eval_every": 1}, "epochs"),
])
def test_train_with_a_bad_field_is_refused_before_anything_starts(graph_server, peer_of, meta, field):
    peer = peer_of(graph_server.endpoint)
    reply = peer.request(command("train", **meta))
    assert reply.op is Op.ERROR and reply.code == "bad_command" and field in reply.message, reply
    assert graph_server.server.training is None and graph_server.server.scheduler is None
    assert_serving(peer)


def test_connect_without_peers_is_refused(graph_server, peer_of):
    peer = peer_of(graph_server.endpoint)
    for meta in ({}, {"peers": None}, {"peers": 7}):
        reply = peer.request(command("connect", **meta))
        assert reply.op is Op.ERROR and reply.code == "bad_command" and "peers" in reply.message, reply
    assert_serving(peer)


def test_a_failure_inside_a_handler_is_answered_counted_and_survived(graph_server, peer_of, monkeypatch):
    """Whatever a handler raises (here a TypeError, as the old progress did), the sender gets
    ERROR ``internal`` and the server goes on."""
    def broken(*args, **kwargs):
        raise TypeError("'>' not supported between instances of 'NoneType' and 'int'")

    monkeypatch.setattr(graph_server.server, "_read_rows", broken)
    peer = peer_of(graph_server.endpoint)
    reply = peer.request(Header(Op.PULL, task="AV", epoch=1, layer=0, interval=0, rows=(0, 1), names=("H0",)))
    assert reply.op is Op.ERROR and reply.code == "internal" and "TypeError" in reply.message, reply
    assert_serving(peer)
    stats = peer.request(Header(Op.STATS))
    assert sum(v for k, v in stats.meta.items() if k.startswith("rejected.")) >= 1


# ----------------------------------------------------------------------------- fuzzing

COMMANDS = ("progress", "train", "connect", "config", "wait_version", "get_state", "set_state", "configure", "step",
            "get_weights", "nonsense", "")
FIELDS = ("min_epoch", "first", "last", "epochs", "eval_every", "peers", "version", "expected", "epoch",
          "optimizer", "part", "weights", "function_name", "region", "lambda_endpoint", "x")
OPS = [op.value for op in Op if op is not Op.SHUTDOWN] + ["NOPE", ""]  # SHUTDOWN would stop it legitimately
HEADER_FIELDS = ("req", "epoch", "layer", "interval", "part", "rows", "version", "attempt", "task", "names", "role",
                 "code", "message", "meta", "csr", "t", "doc", "v", "op", "zz")


def random_value(rng: random.Random):
    kind = rng.randrange(14)
    return [None, True, False, 0, 1, -1, 2**62, 2**64, 1.5, -0.0, "", "1", "x" * rng.choice((3, 2000)),
            rng.randrange(-5, 50)][kind]


def random_json_value(rng: random.Random, depth: int = 0):
    if depth < 2 and rng.random() < 0.3:
        return [random_json_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    if depth < 2 and rng.random() < 0.2:
        return {rng.choice(FIELDS): random_json_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return random_value(rng)


def fuzz_message(rng: random.Random) -> list[bytes]:
    """One random message: mostly well-formed commands with random (often wrong) fields, then
    random headers of every op, then malformed frames of every kind."""
    roll = rng.random()
    if roll < 0.5:
        meta = {"command": rng.choice(COMMANDS)}
        for name in rng.sample(FIELDS, rng.randrange(4)):
            meta[name] = random_value(rng)
        header = {"v": 1, "op": "COMMAND", "req": rng.randrange(1, 1 << 30), "meta": meta}
        frames = [json.dumps(header).encode()]
        if rng.random() < 0.05:  # a state to restore, of a random shape
            header["t"] = [["float32", [rng.randrange(4), rng.randrange(4)]]]
            frames = [json.dumps(header).encode(), b"\0" * (4 * math.prod(header["t"][0][1]))]
        return frames
    if roll < 0.85:
        header = {"v": 1, "op": rng.choice(OPS)}
        for name in rng.sample(HEADER_FIELDS, rng.randrange(6)):
            header[name] = random_json_value(rng)
        frames = [json.dumps(header).encode()]
        for _ in range(rng.randrange(3)):
            frames.append(rng.randbytes(rng.choice((0, 1, 4, 8, 24))))
        return frames
    choice = rng.randrange(6)
    if choice == 0:
        return [rng.randbytes(rng.randrange(1, 64))]
    if choice == 1:
        return [b"[1, 2, 3]"]
    if choice == 2:
        return [b'{"v": 1, "op": "COMMAND", "meta": {"command": "progress", "min_epoch": NaN}}']
    if choice == 3:
        return [b'{"v": 1, "op": "ACK", "doc": 3}', rng.randbytes(3)]
    if choice == 4:
        return [b"{" * rng.randrange(1, 5000)]
    return [b'{"v": 1, "op": "HELLO", "role": "function", "t": [["float32", [2]]]}', rng.randbytes(8)]


def fuzz(peer: Peer, count: int, seed: int) -> None:
    """``count`` random messages; after every :data:`CHECK_EVERY` the server must still answer HELLO."""
    rng = random.Random(seed)
    for i in range(count):
        peer.sock.send_multipart(fuzz_message(rng))
        if (i + 1) % CHECK_EVERY == 0:
            assert_serving(peer)


def run_fuzz(graph_server: GraphServerThread, param_server: ParameterServer, peer_of, count: int) -> None:
    gs, ps = peer_of(graph_server.endpoint), peer_of(param_server.endpoint)
    fuzz(gs, count, seed=1)
    fuzz(ps, count, seed=2)
    # Both still answer a valid request of their own, and counted what they refused.
    assert gs.request(command("progress", min_epoch=1)).op is Op.ACK
    assert ps.request(Header(Op.PULL_WEIGHTS, layer=0, epoch=1, interval=0)).op in (Op.WEIGHTS, Op.ERROR)
    assert_serving(gs)
    assert_serving(ps)
    gs_stats, ps_stats = gs.request(Header(Op.STATS)), ps.request(Header(Op.STATS))
    assert sum(v for k, v in gs_stats.meta.items() if k.startswith("rejected.")) > count // 4
    assert ps_stats.meta["errors"] > count // 4
    assert graph_server.alive() and not param_server.closed


def test_fuzz_10k_messages_against_both_servers(graph_server, param_server, peer_of):
    run_fuzz(graph_server, param_server, peer_of, 10_000)


@pytest.mark.slow
def test_fuzz_100k_messages_against_both_servers(graph_server, param_server, peer_of):
    run_fuzz(graph_server, param_server, peer_of, 100_000)
