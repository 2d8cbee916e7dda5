"""Parameter server over real sockets: named parameters per layer (validated pushes), init,
pull/push/step against torch.optim, order independence, duplicates, the weight stash (pin / stash / newest, pins released by their epoch's step), the
self-stepping server (configure), deferred replies (wait_version, get_state of a future version),
past states, bad messages, checkpoints, and the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from dorylus import protocol as P
from dorylus.config import TrainConfig
from dorylus.models.base import param_key
from dorylus.models.spec import ModelSpec
from dorylus.paramserver import KEPT_STATES, ParameterServer, ParamServerError
from dorylus.protocol import Header, Op

TIMEOUT = 5.0  # seconds; every receive and join in this file waits at most this long
QUIET = 0.2    # seconds: how long a deferred reply must stay unsent to count as "not yet"
SEED = 7
F, C = 5, 3
REPO = Path(__file__).resolve().parents[1]


def _spec(hidden: int = 4, **overrides) -> ModelSpec:
    # weight_decay_scope "first": layer 0 decays, layer 1 does not, so per-layer decay is exercised
    return ModelSpec.from_config(TrainConfig(layers=2, hidden=hidden, **overrides), F, C)


SPEC = _spec()
NAMES = ("weight", "bias")  # GCN's parameters per layer, in its order


def _flat(params: dict[str, np.ndarray]) -> np.ndarray:
    """A layer's parameters as one vector (in the model's order): what the tests compare, and
    element-wise arithmetic on it is each parameter's."""
    return np.concatenate([np.asarray(params[name]).ravel() for name in params])


def _layers(arrays: dict[str, np.ndarray], spec: ModelSpec = SPEC) -> list[np.ndarray]:
    """Per layer, :func:`_flat` of the ``layers.<l>.<name>`` entries of ``arrays``."""
    return [_flat({name: arrays[param_key(l, name)] for name in shapes}) for l, shapes in enumerate(spec.param_shapes())]


def _init(spec: ModelSpec = SPEC, seed: int = SEED) -> list[np.ndarray]:
    return [_flat(params) for params in spec.init_params(seed)]


class Client:
    """A DEALER peer (like a tensor function) whose every receive times out."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.req = 0

    def send(self, header: Header, tensors=()) -> int:
        """Send a request without waiting for its reply; returns its request id."""
        self.req += 1
        P.send(self.sock, Header(**{**header.__dict__, "req": self.req}), tensors)
        return self.req

    def request(self, header: Header, tensors=()) -> tuple[Header, list[np.ndarray]]:
        req = self.send(header, tensors)
        reply, out = P.recv(self.sock, timeout=TIMEOUT)
        assert reply.req == req
        return reply, out

    def quiet(self) -> bool:
        """True when no reply arrives within ``QUIET`` s."""
        return not self.sock.poll(int(QUIET * 1000), zmq.POLLIN)

    def waiting(self) -> bool:
        """True when the server has received this peer's earlier (deferred) request and not answered
        it yet: a STATS probe sent now is answered first (one socket keeps the order both ways)."""
        probe = self.send(Header(Op.STATS))
        reply, _ = P.recv(self.sock, timeout=TIMEOUT)
        return reply.req == probe and reply.op == Op.STATS

    def answer(self, req: int) -> tuple[Header, list[np.ndarray]]:
        """The (deferred) reply to request ``req``; it must arrive within ``TIMEOUT`` s."""
        reply, out = P.recv(self.sock, timeout=TIMEOUT)
        assert reply.req == req
        return reply, out

    def raw(self, frames: list[bytes]) -> tuple[Header, list[np.ndarray]]:
        self.sock.send_multipart(frames)
        return P.recv(self.sock, timeout=TIMEOUT)

    def ok(self, header: Header, tensors=()) -> tuple[Header, list[np.ndarray]]:
        reply, out = self.request(header, tensors)
        assert reply.op != Op.ERROR, f"{reply.code}: {reply.message}"
        return reply, out

    # the operations of a tensor function and of the coordinator
    def pull(self, layer: int, epoch: int, interval: int, version: int | None = None, part: int = 0, **meta):
        reply, w = self.fetch(layer, epoch, interval, version=version, part=part, **meta)
        return reply.version, w

    def fetch(self, layer: int, epoch: int, interval: int, weights: str | None = None, version: int | None = None,
              part: int = 0, **meta) -> tuple[Header, np.ndarray]:
        """PULL_WEIGHTS with ``meta["weights"] = weights`` (omitted when None); the reply and the
        layer's parameters (:func:`_flat`), which come by name, in the model's order."""
        if weights is not None:
            meta["weights"] = weights
        reply, tensors = self.ok(Header(Op.PULL_WEIGHTS, layer=layer, epoch=epoch, interval=interval,
                                        version=version, part=part, meta=meta))
        assert reply.op == Op.WEIGHTS and reply.layer == layer and reply.names == NAMES
        return reply, _flat(dict(zip(reply.names, tensors)))

    def push(self, layer: int, epoch: int, interval: int, grads: dict[str, np.ndarray], part: int = 0,
             version: int = 0, attempt: int = 0) -> bool:
        reply, _ = self.ok(Header(Op.PUSH_GRADS, layer=layer, epoch=epoch, interval=interval, version=version,
                                  attempt=attempt, names=tuple(grads), meta={"part": part}), list(grads.values()))
        assert reply.op == Op.ACK
        return reply.meta["duplicate"]

    def command(self, name: str, **meta) -> tuple[Header, list[np.ndarray]]:
        return self.request(Header(Op.COMMAND, meta={"command": name, **meta}))

    def weights(self) -> list[np.ndarray]:
        """Every layer's parameters (:func:`_flat`), from get_weights."""
        reply, out = self.ok(Header(Op.COMMAND, meta={"command": "get_weights"}))
        assert reply.op == Op.WEIGHTS and reply.names == tuple(param_key(l, n) for l in range(2) for n in NAMES)
        assert all(t.dtype == np.float32 for t in out)
        return _layers(dict(zip(reply.names, out)))

    def stats(self) -> dict:
        reply, _ = self.ok(Header(Op.STATS))
        return reply.meta

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def cluster(ctx):
    """``make(**kwargs) -> (server, client)``, and ``make.connect(server) -> client`` for another
    peer (one that waits on a deferred reply); every client and server is closed (loop joined)
    afterwards."""
    servers, clients = [], []

    def connect(server: ParameterServer) -> Client:
        clients.append(Client(ctx, server.endpoint))
        return clients[-1]

    def make(spec: ModelSpec = SPEC, optimizer: str = "adam", lr: float = 0.01, **options):
        server = ParameterServer(spec, SEED, optimizer, lr, **options).start()
        servers.append(server)
        return server, connect(server)

    make.connect = connect
    yield make
    for client in clients:
        client.close()
    for server in servers:
        server.close(timeout=TIMEOUT)


