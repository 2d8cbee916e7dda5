"""Graph-server physics and staleness correction, in-process: the emulated network delays a
graph server's messages by latency and bytes / bandwidth, compute jitter stretches its stages by
a seeded factor, ghost rows not needed yet are sent in the background (failures still surface),
and --stale-correction smooths the training pass's ghost rows and gradients (PipeGCN)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dorylus import cli, protocol
from dorylus.config import TrainConfig
from dorylus.emulator.physics import AWS_NET_LIKE, NetPhysics
from dorylus.errors import ConfigError
from dorylus.models.base import GATHER, Stage
from dorylus.protocol import Op, ProtocolError
from graphserver.modes import EVAL_SUFFIX, evaluation_apart, get_mode
from graphserver.invoker import TaskFailed
from graphserver.server import AsyncPeer, GraphServer, Refused

TIMEOUT_S = 20.0


class AckPeer:
    """A ROUTER that answers every request with ACK (or with ERROR ``refuse`` when given)."""

    def __init__(self, refuse: str | None = None):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.refuse, self.received = refuse, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(20):
                continue
            identity, header, _ = protocol.recv_routed(self.socket)
            self.received.append((header.epoch, time.monotonic()))
            reply = (protocol.error_reply(header, ProtocolError(self.refuse, "no")) if self.refuse
                     else protocol.reply_to(header, Op.ACK))
            protocol.send_routed(self.socket, identity, reply)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close(linger=0)
        self.ctx.term()


@pytest.fixture
def ack_peer():
    peer = AckPeer()
    yield peer
    peer.close()


def stand_in(peer_endpoint: str | None, ctx, physics: NetPhysics = NetPhysics(), **config) -> SimpleNamespace:
    """What GraphServer's send, receive and stage methods read of their server."""
    server = SimpleNamespace(
        config=SimpleNamespace(**{"task_timeout_s": TIMEOUT_S, "seed": 7, "stale_correction": False,
                                  "stale_gamma": 0.9, **config}),
        counters=defaultdict(float), part_id=0, GHOSTS_RETRY_S=0.01, physics=physics, sending={}, smoothed={},
        inbox=defaultdict(dict), inbox_changed=asyncio.Event(), peers={},
        mode=get_mode("async", config.get("staleness", 1)))
    if peer_endpoint is not None:
        server.peers[1] = AsyncPeer(ctx, peer_endpoint, "graph server 1", server_role="graphserver", keys=None,
                                    max_bytes=8 << 20, physics=physics)
    for name in ("send_ghosts", "_send_all", "_send_after", "raise_failed_sends", "finish_sends", "_receive",
                 "_corrects", "_smooth", "_stage_in_thread", "run_in_thread"):
        setattr(server, name, getattr(GraphServer, name).__get__(server))
    server.executor = None  # run_in_thread: the loop's default executor
    return server


def run_with_peer(peer: AckPeer | None, body, physics: NetPhysics = NetPhysics(), **config):
    async def main():
        ctx = zmq.asyncio.Context()
        server = stand_in(peer.endpoint if peer else None, ctx, physics, **config)
        try:
            return await asyncio.wait_for(body(server), TIMEOUT_S)
        finally:
            for p in server.peers.values():
                p.close()
            ctx.term()

    return asyncio.run(main())


# ----------------------------------------------------------------------------- the figures


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    physics = NetPhysics(latency_ms=2.0, bandwidth_mbps=80.0)
    assert physics.transfer_s(0) == pytest.approx(0.002)
    assert physics.transfer_s(1_000_000) == pytest.approx(0.002 + 8e6 / 80e6)
    assert NetPhysics(latency_ms=1.0).transfer_s(10**9) == pytest.approx(0.001)  # 0: unlimited
    assert not NetPhysics(compute_jitter=0.5).network and AWS_NET_LIKE.network


def test_jitter_is_seeded_never_faster_and_log_normal():
    physics = NetPhysics(compute_jitter=0.3)
    assert physics.slowdown(1, 0, 0, 5, 9, 1, 0) == physics.slowdown(1, 0, 0, 5, 9, 1, 0)
    factors = np.array([physics.slowdown(0, 0, 0, e, 1, 0, i) for e in range(500) for i in range(4)])
    assert factors.min() >= 1.0
    assert len(set(factors.tolist())) == len(factors)  # every stage draws its own
    # log factor = 0.3 |z|: its median is 0.3 x 0.6745 (the half-normal's), within sampling error
    assert np.median(np.log(factors)) == pytest.approx(0.3 * 0.6745, rel=0.1)
    assert NetPhysics().slowdown(0, 1, 2) == 1.0


