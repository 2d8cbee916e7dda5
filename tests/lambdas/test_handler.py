"""The generic function handler (lambdas.handler) against tiny fake graph and parameter servers.

Two ZeroMQ ROUTER sockets on 127.0.0.1 (random ports), served by one background thread, stand
in for the graph server and the parameter server and answer PULL / PUSH and PULL_WEIGHTS /
PUSH_GRADS per dorylus.protocol, logging every request. Events are built by the graph server's
own ``GraphServer.event`` on a stand-in ``self``, and pass through JSON as a Lambda payload does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

import lambdas.handler as handler_module
from dorylus import protocol
from dorylus.models import gcn, ops
from dorylus.models.base import FUNCTION, STATIC
from dorylus.models.spec import LayerSpec, ModelSpec
from dorylus.protocol import Header, Op
from graphserver.server import GraphServer
from lambdas.handler import FunctionTaskError, handler

SEED, PART, VERSION, NEWEST = 11, 1, 3, 5
INTERVALS = [(0, 4), (4, 10)]
N_ROWS = 10
WAIT_S = 10.0


def test_function_bundle_imports_without_torch():
    """The bundle (handler, protocol, the torch-free model modules) never imports torch or the graph server."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "import lambdas.handler\n"
        "from dorylus.models import get_model\n"
        "gcn = get_model('gcn')\n"
        "params = {'weight': np.ones((3, 2), np.float32), 'bias': np.ones(2, np.float32)}\n"
        "r = gcn.compute('AV', 0, [np.ones((2, 3), np.float32)], params,\n"
        "                {'project_first': False, 'seed': 0, 'epoch': 1, 'training': True, 'train_count': 1})\n"
        "assert r.rows[0].shape == (2, 2)\n"
        "from dorylus.models import MODELS\n"
        "for name in MODELS:\n"
        "    get_model(name)  # every model's vertex functions ship in the bundle\n"
        "loaded = {m for m, mod in sys.modules.items() if mod is not None}\n"
        "bad = {m for m in loaded if m.startswith(('torch', 'graphserver', 'dorylus.models.reference'))}\n"
        "assert not bad, bad\n"
        "assert {'dorylus.models', 'dorylus.protocol', *MODELS.values()} <= loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- fake servers