def _grads(rng: np.random.Generator, parts: int, intervals: int, spec: ModelSpec = SPEC):
    """``{(part, interval): [{name: gradient} of layer 0, of layer 1]}``: one contribution per function call."""
    return {(p, i): [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
                     for shapes in spec.param_shapes()]
            for p in range(parts) for i in range(intervals)}


def _summed_named(contributions: dict, layer: int) -> dict[str, np.ndarray]:
    """The documented reduction, per parameter: float64 accumulation in sorted (part, interval)
    order, one rounding."""
    totals = {}
    for name, first in contributions[min(contributions)][layer].items():
        total = np.zeros_like(first, dtype=np.float64)
        for key in sorted(contributions):
            total += contributions[key][layer][name]
        totals[name] = total.astype(np.float32)
    return totals


def _summed(contributions: dict, layer: int) -> np.ndarray:
    return _flat(_summed_named(contributions, layer))


def _push_epoch(client: Client, epoch: int, contributions: dict, order=None) -> None:
    for part, interval in order or contributions:
        for layer, grad in enumerate(contributions[(part, interval)]):
            assert client.push(layer, epoch, interval, grad, part=part) is False


# ----------------------------------------------------------------------------- basics


def test_hello_and_initial_weights(cluster):
    server, client = cluster()
    reply, _ = client.ok(Header(Op.HELLO, role="coordinator"))
    assert reply.op == Op.READY and reply.meta["num_layers"] == 2 and reply.meta["version"] == 0
    expected = _init()
    for got, want in zip(client.weights(), expected):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    for layer in range(2):
        version, w = client.pull(layer, epoch=1, interval=0)
        assert version == 0
        np.testing.assert_array_equal(w, expected[layer])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_steps_equal_torch_optimizer_on_summed_gradients(cluster, optimizer):
    """Three epochs over 2 parts x 3 intervals equal torch.optim on the summed gradient per epoch."""
    server, client = cluster(optimizer=optimizer, lr=0.05)
    params = [{name: torch.tensor(w, requires_grad=True) for name, w in layer.items()}
              for layer in SPEC.init_params(SEED)]
    # every parameter its own group, with its layer's decay (biases included)
    groups = [{"params": [p], "weight_decay": layer.weight_decay} for layer_params, layer in zip(params, SPEC.layers)
              for p in layer_params.values()]
    oracle = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(groups, lr=0.05)
    assert SPEC.layers[0].weight_decay > 0 and SPEC.layers[1].weight_decay == 0

    rng = np.random.default_rng(1)
    for epoch in (1, 2, 3):
        contributions = _grads(rng, parts=2, intervals=3)
        for (part, interval) in contributions:  # forward pulls: everyone sees the current version
            for layer in range(2):
                version, w = client.pull(layer, epoch, interval, part=part)
                assert version == epoch - 1
                want = _flat({name: p.detach().numpy() for name, p in params[layer].items()})
                np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-7)
        _push_epoch(client, epoch, contributions)
        reply, _ = client.command("step", epoch=epoch, expected=6)
        assert reply.op == Op.ACK and reply.meta == {"version": epoch, "grads": 12}

        for layer, layer_params in enumerate(params):
            for name, grad in _summed_named(contributions, layer).items():
                layer_params[name].grad = torch.from_numpy(grad)
        oracle.step()
        for got, want in zip(client.weights(), params):
            np.testing.assert_allclose(got, _flat({n: p.detach().numpy() for n, p in want.items()}), rtol=1e-6,
                                       atol=1e-7)
    stats = client.stats()
    assert (stats["steps"], stats["pushes"], stats["pulls"], stats["version"]) == (3, 36, 36, 3)  # a push per layer
    assert stats["pending_grads"] == 0 and stats["pinned"] == 0 and stats["stashed_versions"] == 1
    assert stats["bytes_in"] > 36 * SPEC.layers[0].in_dim * 4 and stats["bytes_out"] > 0