@pytest.mark.parametrize("flag, value, needle", [
    ("--net-latency-ms", "-1", "net_latency_ms"), ("--net-bandwidth-mbps", "nan", "net_bandwidth_mbps"),
    ("--compute-jitter", "3", "compute_jitter"), ("--stale-gamma", "1", "stale_gamma"),
    ("--stale-correction", None, "stale_correction needs --mode async with --staleness >= 1"),
])
def test_bad_physics_and_correction_options_are_one_line_exit_2_nothing_written(tmp_path, capsys, flag, value,
                                                                                 needle):
    args = ["train", "--dataset", "synthetic-small", "--run-dir", str(tmp_path / "run"), flag]
    assert cli.main(args + ([value] if value is not None else [])) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_aws_like_sets_the_graph_server_figures():
    assert TrainConfig(aws_like=True, net_latency_ms=9.0).graph_server_physics() == AWS_NET_LIKE
    assert TrainConfig(net_latency_ms=0.5, compute_jitter=0.2).graph_server_physics() == \
        NetPhysics(latency_ms=0.5, compute_jitter=0.2)
    assert TrainConfig(mode="async", staleness=1, stale_correction=True).stale_gamma == 0.5
    with pytest.raises(ConfigError, match="staleness >= 1"):
        TrainConfig(mode="async", staleness=0, stale_correction=True)


# ----------------------------------------------------------------------------- where the delays act


def test_a_ghost_send_takes_latency_and_bandwidth_both_ways(ack_peer):
    physics = NetPhysics(latency_ms=40.0, bandwidth_mbps=100.0)
    rows = np.ones((10_000, 25), np.float32)  # 1 MB: 80 ms at 100 Mbit/s

    async def body(server):
        start = time.monotonic()
        await server.send_ghosts("SC", "train", 1, 0, "H", {1: rows})
        return start, time.monotonic()

    start, end = run_with_peer(ack_peer, body, physics)
    (_, arrived), = ack_peer.received
    # lower bounds only: a loaded machine adds time, never removes it
    assert arrived - start >= physics.transfer_s(rows.nbytes) - 1e-3
    assert end - arrived >= physics.transfer_s(0) - 1e-3  # the ACK's way back
    assert end - start >= 0.16


def test_no_physics_no_delay(ack_peer):
    async def body(server):
        start = time.monotonic()
        await server.send_ghosts("SC", "train", 1, 0, "H", {1: np.ones((4, 2), np.float32)})
        return time.monotonic() - start

    assert run_with_peer(ack_peer, body) < 5.0  # completes; and the stand-in's peer has no link
    peer = AsyncPeer(zmq.asyncio.Context.instance(), ack_peer.endpoint, "x", server_role="graphserver", keys=None,
                     max_bytes=1 << 20, physics=NetPhysics(compute_jitter=1.0))
    assert peer.physics is None
    peer.close()


def test_compute_jitter_stretches_a_stage_by_its_seeded_factor():
    physics = NetPhysics(compute_jitter=1.0)
    stage = Stage(GATHER, "GA", 1, ("P1",), ("G1",))

    async def body(server):
        start = time.monotonic()
        result = await server._stage_in_thread(stage, "train", 3, 1, lambda x: time.sleep(0.05) or x, 42)
        return result, time.monotonic() - start, server.counters["jitter_s"]

    result, elapsed, jitter_s = run_with_peer(None, body, physics)
    import zlib

    factor = physics.slowdown(7, 0, 0, 3, zlib.crc32(b"GA"), 1, 1)
    assert result == 42 and factor > 1
    assert jitter_s >= 0.05 * (factor - 1) - 1e-6
    assert elapsed >= 0.05 * factor - 1e-3


# ----------------------------------------------------------------------------- background ghost sends


def test_rows_not_needed_yet_are_sent_in_the_background_and_all_arrive_in_order(ack_peer):
    physics = NetPhysics(latency_ms=30.0)

    async def body(server):
        start = time.monotonic()
        for epoch in (1, 2, 3):
            done = server._send_all("SC", "train", epoch, 0, [("H", {1: np.full((3, 2), epoch, np.float32)})],
                                    wait=False)
            assert done.done()
        returned = time.monotonic() - start
        await server.finish_sends()
        return returned, time.monotonic() - start

    returned, finished = run_with_peer(ack_peer, body, physics)
    assert [e for e, _ in ack_peer.received] == [1, 2, 3]  # one send per buffer at a time, in epoch order
    assert finished >= 3 * 2 * 0.03 - 1e-3  # three round trips, one after the other
    assert returned < finished


def test_a_failed_background_send_fails_the_next_exchange():
    peer = AckPeer(refuse="bad_field")

    async def body(server):
        server._send_all("SC", "train", 1, 0, [("H", {1: np.ones((3, 2), np.float32)})], wait=False)
        while not all(t.done() for t in server.sending.values()):
            await asyncio.sleep(0.01)
        with pytest.raises(Refused, match="bad_field"):
            server._send_all("SC", "train", 2, 0, [("H", {1: np.ones((3, 2), np.float32)})], wait=False)
        for task in server.sending.values():
            task.cancel()

    try:
        run_with_peer(peer, body)
    finally:
        peer.close()