class FakeServers:
    """A graph server and a parameter server in one thread; every request is logged."""

    def __init__(self, buffers: dict[str, np.ndarray], params: list[dict[str, np.ndarray]]):
        """``params``: per layer, the named parameters a PULL_WEIGHTS gets (``ModelSpec.init_params``)."""
        self.buffers, self.layer_params = buffers, params
        self.log: list[tuple[str, Header, list[np.ndarray]]] = []
        self.errors: list[BaseException] = []
        self.refuse: set[Op] = set()   # answer these ops with ERROR
        self.ignore: set[Op] = set()   # never answer these
        self.answer_after: dict[Op, Op] = {}  # answer op K only once op V has arrived (either server)
        self._held: list[tuple[Op, zmq.Socket, bytes, Header, list]] = []
        self._seen: set[Op] = set()
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-servers", daemon=True)
        self.graph = self.params = None
        try:
            self.graph, self.graph_endpoint = self._bind()
            self.params, self.params_endpoint = self._bind()
            self._thread.start()
        except BaseException:
            self.close()
            raise

    def _bind(self) -> tuple[zmq.Socket, str]:
        socket = self.ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        return socket, f"tcp://127.0.0.1:{port}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.graph, zmq.POLLIN)
        poller.register(self.params, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(50):
                try:
                    self._answer(socket)
                except Exception as exc:  # noqa: BLE001 - surfaced by the fixture
                    self.errors.append(exc)

    def _answer(self, socket: zmq.Socket) -> None:
        identity, header, tensors = protocol.recv_routed(socket, timeout=1.0)
        who = "graph" if socket is self.graph else "params"
        self.log.append((who, header, [np.array(t) for t in tensors]))
        if header.op in self.ignore:
            return
        if header.op in self.refuse:
            reply, out = Header(Op.ERROR, req=header.req, code="bad_field", message="refused by the test"), []
        elif who == "graph" and header.op is Op.PULL:
            start, stop = header.rows  # as the graph server answers: sparse rows go as CSR, sums as one row
            sums = protocol.summed_names(header)
            reply, out = protocol.rows_reply(header, [self.buffers[n][start:stop].sum(0, keepdims=True) if n in sums
                                                      else self.buffers[n][start:stop] for n in header.names])
        elif who == "graph" and header.op is Op.PUSH:
            reply, out = protocol.reply_to(header, Op.ACK, meta={"duplicate": False}), []
        elif who == "params" and header.op is Op.PULL_WEIGHTS:
            layer_params = self.layer_params[header.layer]
            reply = protocol.reply_to(header, Op.WEIGHTS, version=VERSION, names=tuple(layer_params),
                                      meta={"newest": NEWEST})
            out = list(layer_params.values())
        elif who == "params" and header.op is Op.PUSH_GRADS:
            reply, out = protocol.reply_to(header, Op.ACK, meta={"duplicate": False}), []
        else:
            raise AssertionError(f"{who} got unexpected {header.op.value}")
        self._seen.add(header.op)
        self._held.append((self.answer_after.get(header.op), socket, identity, reply, out))
        for held in [h for h in self._held if h[0] is None or h[0] in self._seen]:
            self._held.remove(held)
            protocol.send_routed(*held[1:])

    def take_log(self) -> list[tuple[str, Header, list[np.ndarray]]]:
        log, self.log = self.log, []
        return log

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for socket in (self.graph, self.params):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.term()
        assert not self._thread.is_alive(), "fake server thread did not stop"


class LambdaContext:
    """What the handler reads of Lambda's context: the time left bounds every wait."""

    def __init__(self, remaining_ms: int = int(WAIT_S * 1000)):
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms


def make_spec(dims: tuple[int, ...]) -> ModelSpec:
    last = len(dims) - 2
    return ModelSpec("gcn", tuple(
        LayerSpec(index=i, in_dim=dims[i], out_dim=dims[i + 1], dropout=0.5,
                  activation=None if i == last else "relu", weight_decay=0.0)
        for i in range(len(dims) - 1)))


def make_buffers(plan, num_features: int, num_classes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    split = np.array([ops.TRAIN, ops.VAL, ops.TEST, 0, ops.TRAIN] * 2, np.uint8)
    labels = rng.integers(0, num_classes, N_ROWS).astype(np.int64)
    labels[split == 0] = -1
    buffers = {"X": rng.standard_normal((N_ROWS, num_features)).astype(np.float32),
               "ids": (1000 + 3 * np.arange(N_ROWS)).astype(np.int64),  # global ids, not local rows
               "labels": labels, "split": split}
    for name, width in plan.widths.items():
        buffers[name] = rng.standard_normal((N_ROWS, width)).astype(np.float32)
    return buffers


SPECS = {"8-4-7": (8, 4, 7), "8-16-7": (8, 16, 7)}


@pytest.fixture(params=list(SPECS))
def setup(request, monkeypatch):
    """(spec, plan, servers); a cold container; servers and their thread closed even on failure."""
    monkeypatch.setattr(handler_module, "_static_rows", {})
    dims = SPECS[request.param]
    spec = make_spec(dims)
    plan = gcn.build_plan(spec)
    params = spec.init_params(SEED)
    for layer in params:  # biases that are not zero, so that a bias dropped on the way shows
        layer["bias"] = np.linspace(-0.5, 0.5, layer["bias"].shape[0], dtype=np.float32)
    servers = FakeServers(make_buffers(plan, dims[0], dims[-1]), params)
    try:
        yield spec, plan, servers
    finally:
        servers.close()
    assert not servers.errors, servers.errors


def make_event(servers: FakeServers, stage, pass_: str, epoch: int, interval: int, run: str,
               static_rows_per_pull: int | None = None) -> dict:
    """The payload the graph server sends, built by GraphServer.event itself, through JSON."""
    fake = SimpleNamespace(state=SimpleNamespace(intervals=INTERVALS, static_rows_per_pull=static_rows_per_pull),
                           config=SimpleNamespace(model="gcn", seed=SEED),
                           meta=SimpleNamespace(train_count=4), advertised=servers.graph_endpoint,
                           param_server_advertised=servers.params_endpoint, part_id=PART, run_token=run)
    fake.stage_args = lambda *a: GraphServer.stage_args(fake, *a)
    return json.loads(json.dumps(GraphServer.event(fake, stage, pass_, epoch, interval)))


# ----------------------------------------------------------------------------- the tests


def _check_call(servers: FakeServers, stage, event: dict, expected_pull: list[str], grad: bool) -> dict:
    """Run ``handler(event)`` and check every message it sent against what gcn.compute gives."""
    start, stop = event["rows"]
    summary = handler(event, LambdaContext())
    log = servers.take_log()
    # Each peer's requests in order (the two peers' requests overlap, so their interleaving varies).
    ops = {peer: [h.op for who, h, _ in log if who == peer] for peer in ("graph", "params")}
    # A stage that writes no rows pushes nothing to its graph server: its meta is the summary's result.
    expected_ops = {"graph": ([Op.PULL] if expected_pull else []) + ([Op.PUSH] if event["writes"] else []),
                    "params": ([Op.PULL_WEIGHTS] if stage.weights else []) + ([Op.PUSH_GRADS] if grad else [])}
    assert ops == expected_ops, (stage.task, stage.layer, event["pass"], ops)
    by_op = {h.op: (h, t) for _, h, t in log}
    ident = dict(epoch=event["epoch"], layer=stage.layer, interval=event["interval"], part=PART)

    if expected_pull:
        pull, _ = by_op[Op.PULL]
        assert list(pull.names) == expected_pull
        # reads used only through their sum (the bias gradient's dY) come as one row
        assert pull.meta.get("sums", "") == ",".join(n for n in expected_pull if n in stage.summed)
        assert (pull.task, pull.rows, pull.meta["pass"]) == (stage.task, (start, stop), event["pass"])
        assert {k: getattr(pull, k) for k in ident} == ident

    params = None
    if stage.weights:
        pull_w, _ = by_op[Op.PULL_WEIGHTS]
        assert pull_w.meta == {"weights": stage.weights if event["pass"] == "train" else "newest"}
        assert {k: getattr(pull_w, k) for k in ident} == ident
        params = servers.layer_params[stage.layer]

    expected = gcn.compute(stage.task, stage.layer, [servers.buffers[n][start:stop] for n in stage.reads], params,
                           event["args"])
    if grad:
        push_g, grads = by_op[Op.PUSH_GRADS]
        assert push_g.version == VERSION and {k: getattr(push_g, k) for k in ident} == ident
        assert push_g.names == tuple(expected.grads) == ("weight", "bias")  # every parameter, by name
        # same numpy code on the same float32 inputs in the same process: equal up to BLAS kernel choice
        for got, want in zip(grads, expected.grads.values()):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    assert list(stage.writes) == event["writes"]
    if event["writes"]:
        push, rows = by_op[Op.PUSH]
        assert list(push.names) == event["writes"]
        assert (push.task, push.rows, push.meta["pass"]) == (stage.task, (start, stop), event["pass"])
        assert {k: getattr(push, k) for k in ident} == ident
        assert len(rows) == len(expected.rows)
        for got, want in zip(rows, expected.rows):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert {k: v for k, v in push.meta.items() if k != "pass"} == summary["result"]
    else:
        assert expected.rows == []
    for key, value in expected.meta.items():
        assert summary["result"][key] == pytest.approx(value, rel=1e-6)
    if stage.weights:
        assert summary["result"]["version"] == VERSION and summary["result"]["weight_lag"] == NEWEST - VERSION
    assert (summary["task"], summary["layer"], summary["interval"]) == (stage.task, stage.layer, event["interval"])
    return summary


def test_handler_pulls_computes_and_pushes(setup):
    spec, plan, servers = setup
    cached: set[tuple[str, int, str]] = set()

    def call(stage, pass_, epoch, interval, run, grad=None):
        event = make_event(servers, stage, pass_, epoch, interval, run)
        assert event["grad"] == (stage.grad and pass_ == "train")
        if grad is not None:
            event["grad"] = grad
        if any(key[0] != run for key in cached):
            cached.clear()
        pull = [n for n in stage.reads if n not in STATIC or (run, interval, n) not in cached]
        cached.update((run, interval, n) for n in stage.reads if n in STATIC)
        _check_call(servers, stage, event, pull, grad=event["grad"] and stage.grad)
        return pull

    train = [s for s in plan.train if s.kind == FUNCTION]
    evaluate = [s for s in plan.evaluate if s.kind == FUNCTION]
    pulls = {}
    for interval in (0, 1):
        for stage in train:
            pulls[(stage.key, interval, 1)] = call(stage, "train", 1, interval, "run-a")
    for stage in evaluate:
        call(stage, "eval", 1, 0, "run-a")
    for stage in train:
        pulls[(stage.key, 0, 2)] = call(stage, "train", 2, 0, "run-a")
    for stage in train:  # a new run token: static rows are pulled again
        pulls[(stage.key, 0, "b")] = call(stage, "train", 1, 0, "run-b")
    (last,) = [s for s in train if s.grad and s.layer == len(spec.layers) - 1]
    call(last, "train", 3, 1, "run-b", grad=False)  # an event without grad pushes no dW

    # the concrete cases, spelled out
    av0 = next(s for s in train if s.key == ("AV", 0))
    if av0.reads == ("X", "ids"):  # project first: AV0 reads only static rows
        assert pulls[(("AV", 0), 0, 1)] == ["X", "ids"]
        assert pulls[(("AV", 0), 1, 1)] == ["X", "ids"]  # another interval
        assert pulls[(("AV", 0), 0, 2)] == []            # the same (run, part, interval): no PULL at all
        assert pulls[(("AV", 0), 0, "b")] == ["X", "ids"]
    else:
        assert av0.reads == ("Z0",) and pulls[(("AV", 0), 0, 2)] == ["Z0"]
    loss = next(s for s in train if "LOSS" in s.task)
    assert pulls[(loss.key, 0, 1)][-2:] == ["labels", "split"]
    assert "labels" not in pulls[(loss.key, 0, 2)] and pulls[(loss.key, 0, "b")][-2:] == ["labels", "split"]
    assert {s.weights for s in train} >= {"pin", "stash"}


def test_the_two_pulls_and_the_two_pushes_overlap(setup):
    """Each server answers only once the other has its request: a handler that waited for one
    reply before sending to the other server would time out here."""
    _, plan, servers = setup
    stage = next(s for s in plan.train if s.kind == FUNCTION and s.grad and s.weights)
    servers.answer_after = {Op.PULL: Op.PULL_WEIGHTS, Op.PULL_WEIGHTS: Op.PULL,
                            Op.PUSH: Op.PUSH_GRADS, Op.PUSH_GRADS: Op.PUSH}
    event = make_event(servers, stage, "train", 1, 0, "run-overlap")
    summary = handler(event, LambdaContext(remaining_ms=5000))
    assert summary["result"]["version"] == VERSION
    peers = handler_module._peers
    assert peers[servers.graph_endpoint].link is peers[servers.params_endpoint].link  # one cap per call
    assert [h.op for _, h, _ in servers.take_log()][-2:] in ([Op.PUSH_GRADS, Op.PUSH], [Op.PUSH, Op.PUSH_GRADS])


def test_a_calls_transfers_share_the_bandwidth_cap():
    """Under the emulator's cap, transfers sent together queue for the link: two of 0.1 s each
    take 0.2 s, not 0.1 s. Without a cap, nothing waits."""
    link = handler_module._Link(1000.0)  # bytes per second
    start = time.monotonic()
    link.hold(start, 100)
    link.hold(start, 100)
    assert time.monotonic() - start >= 0.2
    start = time.monotonic()
    handler_module._Link(None).hold(start, 10**9)
    assert time.monotonic() - start < 0.1


def test_server_error_is_a_named_function_error(setup):
    _, plan, servers = setup
    stage = next(s for s in plan.train if s.kind == FUNCTION and s.grad)
    servers.refuse = {Op.PUSH}
    event = make_event(servers, stage, "train", 4, 1, "run-x")
    with pytest.raises(FunctionTaskError, match=rf"{stage.task} interval 1 epoch 4 layer {stage.layer} \(part 1\).*"
                                                r"refused PUSH: bad_field: refused by the test"):
        handler(event, LambdaContext())
    assert Op.PUSH in [h.op for _, h, _ in servers.take_log()]


def test_silent_server_times_out_within_the_deadline(setup):
    _, plan, servers = setup
    stage = next(s for s in plan.train if s.kind == FUNCTION and s.weights)
    servers.ignore = {Op.PULL_WEIGHTS}
    event = make_event(servers, stage, "train", 1, 0, "run-y")
    # 700 ms left, 500 ms kept as margin: the handler waits 0.2 s, not MAX_WAIT_S
    with pytest.raises(FunctionTaskError, match="did not answer PULL_WEIGHTS"):
        handler(event, LambdaContext(remaining_ms=700))


def test_sparse_features_arrive_as_csr_and_stay_cached(monkeypatch):
    """X as SparseRows on the graph server: the function pulls it once per (run, part, interval)
    as CSR, keeps SparseRows, and pushes what the dense rows give (CSR sums in another order than
    BLAS: float32 rounding, 1e-5)."""
    from dorylus.models.sparse import SparseRows

    monkeypatch.setattr(handler_module, "_static_rows", {})
    spec = make_spec((8, 4, 7))  # layer 0 projects first: AV and AV_BWD read X
    plan = gcn.build_plan(spec)
    buffers = make_buffers(plan, 8, 7)
    dense_x = np.where(np.random.default_rng(5).random((N_ROWS, 8)) < 0.3, buffers["X"], 0).astype(np.float32)
    buffers["X"] = SparseRows.from_dense(dense_x)
    servers = FakeServers(buffers, spec.init_params(SEED))
    try:
        av, av_bwd = (next(s for s in plan.train if s.key == key) for key in (("AV", 0), ("AV_BWD", 0)))
        for epoch, stage in ((1, av), (1, av_bwd), (2, av)):
            event = make_event(servers, stage, "train", epoch, 1, "run-s")
            handler(event, LambdaContext())
            log = servers.take_log()
            pulls = [h for _, h, _ in log if h.op is Op.PULL]
            wanted = [n for n in stage.reads if n not in ("X", "ids")]
            assert [list(h.names) for h in pulls] == ([["X", "ids"]] if (epoch, stage) == (1, av) else
                                                      [wanted] if wanted else [])
            start, stop = event["rows"]
            rows = [dense_x[start:stop] if n == "X" else buffers[n][start:stop] for n in stage.reads]
            expected = gcn.compute(stage.task, 0, rows, servers.layer_params[0], event["args"])
            pushed = [t for _, h, t in log if h.op is Op.PUSH]
            assert len(pushed) == (1 if stage.writes else 0)  # layer 0's backward writes no rows
            for got, want in zip(pushed[0] if pushed else [], expected.rows):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            if stage.grad:
                (grads,) = [dict(zip(h.names, t)) for _, h, t in log if h.op is Op.PUSH_GRADS]
                assert list(grads) == list(expected.grads)
                for name, want in expected.grads.items():
                    np.testing.assert_allclose(grads[name], want, rtol=1e-5, atol=1e-5)
        cached = handler_module._static_rows[("run-s", PART, 1, "X")]
        assert isinstance(cached, SparseRows)
        np.testing.assert_array_equal(cached.toarray(), dense_x[slice(*INTERVALS[1])])
    finally:
        servers.close()
    assert not servers.errors, servers.errors


def test_a_cache_miss_pulls_dense_static_rows_a_block_at_a_time(monkeypatch):
    """With ``static_rows_per_pull`` below the interval's rows, the static names come in pulls of
    that many rows (beside one pull of the others, whole), assembled in order: the rows computed
    on and cached equal the interval's."""
    monkeypatch.setattr(handler_module, "_static_rows", {})
    spec = make_spec((8, 4, 7))  # layer 0 projects X first; layer 1 gathers first: AV_LOSS reads Z1
    plan = gcn.build_plan(spec)
    buffers = make_buffers(plan, 8, 7)
    servers = FakeServers(buffers, spec.init_params(SEED))
    try:
        av = next(s for s in plan.train if s.key == ("AV", 0))
        loss = next(s for s in plan.train if s.task == "AV_LOSS")
        for stage, dynamic in ((av, []), (loss, ["Z1"])):
            event = make_event(servers, stage, "train", 1, 1, "run-blocks", static_rows_per_pull=4)
            handler(event, LambdaContext())
            log = servers.take_log()
            pulls = sorted((list(h.names), h.rows) for _, h, _ in log if h.op is Op.PULL)
            static = [n for n in stage.reads if n in STATIC]
            assert pulls == sorted(([(dynamic, (4, 10))] if dynamic else []) + [(static, (4, 8)), (static, (8, 10))])
            expected = gcn.compute(stage.task, stage.layer, [buffers[n][4:10] for n in stage.reads],
                                   servers.layer_params[stage.layer], event["args"])
            pushed = [t for _, h, t in log if h.op is Op.PUSH]
            assert len(pushed) == (1 if stage.writes else 0)  # layer 0's backward writes no rows
            for got, want in zip(pushed[0] if pushed else [], expected.rows):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
            for name in static:
                cached = handler_module._static_rows[("run-blocks", PART, 1, name)]
                np.testing.assert_array_equal(cached, buffers[name][4:10])
    finally:
        servers.close()
    assert not servers.errors, servers.errors


def test_static_rows_of_two_graph_servers_share_a_warm_container(monkeypatch):
    """Calls of two graph servers (two run tokens, different X) alternate on one container, as
    on the emulator's and Lambda's warm sandboxes: each server's static rows are pulled once and
    then served from the cache, never the other server's rows (every push is checked against
    gcn.compute on the calling server's own rows). A cache that cleared itself on another run
    token pulled X on every call of a 2-part run."""
    monkeypatch.setattr(handler_module, "_static_rows", {})
    spec = make_spec((8, 4, 7))  # layer 0 projects first: AV and AV_BWD read X and ids
    plan = gcn.build_plan(spec)
    av, av_bwd = (next(s for s in plan.train if s.key == key) for key in (("AV", 0), ("AV_BWD", 0)))
    servers = {}
    try:
        for run, seed in (("gs-a", 0), ("gs-b", 1)):
            buffers = make_buffers(plan, 8, 7)
            buffers["X"] = np.random.default_rng(100 + seed).standard_normal((N_ROWS, 8)).astype(np.float32)
            servers[run] = FakeServers(buffers, spec.init_params(SEED))
        pulls = []
        for epoch in (1, 2, 3):
            for run in ("gs-a", "gs-b"):
                for stage in (av, av_bwd):
                    event = make_event(servers[run], stage, "train", epoch, 1, run)
                    first = epoch == 1 and stage is av
                    expected = ["X", "ids"] if first else [n for n in stage.reads if n not in STATIC]
                    _check_call(servers[run], stage, event, expected, grad=stage.grad)
                    pulls.append(expected)
        # another interval of a cached server is its own entry
        event = make_event(servers["gs-a"], av, "train", 4, 0, "gs-a")
        _check_call(servers["gs-a"], av, event, ["X", "ids"], grad=False)
        assert {key[:3] for key in handler_module._static_rows} == {("gs-a", PART, 1), ("gs-b", PART, 1),
                                                                   ("gs-a", PART, 0)}
    finally:
        for s in servers.values():
            s.close()
    for s in servers.values():
        assert not s.errors, s.errors


def test_static_row_cache_is_bounded_least_recently_used_first(monkeypatch):
    """The cache keeps at most its byte limit, evicting the least recently used rows; rows larger
    than the limit are not kept; cached rows of another length than the call's interval are a
    miss, not a wrong answer."""
    monkeypatch.setattr(handler_module, "_static_rows", {})
    put, get = handler_module._cache_put, handler_module._cache_get
    rows = {k: np.full((10, 5), k, np.float32) for k in range(4)}  # 200 bytes each
    put(("r", 0, 0, "X"), rows[0], limit=450)
    put(("r", 0, 1, "X"), rows[1], limit=450)
    assert get(("r", 0, 0, "X"), 10) is rows[0]  # interval 0 is now the most recently used
    put(("r", 0, 2, "X"), rows[2], limit=450)     # evicts interval 1, not 0
    assert get(("r", 0, 1, "X"), 10) is None
    assert get(("r", 0, 0, "X"), 10) is rows[0] and get(("r", 0, 2, "X"), 10) is rows[2]
    assert sum(a.nbytes for a in handler_module._static_rows.values()) <= 450
    put(("r", 0, 3, "X"), np.zeros((100, 5), np.float32), limit=450)  # 2,000 bytes: never kept
    assert get(("r", 0, 3, "X"), 100) is None and len(handler_module._static_rows) == 2
    assert get(("r", 0, 0, "X"), 9) is None  # another row count than the interval's: pulled again