def test_arrival_order_does_not_change_the_result(cluster):
    """Contributions whose float sum depends on order (2^60 + 1 - 2^60) give bitwise-equal weights."""
    rng = np.random.default_rng(2)
    contributions = _grads(rng, parts=2, intervals=2)
    for key, value in {(0, 0): 2.0**60, (0, 1): 1.0, (1, 0): -(2.0**60)}.items():
        contributions[key][1]["weight"][0, 0] = value
    contributions[(1, 1)][1]["weight"][0, 0] = 0.0
    order_a = sorted(contributions)
    order_b = [(0, 0), (1, 0), (0, 1), (1, 1)]
    naive = [sum(np.float64(contributions[k][1]["weight"][0, 0]) for k in order) for order in (order_a, order_b)]
    assert naive[0] != naive[1]  # the orders really do disagree when summed as they arrive

    results = []
    for order in (order_a, order_b):
        _, client = cluster()
        for epoch in (1, 2):
            _push_epoch(client, epoch, contributions, order=order[::-1] if epoch == 2 else order)
            assert client.command("step", epoch=epoch)[0].op == Op.ACK
        results.append(client.weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_duplicate_and_late_pushes_are_acked_and_dropped(cluster):
    _, client = cluster(optimizer="sgd", lr=0.5)
    rng = np.random.default_rng(3)
    first = _grads(rng, 1, 2)
    retry = _grads(rng, 1, 2)
    _push_epoch(client, 1, first)
    for layer in range(2):  # a relaunched attempt and a plain retry of the same key
        assert client.push(layer, 1, 0, retry[(0, 0)][layer], attempt=1) is True
        assert client.push(layer, 1, 1, retry[(0, 1)][layer]) is True
    reply, _ = client.command("step", epoch=1, expected=2)
    assert reply.meta["grads"] == 4
    init = _init()
    for layer, got in enumerate(client.weights()):
        decay = np.float32(SPEC.layers[layer].weight_decay)
        want = init[layer] - np.float32(0.5) * (_summed(first, layer) + decay * init[layer])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # a straggler for the epoch already stepped changes nothing
    before = client.weights()
    assert client.push(0, 1, 5, retry[(0, 0)][0]) is True
    assert client.stats()["duplicates"] == 5 and client.stats()["pending_grads"] == 0
    for a, b in zip(before, client.weights()):
        np.testing.assert_array_equal(a, b)


def _step(client: Client, epoch: int, contributions: dict) -> int:
    """Push every contribution of ``epoch`` and step it by command; returns the new version."""
    _push_epoch(client, epoch, contributions)
    reply, _ = client.ok(Header(Op.COMMAND, meta={"command": "step", "epoch": epoch}))
    assert reply.op == Op.ACK
    return reply.meta["version"]


def _expect_error(client: Client, header: Header, code: str, words: str = "") -> Header:
    reply, out = client.request(header)
    assert (reply.op, reply.code, out) == (Op.ERROR, code, []), reply
    assert words in reply.message, (words, reply.message)
    return reply


def test_stash_returns_the_forward_pin_after_newer_steps(cluster):
    """A forward of epoch 3 pins version 0; two steps later its backward (stash) still gets
    version 0, a relaunched forward gets version 0 too, newest gets version 2 and pins nothing.
    (A forward of epoch 3 with version 0 is what async mode with staleness 2 does.)"""
    _, client = cluster(staleness=2)
    init = _init()
    rng = np.random.default_rng(4)
    # a backward whose forward never pinned: out_of_range, nothing pinned by the failure
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=3, interval=0, meta={"weights": "stash"}),
                  "out_of_range", "no weights stashed for part 0 layer 0 epoch 3 interval 0")
    assert client.stats()["pinned"] == 0

    for layer in range(2):  # forward of (part 0, epoch 3, interval 0) pins version 0
        reply, w = client.fetch(layer, 3, 0, weights="pin")
        assert (reply.version, reply.meta["newest"]) == (0, 0)
        np.testing.assert_array_equal(w, init[layer])
    assert _step(client, 1, _grads(rng, 1, 2)) == 1
    assert _step(client, 2, _grads(rng, 1, 2)) == 2
    newest = client.weights()
    assert not np.allclose(newest[0], init[0])
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"]) == (2, 2)  # version 0 (pinned) and 2 (newest)

    for layer in range(2):
        # backward: the version its forward pinned, whatever was stepped since
        reply, w = client.fetch(layer, 3, 0, weights="stash")
        assert (reply.version, reply.meta["newest"]) == (0, 2)
        np.testing.assert_array_equal(w, init[layer])
        # a relaunched forward (the key pinned again) gets the same version, so does a plain pull
        reply, w = client.fetch(layer, 3, 0, weights="pin", attempt=1)
        assert (reply.version, reply.meta["newest"]) == (0, 2)
        np.testing.assert_array_equal(w, init[layer])
        assert client.pull(layer, 3, 0)[0] == 0
        # evaluation: the newest version
        reply, w = client.fetch(layer, 3, 0, weights="newest")
        assert (reply.version, reply.meta["newest"]) == (2, 2)
        np.testing.assert_array_equal(w, newest[layer])
    # newest pinned nothing: a key only ever pulled with newest has no stash
    assert client.fetch(0, 3, 1, weights="newest")[0].version == 2
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=3, interval=1, meta={"weights": "stash"}),
                  "out_of_range", "interval 1")
    assert client.stats()["pinned"] == 2
    # other keys: another interval, and the same interval id in another part, pin the newest version
    assert client.fetch(0, 3, 1, weights="pin")[0].version == 2
    assert client.fetch(0, 3, 0, weights="pin", part=1)[0].version == 2
    assert client.fetch(0, 3, 0, weights="stash", part=1)[0].version == 2
    assert client.fetch(0, 3, 0, weights="stash", part=0)[0].version == 0
    # a pull with an explicit version gets exactly that version while it is kept
    version, w = client.pull(1, 4, 0, version=0)
    assert version == 0
    np.testing.assert_array_equal(w, init[1])
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=3, interval=0, version=1), "out_of_range",
                  "version 1")  # version 1 was freed at step 2: nothing pinned it
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=3, interval=0, version=3), "out_of_range",
                  "version 3")  # a version from the future
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"], stats["version"]) == (4, 2, 2)