# ----------------------------------------------------------------------------- staleness correction


def receive(server, pass_: str, epoch: int, task: str = "SC") -> np.ndarray:
    async def go():
        return await server._receive(task, pass_, epoch, 0, "H", epoch - 1, [])

    return asyncio.get_event_loop().run_until_complete(go())[1]


def test_stale_correction_smooths_stale_rows_folding_each_version_once_in_the_training_pass_only():
    gamma = 0.9
    server = stand_in(None, None, stale_correction=True, stale_gamma=gamma)
    server.peers = {1: None}
    versions = {e: np.random.default_rng(e).standard_normal((5, 3)).astype(np.float32) for e in (1, 2, 3, 4)}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        oracle = None
        for task in ("SC", "SC_BWD"):
            oracle = None
            for epoch, rows in versions.items():
                server.inbox[("train", task, "H")][1] = (epoch, rows)
                server.inbox[("eval", task, "H")][1] = (epoch, rows)
                oracle = rows.astype(np.float64) if oracle is None else gamma * oracle + (1 - gamma) * rows
                # read twice, fresh (as received) and then stale by the next epoch (the average): folded in once
                np.testing.assert_array_equal(receive(server, "train", epoch, task), rows)
                np.testing.assert_allclose(receive(server, "train", epoch + 1, task), oracle, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(receive(server, "eval", epoch + 1, task), rows)  # as received
        assert server.counters["stale_corrections"] == 2 * 3  # per buffer and peer, every version after the first
        server.config.stale_correction = False
        server.inbox[("train", "SC", "H")][1] = (4, versions[4])
        np.testing.assert_array_equal(receive(server, "train", 5), versions[4])
    finally:
        loop.close()
        asyncio.set_event_loop(None)


@pytest.mark.parametrize("staleness, pass_, tag, kept", [
    (0, "train", 3, False),  # sync, pipe, async S=0: the next exchange needs epoch 4's rows
    (1, "train", 3, True),   # S = 1: epoch 4 may still take epoch 3's rows
    (1, "train", 2, False),  # ... but not epoch 2's
    (2, "train", 2, True),
    (1, "eval", 3, False),   # evaluation is exact: epoch 4 needs its own rows
])
def test_received_rows_are_let_go_once_no_later_exchange_can_take_them(staleness, pass_, tag, kept):
    """The inbox drops rows once used when no later exchange can take them (a ghost-sized copy
    per buffer, pass and direction otherwise); the next epoch waits for new rows, and a late
    duplicate of the used epoch is not taken for them."""
    rows = np.arange(15, dtype=np.float32).reshape(5, 3)
    server = stand_in(None, None, staleness=staleness, task_timeout_s=0.2)
    server.peers = {1: None}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        server.inbox[(pass_, "SC", "H")][1] = (tag, rows)
        got = loop.run_until_complete(server._receive("SC", pass_, 3, 0, "H", tag, []))
        np.testing.assert_array_equal(got[1], rows)
        held_tag, held = server.inbox[(pass_, "SC", "H")][1]
        assert held_tag == tag and (held is rows) == kept and (held is None) == (not kept)
        if not kept:  # a later exchange that would take these rows (a rollback) waits instead
            with pytest.raises(TaskFailed, match=f"no rows of epoch >= {tag}"):
                loop.run_until_complete(server._receive("SC", pass_, 3, 0, "H", tag, []))
    finally:
        loop.close()
        asyncio.set_event_loop(None)


# ----------------------------------------------------------------------------- evaluation apart


def test_the_evaluation_pass_gets_buffers_of_its_own():
    from dorylus.models import get_model
    from dorylus.models.spec import ModelSpec

    plan = get_model("gcn").build_plan(ModelSpec.from_config(TrainConfig(), 12, 3))
    apart = evaluation_apart(plan)
    assert apart.train == plan.train
    for before, after in zip(plan.evaluate, apart.evaluate):
        for names, renamed in ((before.reads, after.reads), (before.writes, after.writes)):
            assert renamed == tuple(n if n in ("X", "ids", "labels", "split") else n + EVAL_SUFFIX for n in names)
    train_names = {n for s in apart.train for n in (*s.reads, *s.writes)}
    eval_names = {n for s in apart.evaluate for n in (*s.reads, *s.writes)}
    assert train_names & eval_names <= {"X", "ids", "labels", "split"}
    assert all(apart.widths[n] == plan.widths[n[: -len(EVAL_SUFFIX)]] for n in eval_names if n.endswith(EVAL_SUFFIX))
    assert apart.ghosted == plan.ghosted | {n + EVAL_SUFFIX for n in plan.ghosted}
    assert math.isclose(apart.ghost_columns(False), plan.ghost_columns(False))
