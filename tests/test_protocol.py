"""Wire protocol: round trips over real sockets, zero copy, every validation failure, fuzzing."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import zmq

from dorylus import protocol as P
from dorylus.protocol import Bounds, Header, Op, ProtocolError

TIMEOUT = 5.0  # seconds; every receive in this file waits at most this long


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _router_dealer(ctx: zmq.Context, transport: str) -> tuple[zmq.Socket, zmq.Socket]:
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.IDENTITY, b"fn-7")
    if transport == "tcp":
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
    else:
        server.bind("inproc://protocol-test")
        client.connect("inproc://protocol-test")
    return server, client


@pytest.fixture(params=["inproc", "tcp"])
def routed(request, ctx):
    server, client = _router_dealer(ctx, request.param)
    yield server, client
    server.close(linger=0)
    client.close(linger=0)


# ----------------------------------------------------------------------------- sample messages

_rng = np.random.default_rng(0)


def _samples() -> list[tuple[Header, list[np.ndarray]]]:
    f32 = lambda *s: _rng.standard_normal(s).astype(np.float32)  # noqa: E731
    f64 = lambda *s: _rng.standard_normal(s)  # noqa: E731
    row = dict(epoch=3, layer=1, interval=2, rows=(4, 9))
    return [
        (Header(Op.HELLO, req=1, role="function", meta={"pid": 42, "name": "fn", "ok": True, "x": None}), []),
        (Header(Op.READY, req=1), []),
        (Header(Op.PULL, req=2, task="AV_BWD", names=("Z", "G"), **row), []),
        (Header(Op.ROWS, req=2, names=("Z", "labels", "train"), **row),
         [f32(5, 16), _rng.integers(-1, 7, 5), _rng.random(5) < 0.5]),
        (Header(Op.ROWS, req=3, names=("codes", "deg"), **row),
         [_rng.integers(0, 255, (5, 3), dtype=np.uint8), _rng.integers(-9, 9, 5, dtype=np.int32)]),
        (Header(Op.ROWS, req=4, names=("Z",), epoch=0, layer=0, interval=1, rows=(7, 7)), [np.zeros((0, 8))]),
        # sparse features: X's 5 rows as CSR (values, int32 columns, row pointers), then dense ids
        (Header(Op.ROWS, req=14, names=("X", "ids"), csr={"X": 9}, **row),
         [f32(4), np.array([0, 8, 2, 3], np.int32), np.array([0, 2, 2, 3, 3, 4]), _rng.integers(0, 99, 5)]),
        (Header(Op.PUSH, req=5, task="AV_LOSS", attempt=2, names=("dZ",), meta={"loss_sum": 1.25, "correct": 3},
                **row), [f64(5, 3)]),
        (Header(Op.PUSH, req=13, task="AV_LOSS", epoch=1, layer=1, interval=0, rows=(0, 4),
                meta={"correct_val": 2}), []),
        (Header(Op.PUSH, req=6, task="AV", names=("H",), epoch=1, layer=0, interval=0, rows=(0, 0)),
         [np.zeros((0, 4), np.float32)]),
        (Header(Op.ACK, req=5, meta={"duplicate": True}), []),
        (Header(Op.PULL_WEIGHTS, req=7, layer=1, epoch=2, interval=0, version=4), []),
        (Header(Op.WEIGHTS, req=7, layer=1, version=4, names=("W", "b")), [f32(16, 8), f32(8)]),
        (Header(Op.PUSH_GRADS, req=8, layer=1, epoch=2, interval=0, version=4), [f64(16, 8)]),
        (Header(Op.GHOSTS, req=9, task="SC_BWD", epoch=2, layer=1, part=1, rows=(0, 3)), [f32(3, 4)]),
        (Header(Op.SHUTDOWN), []),
        (Header(Op.STATS, req=10, meta={"bad_rows": 2, "uptime_s": 3.5}), []),
        (Header(Op.COMMAND, req=12, meta={"command": "step", "epoch": 3}), []),
        (Header(Op.ERROR, req=11, code="bad_rows", message="row range [5, 3) is reversed"), []),
    ]


SAMPLES = _samples()


def test_samples_cover_every_op():
    assert {h.op for h, _ in SAMPLES} == set(Op)


def _assert_same(got: tuple[Header, list[np.ndarray]], want: tuple[Header, list[np.ndarray]]) -> None:
    (gh, gt), (wh, wt) = got, want
    assert gh == wh
    assert len(gt) == len(wt)
    for g, w in zip(gt, wt):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{h.op.value}-{h.req}" for h, _ in SAMPLES])
def test_round_trip_router_dealer(routed, sample):
    server, client = routed
    header, tensors = sample
    P.send(client, header, tensors)
    identity, *got = P.recv_routed(server, timeout=TIMEOUT)
    assert identity == b"fn-7"
    _assert_same(tuple(got), sample)
    P.send_routed(server, identity, header, tensors)
    _assert_same(P.recv(client, timeout=TIMEOUT), sample)


@pytest.mark.parametrize("copy", [False, True])
def test_round_trip_pair_with_copy_flag(ctx, copy):
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        for sample in SAMPLES:
            P.send(a, *sample, copy=copy)
            _assert_same(P.recv(b, timeout=TIMEOUT, copy=copy), sample)
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_non_contiguous_and_big_endian_tensors_arrive_as_values(routed):
    server, client = routed
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    strided = base[:, ::2]  # non-contiguous
    big_endian = np.arange(6, dtype=">i8")
    header = Header(Op.ROWS, epoch=0, layer=0, interval=0, rows=(2, 8), names=("Z", "ids"))
    P.send(client, header, [strided, big_endian])
    _, _, (z, ids) = P.recv_routed(server, timeout=TIMEOUT)
    np.testing.assert_array_equal(z, strided)
    assert ids.dtype == np.dtype("<i8")
    np.testing.assert_array_equal(ids, np.arange(6))


def test_numpy_integer_fields_are_accepted():
    header = Header(Op.PULL_WEIGHTS, layer=np.int64(1), epoch=np.int32(2), interval=np.uint8(3), req=np.int64(4))
    got, _ = P.decode(P.encode(header))
    assert (got.layer, got.epoch, got.interval, got.req) == (1, 2, 3, 4)


def test_timeout_when_nothing_arrives(routed):
    server, client = routed
    with pytest.raises(TimeoutError):
        P.recv(client, timeout=0.05)
    with pytest.raises(TimeoutError):
        P.recv_routed(server, timeout=0.05)


# ----------------------------------------------------------------------------- zero copy


def _rows_header(n: int) -> Header:
    return Header(Op.ROWS, epoch=0, layer=0, interval=0, rows=(0, n), names=("Z",))


def test_inproc_receiver_sees_sender_memory(ctx):
    """Over inproc nothing is copied end to end: the received array *is* the sent buffer."""
    server, client = _router_dealer(ctx, "inproc")
    try:
        z = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)  # 64 KiB: above pyzmq's copy threshold
        tracker = P.send(client, _rows_header(256), [z], track=True)
        _, _, (got,) = P.recv_routed(server, timeout=TIMEOUT)
        assert np.shares_memory(got, z)
        assert not got.flags.writeable
        with pytest.raises(ValueError):
            got[0, 0] = 1.0  # read-only: a receiver cannot scribble on the sender's rows
        # The tracker tells the sender when z may be overwritten: not while the receiver holds it.
        assert not tracker.done
        del got
        tracker.wait(TIMEOUT)
        assert tracker.done
    finally:
        server.close(linger=0)
        client.close(linger=0)


def test_tcp_received_array_is_a_view_of_the_frame(ctx):
    server, client = _router_dealer(ctx, "tcp")
    try:
        z = _rng.standard_normal((512, 128)).astype(np.float32)
        P.send(client, _rows_header(512), [z])
        assert server.poll(int(TIMEOUT * 1000))
        frames = server.recv_multipart(copy=False)
        header, (got,) = P.decode(frames[1:])
        np.testing.assert_array_equal(got, z)
        frame_addr = np.frombuffer(frames[2].buffer, np.uint8).ctypes.data
        assert got.ctypes.data == frame_addr  # no copy was made in decode
        base = got
        while not isinstance(base, memoryview):
            base = base.base
        assert base.obj is frames[2]  # the array keeps the zmq frame alive
        assert not got.flags.writeable
    finally:
        server.close(linger=0)
        client.close(linger=0)


def test_encode_passes_contiguous_buffers_without_copy():
    z = np.ones((300, 50), np.float32)
    frames = P.encode(_rows_header(300), [z])
    assert np.shares_memory(frames[1], z)


# ----------------------------------------------------------------------------- validation


def _wire(d: dict, *frames: bytes) -> list[bytes]:
    return [json.dumps(d).encode(), *frames]


def _push_dict(**changes) -> dict:
    d = {"v": 1, "op": "PUSH", "req": 17, "task": "AV", "epoch": 1, "layer": 0, "interval": 2,
         "rows": [4, 7], "names": ["H"], "t": [["float32", [3, 2]]]}
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


_H3 = np.zeros((3, 2), np.float32).tobytes()


def _code(frames, **kw) -> str:
    with pytest.raises(ProtocolError) as info:
        P.decode(frames, **kw)
    return info.value.code


def test_valid_push_dict_decodes():
    header, (h,) = P.decode(_wire(_push_dict(), _H3))
    assert header.op is Op.PUSH and header.rows == (4, 7) and h.shape == (3, 2)


@pytest.mark.parametrize("frames, code", [
    ([], "empty"),
    ([b" " * (P.MAX_HEADER_BYTES + 1)], "header_too_large"),
    ([b"\xff\xfe{}"], "bad_header"),
    ([b'{"v": 1, "op"'], "bad_header"),
    ([b"[1, 2]"], "bad_header"),
    ([b'{"v": 1, "op": "STATS", "meta": {"loss": NaN}}'], "bad_header"),
    ([b"[" * 100000 + b"]" * 100000], "header_too_large"),
    ([b"[" * 30000 + b"]" * 30000], "bad_header"),
    (_wire({"v": 1, "op": "FETCH"}), "unknown_op"),
    (_wire({"v": 1, "op": 3}), "unknown_op"),
    (_wire({"v": 1}), "unknown_op"),
    (_wire({"v": 2, "op": "ACK"}), "bad_version"),
    (_wire({"op": "ACK"}), "bad_version"),
    (_wire({"v": "1", "op": "ACK"}), "bad_version"),
    (_wire({"v": True, "op": "ACK"}), "bad_version"),
    (_wire({"v": 1, "op": "ACK", "colour": "red"}), "unknown_field"),
    (_wire(_push_dict(epoch=-1), _H3), "bad_field"),
    (_wire(_push_dict(epoch="1"), _H3), "bad_field"),
    (_wire(_push_dict(epoch=True), _H3), "bad_field"),
    (_wire(_push_dict(epoch=1.0), _H3), "bad_field"),
    (_wire(_push_dict(req=2**63), _H3), "bad_field"),
    (_wire(_push_dict(rows=[4]), _H3), "bad_field"),
    (_wire(_push_dict(rows="4:7"), _H3), "bad_field"),
    (_wire(_push_dict(task="zz"), _H3), "bad_field"),  # a model's task names are upper-case identifiers
    (_wire(_push_dict(task="SC"), _H3), "bad_field"),  # a scatter task in a function PUSH
    (_wire(_push_dict(names=["H", "H"], t=[["float32", [3, 2]]] * 2), _H3, _H3), "bad_field"),
    (_wire(_push_dict(names=["not a name"]), _H3), "bad_field"),
    (_wire(_push_dict(meta={"loss": [1, 2]}), _H3), "bad_field"),
    ([json.dumps(_push_dict(meta={"loss": 1.5})).replace("1.5", "1e999").encode(), _H3], "bad_field"),
    (_wire(_push_dict(meta=[1]), _H3), "bad_field"),
    (_wire(_push_dict(t={"float32": [3, 2]}), _H3), "bad_field"),
    (_wire(_push_dict(t=[["float32"]]), _H3), "bad_field"),
    (_wire({"v": 1, "op": "ERROR", "code": "Bad Code!", "message": "m"}), "bad_field"),
    (_wire({"v": 1, "op": "HELLO", "role": "attacker"}), "bad_field"),
    (_wire(_push_dict(interval=None), _H3), "missing_field"),
    (_wire(_push_dict(rows=None), _H3), "missing_field"),
    (_wire({"v": 1, "op": "ERROR", "message": "m"}), "missing_field"),
    (_wire({"v": 1, "op": "HELLO"}), "missing_field"),
    (_wire({"v": 1, "op": "PUSH_GRADS", "layer": 0, "epoch": 0, "interval": 0, "t": [["float32", [2]]]},
           b"\0" * 8), "missing_field"),
    (_wire(_push_dict(t=[["float16", [3, 2]]]), b"\0" * 12), "bad_dtype"),
    (_wire(_push_dict(t=[["object", [3, 2]]]), _H3), "bad_dtype"),
    (_wire(_push_dict(t=[[4, [3, 2]]]), _H3), "bad_dtype"),
    (_wire({"v": 1, "op": "PUSH_GRADS", "layer": 0, "epoch": 0, "interval": 0, "version": 0,
            "t": [["int64", [2]]]}, b"\0" * 16), "bad_dtype"),
    (_wire(_push_dict(t=[["float32", [3, -2]]]), _H3), "bad_shape"),
    (_wire(_push_dict(t=[["float32", [3, 2.0]]]), _H3), "bad_shape"),
    (_wire(_push_dict(t=[["float32", [3] * 9]]), _H3), "bad_shape"),
    (_wire(_push_dict(t=[["float32", [3, 2, 1]]]), _H3), "bad_shape"),
    (_wire(_push_dict(t=[["float32", []]]), _H3[:4]), "bad_shape"),
    (_wire(_push_dict()), "frame_count"),
    (_wire(_push_dict(), _H3, _H3), "frame_count"),
    (_wire({"v": 1, "op": "ACK"}, b"x"), "frame_count"),
    (_wire(_push_dict(t=[])), "tensor_count"),
    (_wire(_push_dict(names=["H", "dZ"]), _H3), "tensor_count"),
    (_wire({"v": 1, "op": "WEIGHTS", "layer": 0, "version": 1}), "tensor_count"),
    (_wire({"v": 1, "op": "PULL", "task": "AV", "epoch": 0, "layer": 0, "interval": 0, "rows": [0, 1],
            "names": ["Z"], "t": [["float32", [1]]]}, b"\0" * 4), "tensor_count"),
    (_wire(_push_dict(), _H3[:-1]), "frame_length"),
    (_wire(_push_dict(), _H3 + b"\0"), "frame_length"),
    (_wire(_push_dict(t=[["float64", [3, 2]]]), _H3), "frame_length"),
    (_wire(_push_dict(rows=[7, 4]), _H3), "bad_rows"),
    (_wire(_push_dict(rows=[-3, 0]), _H3), "bad_rows"),
    (_wire(_push_dict(rows=[4, 8]), _H3), "row_count"),
    (_wire({"v": 1, "op": "GHOSTS", "task": "SC", "epoch": 0, "layer": 0, "part": 1, "rows": [0, 2],
            "t": [["float32", [3]]]}, b"\0" * 12), "row_count"),
    (_wire(_push_dict(t=[["bool", [3, 2]]]), b"\0\1\2\0\0\0"), "bad_bool"),
])
def test_decode_rejects(frames, code):
    assert code in P.ERROR_CODES
    assert _code(frames) == code


def test_error_carries_request_id_when_readable():
    with pytest.raises(ProtocolError) as info:
        P.decode(_wire(_push_dict(rows=[7, 4]), _H3))
    assert info.value.req == 17
    with pytest.raises(ProtocolError) as info:
        P.decode([b"not json"])
    assert info.value.req is None


@pytest.mark.parametrize("bounds, changes, code", [
    (Bounds(num_rows=7), {}, None),
    (Bounds(num_rows=6), {}, "out_of_range"),
    (Bounds(num_layers=1), {}, None),
    (Bounds(num_layers=1), {"layer": 1}, "out_of_range"),
    (Bounds(intervals=[(0, 4), (4, 6), (4, 7)]), {}, None),
    (Bounds(intervals=[(0, 4), (4, 6), (5, 8)]), {}, "out_of_range"),  # rows start before interval 2
    (Bounds(intervals=[(0, 4), (4, 6)]), {}, "out_of_range"),          # no interval 2
    (Bounds(intervals=[(0, 4), (4, 7), (7, 9)]), {"interval": 1}, None),
])
def test_bounds(bounds, changes, code):
    frames = _wire(_push_dict(**changes), _H3)
    if code is None:
        header, _ = P.decode(frames, bounds)
        assert header.rows == (4, 7)
    else:
        assert _code(frames, bounds=bounds) == code


def test_bounds_on_parts():
    d = {"v": 1, "op": "GHOSTS", "task": "SC", "epoch": 0, "layer": 0, "part": 3, "rows": [0, 1],
         "t": [["float32", [1, 2]]]}
    assert P.decode(_wire(d, b"\0" * 8), Bounds(num_parts=4))[0].part == 3
    assert _code(_wire(d, b"\0" * 8), bounds=Bounds(num_parts=3)) == "out_of_range"


def test_validate_rows():
    header = Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(2, 5), names=("H",))
    assert P.validate_rows(header, 5) == (2, 5)
    with pytest.raises(ProtocolError) as info:
        P.validate_rows(header, 4)
    assert info.value.code == "out_of_range"
    with pytest.raises(ProtocolError) as info:
        P.validate_rows(Header(Op.ACK), 4)
    assert info.value.code == "missing_field"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_finite(bad):
    rows = np.zeros((3, 2), np.float32)
    rows[1, 1] = bad
    frames = _wire(_push_dict(), rows.tobytes())
    assert np.isnan(P.decode(frames)[1][0][1, 1]) == np.isnan(bad)  # accepted unless asked
    assert _code(frames, check_finite=True) == "not_finite"
    ints = _wire(_push_dict(t=[["int32", [3, 2]]]), _H3)
    P.decode(ints, check_finite=True)  # integer tensors cannot be non-finite


@pytest.mark.parametrize("header, tensors, code", [
    (Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(0, 2), names=("H",)),
     [np.zeros((2, 2), np.complex64)], "bad_dtype"),
    (Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(0, 2), names=("H",)),
     [np.zeros((2, 2), np.float16)], "bad_dtype"),
    (Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, names=("H",)), [np.zeros((2, 2))], "missing_field"),
    (Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(0, 3), names=("H",)),
     [np.zeros((2, 2))], "row_count"),
    (Header(Op.PULL, task="AV", epoch=1.5, layer=0, interval=0, rows=(0, 3), names=("H",)), [], "bad_field"),
    (Header(Op.STATS, meta={"loss": float("nan")}), [], "bad_field"),
    (Header(Op.STATS, meta={"blob": object()}), [], "bad_field"),
    (Header("FETCH"), [], "unknown_op"),
    (Header(Op.ERROR, code="x", message="m" * 70000), [], "header_too_large"),
    (Header(Op.ROWS, epoch=0, layer=0, interval=0, rows=(0, 2), names=("m",)),
     [np.array([1, 2], np.uint8).view(bool)], "bad_bool"),
])
def test_encode_rejects(header, tensors, code):
    with pytest.raises(ProtocolError) as info:
        P.encode(header, tensors)
    assert info.value.code == code


# ----------------------------------------------------------------------------- server helpers


def test_router_turns_bad_request_into_error_reply(routed):
    server, client = routed
    counters = P.ProtocolCounters()
    client.send_multipart(_wire(_push_dict(rows=[4, 9]), _H3))  # 3 rows for a 5-row range
    with pytest.raises(ProtocolError) as info:
        P.recv_routed(server, timeout=TIMEOUT)
    exc = info.value
    assert exc.identity == b"fn-7"
    counters.count(exc)
    P.send_routed(server, exc.identity, P.error_reply(None, exc))
    reply, tensors = P.recv(client, timeout=TIMEOUT)
    assert (reply.op, reply.req, reply.code, tensors) == (Op.ERROR, 17, "row_count", [])
    assert "range [4, 9)" in reply.message
    assert counters.as_dict() == {"row_count": 1} and counters.total == 1


def test_dropped_messages_are_counted():
    counters = P.ProtocolCounters()
    for frames in ([b"{"], [b"{"], _wire({"v": 9, "op": "ACK"})):
        try:
            P.decode(frames)
        except ProtocolError as exc:
            counters.count(exc)
    assert counters.as_dict() == {"bad_header": 2, "bad_version": 1}
    assert counters.total == 3
    # the counts fit a STATS reply as they are
    assert P.decode(P.encode(Header(Op.STATS, meta=counters.as_dict())))[0].meta == counters.as_dict()


def test_error_reply_for_server_failure_and_known_request():
    request = Header(Op.PULL_WEIGHTS, req=33, layer=0, epoch=0, interval=0, version=9)
    reply = P.error_reply(request, KeyError("version 9 no longer stashed"))
    assert (reply.op, reply.req, reply.code) == (Op.ERROR, 33, "internal")
    assert "version 9" in reply.message
    P.decode(P.encode(reply))  # the reply itself is a valid message
    long = P.error_reply(None, ProtocolError("bad_field", "x" * 5000))
    assert len(long.message) == P.MAX_MESSAGE_CHARS and long.req == 0
    P.decode(P.encode(long))


def test_reply_to_copies_identity_fields():
    pull = Header(Op.PULL, req=8, task="AV", epoch=2, layer=1, interval=3, rows=(6, 9), names=("Z",), attempt=1)
    rows = P.reply_to(pull, Op.ROWS)
    assert (rows.req, rows.epoch, rows.layer, rows.interval, rows.rows, rows.names, rows.attempt) == \
        (8, 2, 1, 3, (6, 9), ("Z",), 1)
    P.decode(P.encode(rows, [np.zeros((3, 4), np.float32)]))
    weights = P.reply_to(Header(Op.PULL_WEIGHTS, req=4, layer=0, epoch=1, interval=2), Op.WEIGHTS, version=5)
    assert (weights.req, weights.layer, weights.version) == (4, 0, 5)
    assert pull.key == (P.reply_to(pull, Op.PUSH, attempt=2).key)  # attempts share the result key


def test_write_rows_checks_before_writing():
    dest = np.zeros((6, 3), np.float32)
    header = Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(2, 4), names=("H",))
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    P.write_rows(dest, header, rows)
    expected = np.zeros((6, 3), np.float32)
    expected[2:4] = rows
    np.testing.assert_array_equal(dest, expected)

    bad = [
        (Header(Op.PUSH, task="AV", epoch=0, layer=0, interval=0, rows=(5, 7), names=("H",)), rows, "out_of_range"),
        (header, rows.astype(np.float64), "dest_mismatch"),
        (header, np.zeros((2, 4), np.float32), "dest_mismatch"),
        (header, np.zeros(2, np.float32), "dest_mismatch"),
        (header, np.zeros((3, 3), np.float32), "row_count"),
        (Header(Op.ACK), rows, "missing_field"),
    ]
    for h, r, code in bad:
        with pytest.raises(ProtocolError) as info:
            P.write_rows(dest, h, r)
        assert info.value.code == code
    np.testing.assert_array_equal(dest, expected)  # nothing was written by the rejected calls


# ----------------------------------------------------------------------------- fuzzing


def _random_json(rnd: random.Random, depth: int = 0):
    choices = [None, True, False, -1, 0, 1, 2**63, 2**64, 3.5, -0.0, "", "PUSH", "float32", "Z", [], {}]
    if depth < 2 and rnd.random() < 0.3:
        if rnd.random() < 0.5:
            return [_random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
        return {rnd.choice(["v", "op", "a", "rows"]): _random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 2))}
    return rnd.choice(choices)


def _mutate(rnd: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    if not frames:
        return frames
    kind = rnd.randrange(7)
    i = rnd.randrange(len(frames))
    f = bytearray(frames[i])
    if kind == 0 and f:  # flip bytes
        for _ in range(rnd.randint(1, 4)):
            f[rnd.randrange(len(f))] = rnd.randrange(256)
    elif kind == 1:  # truncate
        del f[rnd.randint(0, len(f)):]
    elif kind == 2:  # insert
        pos = rnd.randint(0, len(f))
        f[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
    elif kind == 3:  # drop or duplicate a frame
        if rnd.random() < 0.5:
            del frames[i]
        else:
            frames.insert(i, frames[i])
        return frames
    else:  # structural: replace, add or delete a header field
        try:
            d = json.loads(frames[0])
        except (ValueError, IndexError):  # an earlier mutation already broke the header
            return frames
        if not isinstance(d, dict):
            return frames
        key = rnd.choice(sorted(d) + ["meta", "colour", "part", "version"])
        if kind == 4:
            d.pop(key, None)
        elif kind == 5 and isinstance(d.get("t"), list) and d["t"]:
            d["t"][rnd.randrange(len(d["t"]))] = _random_json(rnd)
        else:
            d[key] = _random_json(rnd)
        return [json.dumps(d).encode(), *frames[1:]]
    frames[i] = bytes(f)
    return frames


def test_fuzzed_messages_raise_only_protocol_errors():
    rnd = random.Random(1234)
    valid = [[bytes(f) for f in P.encode(h, t)] for h, t in SAMPLES]
    bounds = Bounds(num_rows=10, num_layers=2, num_parts=2, intervals=[(0, 4), (4, 9), (4, 9)])
    outcomes = {"ok": 0, "error": 0}
    for n in range(1500):
        frames = _mutate(rnd, rnd.choice(valid))
        if rnd.random() < 0.3:
            frames = _mutate(rnd, frames)
        try:
            header, tensors = P.decode(frames, bounds if n % 2 else None, check_finite=n % 3 == 0)
        except ProtocolError as exc:
            assert exc.code in P.ERROR_CODES
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        # whatever got through is self-consistent and re-encodes to an equal message
        assert len(tensors) == len(frames) - 1
        for t, f in zip(tensors, frames[1:]):
            assert t.nbytes == len(f) and not t.flags.writeable
        if header.rows is not None and tensors and P._OPS[header.op].row_tensors:
            dense = [t for (_, role), t in zip(P._tensor_roles(header), tensors) if role == P.ROWS_ROLE]
            assert all(t.shape[0] == header.rows[1] - header.rows[0] for t in dense)
        again = P.decode(P.encode(header, tensors))
        assert again[0] == header
    assert outcomes["error"] > 500 and outcomes["ok"] > 50  # both paths were exercised


# ----------------------------------------------------------------------------- packaging


def test_imports_without_torch_or_other_dorylus_modules():
    code = (
        "import sys; sys.modules['torch'] = None; import dorylus.protocol; "
        "extra = sorted(m for m in sys.modules if m.startswith('dorylus') and m not in ('dorylus', 'dorylus.protocol')); "
        "assert not extra, extra; assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- sparse rows


def test_rows_reply_carries_sparse_rows_as_csr():
    from dorylus.models.sparse import SparseRows

    x = np.where(_rng.random((10, 6)) < 0.3, _rng.standard_normal((10, 6)), 0).astype(np.float32)
    features = SparseRows.from_dense(x)
    pull = Header(Op.PULL, req=5, task="AV", epoch=1, layer=0, interval=1, rows=(3, 8), names=("X", "ids"))
    reply, tensors = P.rows_reply(pull, [features[3:8], np.arange(3, 8)])
    assert reply.op is Op.ROWS and reply.req == 5 and reply.csr == {"X": 6} and len(tensors) == 4
    header, arrays = P.decode(P.encode(reply, tensors))
    assert header.csr == {"X": 6}
    got_x, got_ids = P.named_rows(header, arrays)
    assert isinstance(got_x, P.CsrRows) and got_x.width == 6
    rebuilt = SparseRows(got_x.data, got_x.indices, got_x.indptr, (5, got_x.width))
    np.testing.assert_array_equal(rebuilt.toarray(), x[3:8])
    np.testing.assert_array_equal(got_ids, np.arange(3, 8))
    dense_reply, dense = P.rows_reply(pull, [x[3:8], np.arange(3, 8)])  # dense rows: no csr, as before
    assert dense_reply.csr == {} and "csr" not in json.loads(P.encode(dense_reply, dense)[0])


def _rows_dict(**changes) -> dict:
    """A ROWS reply carrying X [rows 4..7) as CSR with 4 columns: values, columns, pointers."""
    d = {"v": 1, "op": "ROWS", "req": 9, "epoch": 1, "layer": 0, "interval": 2, "rows": [4, 7], "names": ["X"],
         "csr": {"X": 4}, "t": [["float32", [3]], ["int32", [3]], ["int64", [4]]]}
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


_VALUES = np.ones(3, np.float32).tobytes()
_COLUMNS = np.array([1, 3, 0], np.int32).tobytes()      # row 0: columns 1, 3; row 2: column 0
_POINTERS = np.array([0, 2, 2, 3], np.int64).tobytes()


def test_valid_csr_rows_decode():
    header, (values, columns, pointers) = P.decode(_wire(_rows_dict(), _VALUES, _COLUMNS, _POINTERS))
    assert header.csr == {"X": 4} and pointers.tolist() == [0, 2, 2, 3]


@pytest.mark.parametrize("frames, message", [
    (_wire(_rows_dict(csr={"Y": 4}), _VALUES, _COLUMNS, _POINTERS), r"csr names \['Y'\] are not in names"),
    (_wire(_rows_dict(csr={"X": -1}), _VALUES, _COLUMNS, _POINTERS), "csr must map tensor names to column counts"),
    (_wire(_rows_dict(csr=["X"]), _VALUES, _COLUMNS, _POINTERS), "csr must map tensor names to column counts"),
    (_wire(_push_dict(csr={"H": 2}), _H3), "PUSH cannot carry CSR rows"),
    (_wire(_rows_dict(t=[["float64", [3]], ["int32", [3]], ["int64", [4]]]), _VALUES * 2, _COLUMNS, _POINTERS),
     "CSR values of 'X' must be 1-D float32, got float64"),
    (_wire(_rows_dict(t=[["float32", [3, 1]], ["int32", [3]], ["int64", [4]]]), _VALUES, _COLUMNS, _POINTERS),
     "CSR values of 'X' must be 1-D float32"),
    (_wire(_rows_dict(t=[["float32", [3]], ["float32", [3]], ["int64", [4]]]), _VALUES, _VALUES, _POINTERS),
     "CSR column indices of 'X' must be 1-D int32 or int64, got float32"),
    (_wire(_rows_dict(t=[["float32", [3]], ["int32", [2]], ["int64", [4]]]), _VALUES, _COLUMNS[:8], _POINTERS),
     "CSR of 'X' has 3 values but 2 column indices"),
    (_wire(_rows_dict(t=[["float32", [3]], ["int32", [3]], ["int32", [4]]]), _VALUES, _COLUMNS, _POINTERS[:16]),
     "CSR row pointers of 'X' must be 1-D int64"),
    (_wire(_rows_dict(t=[["float32", [3]], ["int32", [3]], ["int64", [3]]]), _VALUES, _COLUMNS, _POINTERS[:24]),
     r"CSR row pointers of 'X' must have 4 entries \(rows \[4, 7\) \+ 1\), got 3"),
    (_wire(_rows_dict(), _VALUES, _COLUMNS, np.array([0, 2, 1, 3], np.int64).tobytes()),
     "row pointers of 'X' must rise from 0 to nnz = 3"),
    (_wire(_rows_dict(), _VALUES, _COLUMNS, np.array([0, 2, 2, 2], np.int64).tobytes()),
     "row pointers of 'X' must rise from 0 to nnz = 3"),
    (_wire(_rows_dict(), _VALUES, np.array([1, 4, 0], np.int32).tobytes(), _POINTERS),
     r"column indices of 'X' must be in \[0, 4\)"),
    (_wire(_rows_dict(), _VALUES, np.array([3, 1, 0], np.int32).tobytes(), _POINTERS),
     "column indices of 'X' must ascend strictly within each row"),
    (_wire(_rows_dict(), _VALUES, np.array([1, 1, 0], np.int32).tobytes(), _POINTERS),
     "column indices of 'X' must ascend strictly within each row"),
])
def test_malformed_csr_is_a_protocol_error(frames, message):
    with pytest.raises(ProtocolError, match=message) as info:
        P.decode(frames)
    assert info.value.code == "bad_sparse" and info.value.req in (9, 17)  # the ERROR reply can name the request


def test_malformed_csr_payload_count_and_length():
    # two tensors where the CSR needs three, and a frame shorter than its spec: the generic codes
    assert _code(_wire(_rows_dict(t=[["float32", [3]], ["int32", [3]]]), _VALUES, _COLUMNS)) == "tensor_count"
    assert _code(_wire(_rows_dict(), _VALUES, _COLUMNS, _POINTERS[:-8])) == "frame_length"


def test_sender_learns_about_a_bad_csr_payload():
    header = Header(Op.ROWS, epoch=1, layer=0, interval=0, rows=(0, 3), names=("X",), csr={"X": 4})
    with pytest.raises(ProtocolError, match="must ascend strictly") as info:
        P.encode(header, [np.ones(3, np.float32), np.array([3, 1, 0], np.int32), np.array([0, 2, 2, 3])])
    assert info.value.code == "bad_sparse"


# ----------------------------------------------------------------------------- epochs and addresses


@pytest.mark.parametrize("current, staleness", [(1, 0), (3, 2), (10, 0)])
def test_check_epoch_refuses_only_epochs_beyond_current_plus_staleness_plus_one(current, staleness):
    limit = current + staleness + 1
    for epoch in (1, current, limit):
        P.check_epoch(Header(Op.GHOSTS, epoch=epoch), current, staleness)
    P.check_epoch(Header(Op.HELLO), current, staleness)  # no epoch: nothing to check
    for epoch in (limit + 1, 10**12):
        with pytest.raises(ProtocolError) as err:
            P.check_epoch(Header(Op.PUSH_GRADS, epoch=epoch, req=7), current, staleness)
        assert (err.value.code, err.value.req) == ("epoch_ahead", 7)
        assert f"epoch {epoch} is beyond {limit}" in err.value.message


def test_advertised_endpoint():
    from dorylus.endpoints import advertised_endpoint
    from dorylus.errors import ConfigError

    assert advertised_endpoint("tcp://0.0.0.0:5500", None) == "tcp://0.0.0.0:5500"
    assert advertised_endpoint("tcp://0.0.0.0:5500", "10.42.1.64") == "tcp://10.42.1.64:5500"
    assert advertised_endpoint("tcp://127.0.0.1:41234", "gs-0.internal:7000") == "tcp://gs-0.internal:7000"
    assert advertised_endpoint("tcp://[::]:5500", "[fd00::5]") == "tcp://[fd00::5]:5500"
    for bad in ("0.0.0.0", "*:5500", "host:0", "host:99999", "tcp://host:1", "a b"):
        with pytest.raises(ConfigError, match="--advertise"):
            advertised_endpoint("tcp://0.0.0.0:5500", bad)
    with pytest.raises(ConfigError, match="only a tcp:// endpoint"):
        advertised_endpoint("ipc:///tmp/x", "host")