def test_pins_are_released_when_their_epoch_is_stepped(cluster):
    """The gradient push no longer releases a pin: a relaunched backward may pull the stash until
    the epoch's step, which releases that epoch's pins (not later epochs') and frees the version."""
    _, client = cluster()
    init = _init()
    rng = np.random.default_rng(5)
    g1, g2 = _grads(rng, 1, 2), _grads(rng, 1, 2)
    for (_, interval) in g1:  # forwards of epoch 1 and (pipelined) epoch 2 pin version 0
        for layer in range(2):
            assert client.fetch(layer, 1, interval, weights="pin")[0].version == 0
            assert client.fetch(layer, 2, interval, weights="pin")[0].version == 0
    assert client.stats()["pinned"] == 8

    # every gradient of epoch 1 is in: nothing released yet, a relaunched backward still gets its stash
    _push_epoch(client, 1, g1)
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"], stats["pending_grads"]) == (8, 1, 4)
    reply, w = client.fetch(0, 1, 0, weights="stash")
    assert reply.version == 0
    np.testing.assert_array_equal(w, init[0])
    # its gradient again (the relaunched attempt's push): dropped, and still nothing released
    assert client.push(0, 1, 0, g1[(0, 0)][0], attempt=1) is True
    assert client.stats()["pinned"] == 8

    # step 1 releases epoch 1's pins; epoch 2's pins keep version 0 alive next to version 1
    assert client.command("step", epoch=1)[0].meta["version"] == 1
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"]) == (4, 2)
    for layer in range(2):
        _expect_error(client, Header(Op.PULL_WEIGHTS, layer=layer, epoch=1, interval=0, meta={"weights": "stash"}),
                      "out_of_range", f"layer {layer} epoch 1 interval 0")
        reply, w = client.fetch(layer, 2, 1, weights="stash")
        assert (reply.version, reply.meta["newest"]) == (0, 1)
        np.testing.assert_array_equal(w, init[layer])
    assert client.pull(0, 2, 0, version=0)[0] == 0  # kept: pinned by epoch 2

    # step 2 releases the rest; version 0 is freed
    _push_epoch(client, 2, g2)
    assert client.stats()["pinned"] == 4
    assert client.command("step", epoch=2)[0].meta["version"] == 2
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"], stats["pending_grads"]) == (0, 1, 0)
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=2, interval=1, meta={"weights": "stash"}),
                  "out_of_range", "epoch 2 interval 1")
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=2, interval=0, version=0), "out_of_range",
                  "version 0")
    # a late forward of an epoch already stepped pins the newest version; the next step releases it
    assert client.fetch(0, 1, 0, weights="pin")[0].version == 2
    assert client.stats()["pinned"] == 1
    assert _step(client, 3, _grads(rng, 1, 1)) == 3
    stats = client.stats()
    assert (stats["pinned"], stats["stashed_versions"]) == (0, 1)


@pytest.mark.parametrize("value", ["latest", "PIN", "", 1, True])
def test_bad_weights_request_is_bad_field(cluster, value):
    _, client = cluster()
    _expect_error(client, Header(Op.PULL_WEIGHTS, layer=0, epoch=1, interval=0, meta={"weights": value}),
                  "bad_field", "meta['weights'] must be one of pin, stash, newest")
    stats = client.stats()
    assert (stats["pulls"], stats["pinned"], stats["errors.bad_field"]) == (0, 0, 1)
    assert client.fetch(0, 1, 0, weights="pin")[0].version == 0  # still serving


# ----------------------------------------------------------------------------- the self-stepping server


def _oracle_weights(cluster, epochs: list[tuple[int, dict]], optimizer: str = "adam", lr: float = 0.01):
    """The weights of a fresh server stepped by command over ``epochs`` (in that order)."""
    _, manual = cluster(optimizer=optimizer, lr=lr)
    for epoch, contributions in epochs:
        _step(manual, epoch, contributions)
    return manual.weights()


def test_configure_steps_exactly_when_the_last_gradient_arrives(cluster):
    _, client = cluster()
    rng = np.random.default_rng(7)
    g = _grads(rng, 2, 2)  # N = 4 intervals over 2 graph servers
    reply, _ = client.ok(Header(Op.COMMAND, meta={"command": "configure", "expected": 4}))
    assert reply.op == Op.ACK and reply.meta["expected"] == 4
    pushes = [(part, interval, layer) for (part, interval) in g for layer in range(2)]
    for n, (part, interval, layer) in enumerate(pushes[:-1]):
        assert client.push(layer, 1, interval, g[(part, interval)][layer], part=part) is False
        stats = client.stats()
        assert (stats["version"], stats["steps"], stats["pending_grads"]) == (0, 0, n + 1), (part, interval, layer)
    part, interval, layer = pushes[-1]
    assert client.push(layer, 1, interval, g[(part, interval)][layer], part=part) is False
    stats = client.stats()  # stepped before the last push was ACKed
    assert (stats["version"], stats["epoch"], stats["steps"], stats["pending_grads"]) == (1, 1, 1, 0)
    assert (stats["applied"], stats["dropped"]) == (8, 0)
    for got, want in zip(client.weights(), _oracle_weights(cluster, [(1, g)])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # the epoch is done: a manual step of it, or a late push, changes nothing
    reply, _ = client.command("step", epoch=1)
    assert reply.code == "incomplete" and "already stepped" in reply.message
    assert client.push(0, 1, 0, g[(0, 0)][0]) is True
    assert client.stats()["version"] == 1


def test_configure_steps_at_once_when_the_gradients_are_already_in(cluster):
    _, client = cluster()
    g = _grads(np.random.default_rng(8), 1, 2)
    _push_epoch(client, 1, g)
    assert client.stats()["version"] == 0  # no configure yet: waits for the step command
    client.ok(Header(Op.COMMAND, meta={"command": "configure", "expected": 2}))
    stats = client.stats()
    assert (stats["version"], stats["applied"], stats["pending_grads"]) == (1, 4, 0)


def test_configure_steps_epochs_in_order(cluster):
    """Epoch 2's gradients complete first: nothing is stepped until epoch 1's last gradient,
    which steps epoch 1 and then epoch 2, as if they had arrived in order."""
    _, client = cluster()
    rng = np.random.default_rng(9)
    g1, g2 = _grads(rng, 1, 3), _grads(rng, 1, 3)
    client.ok(Header(Op.COMMAND, meta={"command": "configure", "expected": 3}))
    _push_epoch(client, 2, g2)
    keys = list(g1)
    _push_epoch(client, 1, {k: g1[k] for k in keys[:-1]})
    stats = client.stats()
    assert (stats["version"], stats["steps"], stats["pending_grads"]) == (0, 0, 6 + 4)
    assert client.push(0, 1, keys[-1][1], g1[keys[-1]][0]) is False
    assert client.stats()["version"] == 0  # layer 1 of epoch 1 still misses one
    assert client.push(1, 1, keys[-1][1], g1[keys[-1]][1]) is False
    stats = client.stats()
    assert (stats["version"], stats["epoch"], stats["steps"], stats["pending_grads"]) == (2, 2, 2, 0)
    in_order = _oracle_weights(cluster, [(1, g1), (2, g2)])
    reversed_order = _oracle_weights(cluster, [(2, g2), (1, g1)])
    assert not np.allclose(in_order[0], reversed_order[0], rtol=1e-5, atol=1e-6)  # the order shows
    for got, want in zip(client.weights(), in_order):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_configure_counts_applied_and_dropped(cluster):
    _, client = cluster(optimizer="sgd", lr=0.1)
    rng = np.random.default_rng(10)
    parts, intervals, epochs = 2, 2, 3
    n = parts * intervals
    client.ok(Header(Op.COMMAND, meta={"command": "configure", "expected": n}))
    duplicates = 0
    for epoch in range(1, epochs + 1):
        g = _grads(rng, parts, intervals)
        for k, (part, interval) in enumerate(g):
            for layer in range(2):
                assert client.push(layer, epoch, interval, g[(part, interval)][layer], part=part) is False
                if k == 0:  # a relaunched attempt of the first call pushes again before the epoch is stepped
                    assert client.push(layer, epoch, interval, g[(part, interval)][layer], part=part,
                                       attempt=1) is True
                    duplicates += 1
        assert client.stats()["version"] == epoch
        # a straggler of the epoch just stepped
        assert client.push(1, epoch, 0, g[(0, 0)][1], part=1) is True
        duplicates += 1
    stats = client.stats()
    assert stats["applied"] == n * 2 * epochs == 24
    assert stats["dropped"] == stats["duplicates"] == duplicates == 3 * 2 + 3
    assert stats["pushes"] == stats["applied"] + stats["dropped"]
    assert (stats["steps"], stats["version"], stats["pending_grads"]) == (epochs, epochs, 0)


def test_configure_bad_arguments(cluster):
    _, client = cluster()
    _expect_error(client, Header(Op.COMMAND, meta={"command": "configure"}), "bad_command", "expected")
    _expect_error(client, Header(Op.COMMAND, meta={"command": "configure", "expected": 0}), "bad_field", ">= 1")
    _expect_error(client, Header(Op.COMMAND, meta={"command": "configure", "expected": -2}), "bad_field",
                  "expected")
    _expect_error(client, Header(Op.COMMAND, meta={"command": "wait_version"}), "bad_command", "version")
    _expect_error(client, Header(Op.COMMAND, meta={"command": "get_state", "version": -1}), "bad_field", "version")


# ----------------------------------------------------------------------------- deferred replies


def test_wait_version_is_answered_once_the_version_exists(cluster):
    server, client = cluster()
    waiter = cluster.connect(server)
    rng = np.random.default_rng(11)
    # a version that exists: answered at once
    reply, _ = waiter.ok(Header(Op.COMMAND, meta={"command": "wait_version", "version": 0}))
    assert reply.op == Op.ACK and reply.meta["version"] == 0
    # version 1: nothing until epoch 1 is stepped, while the server keeps serving others
    req = waiter.send(Header(Op.COMMAND, meta={"command": "wait_version", "version": 1}))
    assert waiter.waiting()
    _push_epoch(client, 1, _grads(rng, 1, 1))
    assert client.stats()["version"] == 0
    assert waiter.waiting()
    assert client.command("step", epoch=1)[0].meta["version"] == 1
    reply, out = waiter.answer(req)
    assert (reply.op, reply.meta["version"], out) == (Op.ACK, 1, [])
    # the same through the self-stepping server, for a version two steps ahead
    client.ok(Header(Op.COMMAND, meta={"command": "configure", "expected": 1}))
    req = waiter.send(Header(Op.COMMAND, meta={"command": "wait_version", "version": 3}))
    g2, g3 = _grads(rng, 1, 1), _grads(rng, 1, 1)
    _push_epoch(client, 2, g2)
    assert client.stats()["version"] == 2 and waiter.waiting()
    client.push(0, 3, 0, g3[(0, 0)][0])
    assert waiter.waiting()
    client.push(1, 3, 0, g3[(0, 0)][1])
    reply, _ = waiter.answer(req)
    assert (reply.op, reply.meta["version"]) == (Op.ACK, 3)
    assert waiter.quiet()  # exactly one reply


def _get_state(client, **meta) -> tuple[dict, dict[str, np.ndarray]]:
    reply, tensors = client.ok(Header(Op.COMMAND, meta={"command": "get_state", **meta}))
    assert reply.op == Op.WEIGHTS
    return reply.meta, {name: np.array(t) for name, t in zip(reply.names, tensors)}


def _assert_same_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-8, err_msg=name)


def test_get_state_of_a_past_version_is_the_state_right_after_that_step(cluster):
    """Every kept version's state equals what get_state (newest) showed right after its step."""
    _, client = cluster()
    rng = np.random.default_rng(12)
    seen = {}
    for epoch in range(1, 4):
        _step(client, epoch, _grads(rng, 1, 2))
        seen[epoch] = _get_state(client)
        assert seen[epoch][0] == {"version": epoch, "epoch": epoch, "optimizer": "adam"}
        assert seen[epoch][1]["layers.0.weight.step"].tolist() == [float(epoch)]
    assert client.stats()["pinned"] == 0  # no pin keeps the old weights: the state must keep them
    for version in (3, 2, 1):
        meta, arrays = _get_state(client, version=version)
        assert meta == {"version": version, "epoch": version, "optimizer": "adam"}
        _assert_same_state(arrays, seen[version][1])
    assert not np.allclose(seen[1][1]["layers.0.weight"], seen[3][1]["layers.0.weight"])  # the versions do differ


def test_get_state_of_a_future_version_is_deferred_until_its_step(cluster):
    server, client = cluster()
    waiter = cluster.connect(server)
    rng = np.random.default_rng(13)
    _step(client, 1, _grads(rng, 1, 1))
    req = waiter.send(Header(Op.COMMAND, meta={"command": "get_state", "version": 2}))
    assert waiter.waiting()
    _push_epoch(client, 2, _grads(rng, 1, 1))
    assert waiter.waiting()
    assert client.command("step", epoch=2)[0].meta["version"] == 2
    reply, tensors = waiter.answer(req)
    assert reply.op == Op.WEIGHTS and reply.meta == {"version": 2, "epoch": 2, "optimizer": "adam"}
    got = {name: np.array(t) for name, t in zip(reply.names, tensors)}
    assert got["layers.0.bias.step"].tolist() == [2.0]
    _assert_same_state(got, _get_state(client)[1])  # the newest state: nothing stepped since


def test_get_state_of_a_version_too_old_is_state_gone(cluster):
    """Its own code, so a coordinator that fell behind can tell a gone state from a failure."""
    _, client = cluster(optimizer="sgd")
    rng = np.random.default_rng(14)
    steps = KEPT_STATES + 2
    for epoch in range(1, steps + 1):
        _step(client, epoch, _grads(rng, 1, 1))
    for version in range(0, steps - KEPT_STATES + 1):  # the kept ones are steps - KEPT_STATES + 1 .. steps
        _expect_error(client, Header(Op.COMMAND, meta={"command": "get_state", "version": version}), "state_gone",
                      f"state of version {version} is no longer kept")
    assert _get_state(client, version=steps)[0]["version"] == steps


# ----------------------------------------------------------------------------- errors


def test_bad_messages_get_errors_and_the_server_keeps_serving(cluster):
    server, client = cluster()
    w0, b0 = (SPEC.init_params(SEED)[0][name] for name in NAMES)
    push = dict(layer=0, epoch=1, interval=0, version=0, names=NAMES)
    nan = np.zeros_like(w0)
    nan[1, 2] = np.nan
    cases = [
        (Header(Op.PUSH_GRADS, **push), [np.zeros((F + 1, 4), np.float32), b0], "bad_shape",
         "layer 0 weight has shape [6, 4], the parameter is [5, 4]"),
        (Header(Op.PUSH_GRADS, **push), [w0, np.zeros(3, np.float32)], "bad_shape", "bias has shape [3]"),
        (Header(Op.PUSH_GRADS, **push), [w0.astype(np.float64), b0], "bad_dtype", "float64"),
        (Header(Op.PUSH_GRADS, **push), [nan, b0], "not_finite", "NaN"),
        (Header(Op.PUSH_GRADS, **push), [w0, b0, b0], "tensor_count", "names 2 gradients but carries 3"),
        (Header(Op.PUSH_GRADS, **{**push, "names": ("weight",)}), [w0], "bad_field", "missing ['bias']"),
        (Header(Op.PUSH_GRADS, **{**push, "names": ("weight", "bias", "gamma")}), [w0, b0, b0], "bad_field",
         "unknown ['gamma']"),
        (Header(Op.PUSH_GRADS, **{**push, "version": 3}), [w0, b0], "out_of_range", "version 3"),
        (Header(Op.PUSH_GRADS, **{**push, "layer": 2}), [np.zeros((4, C), np.float32), b0], "out_of_range",
         "layer 2"),
        (Header(Op.PULL_WEIGHTS, layer=9, epoch=1, interval=0), [], "out_of_range", "layer 9"),
        (Header(Op.PULL_WEIGHTS, layer=0, epoch=1, interval=0, part=1, meta={"part": 2}), [], "bad_field", "part"),
        (Header(Op.PULL_WEIGHTS, layer=0, epoch=1, interval=0, meta={"weights": "latest"}), [], "bad_field",
         "'latest'"),
        (Header(Op.COMMAND, meta={"command": "explode"}), [], "bad_command", "explode"),
        (Header(Op.COMMAND), [], "bad_command", "None"),
        (Header(Op.COMMAND, meta={"command": "step"}), [], "bad_command", "epoch"),
        (Header(Op.COMMAND, meta={"command": "step", "epoch": -1}), [], "bad_field", "epoch"),
        (Header(Op.COMMAND, meta={"command": "set_state", "epoch": 1}), [], "bad_command", "version"),
        (Header(Op.PULL, task="AV", epoch=1, layer=0, interval=0, rows=(0, 1), names=("Z",)), [], "unknown_op",
         "PULL"),
    ]
    for header, tensors, code, words in cases:
        reply, out = client.request(header, tensors)
        assert (reply.op, reply.code, out) == (Op.ERROR, code, []), (header, reply)
        assert words in reply.message, (words, reply.message)
    for frames, code in [([b"\xff\x00garbage"], "bad_header"), ([b"[1, 2]"], "bad_header"), ([b"{}"], "bad_version"),
                         ([b'{"v":1,"op":"HELLO","role":"function","t":[["float32",[2]]]}'], "tensor_count"),
                         ([b'{"v":1,"op":"FLY"}', b"x"], "unknown_op"), ([b""], "bad_header")]:
        reply, _ = client.raw(frames)
        assert (reply.op, reply.code) == (Op.ERROR, code), frames
    # a reply-type message sent to the server expects no reply: dropped and counted
    P.send(client.sock, Header(Op.ACK, req=99))
    assert not client.sock.poll(200)
    # nothing above changed the state, and the server still answers
    assert client.pull(0, 1, 0)[0] == 0
    stats = client.stats()
    assert stats["pushes"] == 0 and stats["pending_grads"] == 0 and stats["version"] == 0
    assert stats["errors"] == len(cases) + 6 + 1
    assert stats["errors.out_of_range"] == 3 and stats["errors.bad_header"] == 3 and stats["errors.unknown_op"] == 3
    assert server.counters.total == stats["errors"]


def test_step_requires_every_layer_and_the_expected_count(cluster):
    _, client = cluster()
    rng = np.random.default_rng(5)
    g = _grads(rng, 1, 2)
    client.push(0, 1, 0, g[(0, 0)][0])
    reply, _ = client.command("step", epoch=1)
    assert reply.code == "incomplete" and "layer 1 has no gradient" in reply.message
    client.push(1, 1, 0, g[(0, 0)][1])
    client.push(0, 1, 1, g[(0, 1)][0])
    reply, _ = client.command("step", epoch=1, expected=2)
    assert reply.code == "incomplete"
    assert "layer 1 expected 2 gradient contributions, received 1" in reply.message
    assert client.stats()["version"] == 0 and client.stats()["pending_grads"] == 3  # nothing consumed
    client.push(1, 1, 1, g[(0, 1)][1])
    assert client.command("step", epoch=1, expected=2)[0].meta == {"version": 1, "grads": 4}
    reply, _ = client.command("step", epoch=1)
    assert reply.code == "incomplete" and "already stepped" in reply.message


# ----------------------------------------------------------------------------- checkpoints


def _set_state(client, meta: dict, arrays: dict[str, np.ndarray]) -> Header:
    reply, _ = client.request(Header(Op.COMMAND, names=tuple(arrays), meta={"command": "set_state", **meta}),
                              list(arrays.values()))
    return reply


def test_get_state_then_set_state_continues_as_if_never_interrupted(cluster):
    _, client = cluster()
    rng = np.random.default_rng(6)
    epochs = {epoch: _grads(rng, 2, 1) for epoch in (1, 2)}
    _push_epoch(client, 1, epochs[1])
    client.ok(Header(Op.COMMAND, meta={"command": "step", "epoch": 1}))
    meta, saved = _get_state(client)
    assert meta == {"version": 1, "epoch": 1, "optimizer": "adam"}
    params = [param_key(l, n) for l in range(2) for n in NAMES]
    assert sorted(saved) == sorted(params + [f"{p}.{kind}" for p in params for kind in ("exp_avg", "exp_avg_sq",
                                                                                      "step")])
    assert saved["layers.0.weight.step"].tolist() == [1.0]

    _push_epoch(client, 2, epochs[2])
    client.ok(Header(Op.COMMAND, meta={"command": "step", "epoch": 2}))
    after_step_2 = client.weights()
    assert not np.allclose(after_step_2[0], _layers(saved)[0])

    # a fresh server (a restarted role) restored from the state replays epoch 2 to the same weights
    _, restored = cluster()
    assert _set_state(restored, meta, saved).meta == {"version": 1, "epoch": 1}
    for a, b in zip(restored.weights(), _layers(saved)):
        np.testing.assert_array_equal(a, b)  # copied, not computed
    _push_epoch(restored, 2, epochs[2])
    assert restored.command("step", epoch=2)[0].meta["version"] == 2
    for a, b in zip(restored.weights(), after_step_2):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)  # the Adam moments came back too
    # epoch 1 counts as stepped after a restore: a late push for it is a duplicate
    assert restored.push(0, 1, 0, epochs[1][(0, 0)][0]) is True


def test_bad_states_get_clear_errors_and_change_nothing(cluster):
    _, client = cluster()
    _, wide = cluster(spec=_spec(hidden=6))
    _, sgd = cluster(optimizer="sgd")
    _push_epoch(client, 1, _grads(np.random.default_rng(3), 1, 1))
    client.ok(Header(Op.COMMAND, meta={"command": "step", "epoch": 1}))
    meta, good = _get_state(client)
    before = client.weights()
    wide_meta, wide_state = _get_state(wide)
    sgd_meta, sgd_state = _get_state(sgd)
    for state_meta, arrays, words in [
        (wide_meta, wide_state, "layers.0.weight is float32[5, 6], the model needs float32[5, 4]"),
        (sgd_meta, sgd_state, "state of optimizer 'sgd', this server runs 'adam'"),
        (meta, {k: v for k, v in good.items() if k != "layers.1.bias"}, "no layers.1.bias"),
        (meta, {**good, "layers.0.weight.exp_avg": good["layers.0.weight.exp_avg"][:2]},
         "layers.0.weight.exp_avg has shape [2, 4], parameter layers.0.weight has [5, 4]"),
        (meta, {**good, "layers.7.weight.exp_avg": good["layers.0.weight.exp_avg"]},
         "'layers.7.weight.exp_avg' names no parameter"),
        (meta, {**good, "W0": good["layers.0.weight"]}, "'W0' names no parameter"),  # an older dorylus's name
        (meta, {**good, "layers.0.bias.step": np.array([-1.0])}, "layers.0.bias.step must be one step count >= 0"),
    ]:
        reply = _set_state(client, state_meta, arrays)
        assert (reply.op, reply.code) == (Op.ERROR, "bad_state") and words in reply.message, reply.message
    reply, _ = client.request(Header(Op.COMMAND, meta={"command": "step", "epoch": 2}), [good["layers.0.weight"]])
    assert (reply.op, reply.code) == (Op.ERROR, "tensor_count")
    for a, b in zip(client.weights(), before):
        np.testing.assert_array_equal(a, b)
    assert _get_state(client)[1]["layers.0.weight.step"].tolist() == [1.0]


# ----------------------------------------------------------------------------- lifecycle and CLI


def test_shutdown_stops_the_loop_and_context_manager_closes(ctx):
    with ParameterServer(SPEC, SEED) as server:
        client = Client(ctx, server.endpoint)
        try:
            assert client.ok(Header(Op.SHUTDOWN))[0].op == Op.ACK
            assert server.join(TIMEOUT)
        finally:
            client.close()
    assert server.closed


def test_bind_failure_is_a_clear_error():
    with ParameterServer(SPEC, SEED) as first:
        with pytest.raises(ParamServerError, match=f"cannot bind {first.endpoint}"):
            ParameterServer(SPEC, SEED, bind=first.endpoint)


def test_cli_subprocess_ready_file_hello_and_sigterm(ctx, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"layers": 2, "hidden": 4, "seed": 3, "optimizer": "sgd"}))
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dorylus.paramserver", "--config", str(config), "--num-features", str(F),
         "--num-classes", str(C), "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    client = None
    try:
        deadline = time.monotonic() + 120  # it imports torch first: 15 s failed at load 20 on 2 cores
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.02)
        endpoint = ready.read_text().strip()
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        client = Client(ctx, endpoint)
        reply, _ = client.ok(Header(Op.HELLO, role="coordinator"))
        assert reply.meta == {"num_layers": 2, "version": 0, "optimizer": "sgd", "endpoint": endpoint,
                              "max_message_bytes": 1 << 20, "fresh": True}
        cfg = TrainConfig(layers=2, hidden=4, seed=3)
        for got, want in zip(client.weights(), _init(ModelSpec.from_config(cfg, F, C), 3)):
            np.testing.assert_array_equal(got, want)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        # One record, logged as every role logs (tests/test_logs.py): time, role[pid], level.
        assert out == "" and re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{3}} paramserver\[{proc.pid}\] INFO "
                                          rf"listening on {re.escape(endpoint)}\n", err), err
        assert sorted(os.listdir(tmp_path)) == ["ready", "run.json"]
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)


def test_cli_bad_config_is_one_error_line(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"layers": 2, "hiden": 4}))
    proc = subprocess.run(
        [sys.executable, "-m", "dorylus.paramserver", "--config", str(config), "--num-features", "5",
         "--num-classes", "3"], capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("dorylus paramserver: error: ") and "hiden" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
