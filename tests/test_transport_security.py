"""Transport security (DESIGN §5, issue 10 item 5) at the parameter server and in ``dorylus keys``.

Each attack the issue lists is a test that now fails to change the run: a client without a key
or with an unknown key gets no answer at all, a function's key cannot stop the server or
replace its state, far-future gradients and pins are refused and counted (nothing buffered),
an oversized frame is dropped by ZeroMQ, and no command reads or writes a file.
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import zmq

from dorylus import curve, protocol, sockets
from dorylus.cli import main as cli_main
from dorylus.errors import ConfigError
from dorylus.config import TrainConfig
from dorylus.models.spec import ModelSpec
from dorylus.paramserver import ParameterServer
from dorylus.protocol import Header, Op

SPEC = ModelSpec.from_config(TrainConfig(layers=2, hidden=4), 6, 3)  # weight [6, 4] bias [4], weight [4, 3] bias [3]
GRAD_NAMES = ("weight", "bias")
WAIT_S = 5.0
QUIET_S = 1.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys") / "keys"
    curve.write_keys(directory)
    return directory


class Peer:
    """A DEALER with a role's keys (or none), for one server."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: curve.Keyring | None, max_bytes: int = 64 << 20):
        self.sock = sockets.client_socket(ctx, endpoint, keys=keys, server_role="paramserver", max_bytes=max_bytes)

    def ask(self, header: Header, tensors=(), timeout: float = WAIT_S) -> Header | None:
        protocol.send(self.sock, header, tensors)
        try:
            return protocol.recv(self.sock, timeout=timeout)[0]
        except TimeoutError:
            return None


@pytest.fixture
def server(keys):
    """A parameter server with CURVE (staleness 1), and ``peer(role)`` clients; all closed afterwards."""
    ctx = zmq.Context()
    ps = ParameterServer(SPEC, 0, staleness=1, keys=curve.load_keys(keys, "paramserver")).start()
    peers = []

    def peer(role: str | None, keyring: curve.Keyring | None = None) -> Peer:
        peers.append(Peer(ctx, ps.endpoint, keyring or (curve.load_keys(keys, role) if role else None)))
        return peers[-1]

    try:
        yield ps, peer
    finally:
        for p in peers:
            p.sock.close(linger=0)
        if not ps.closed:
            ps.close(timeout=WAIT_S)
        ctx.destroy(linger=0)


def _stranger(keys) -> curve.Keyring:
    public, secret = zmq.curve_keypair()
    real = curve.load_keys(keys, "function")
    return curve.Keyring("function", public, secret, {**real.publics, "function": public})


def test_no_key_or_an_unknown_key_gets_no_answer_and_the_server_keeps_serving(server, keys):
    ps, peer = server
    hello = Header(Op.HELLO, role="function")
    assert peer(None).ask(hello, timeout=QUIET_S) is None
    assert peer(None, _stranger(keys)).ask(hello, timeout=QUIET_S) is None
    # a stolen public key is no good without its secret: the handshake fails
    real = curve.load_keys(keys, "coordinator")
    forged = curve.Keyring.__new__(curve.Keyring)  # skips the check that would refuse this pair
    object.__setattr__(forged, "public", real.public)
    object.__setattr__(forged, "secret", zmq.curve_keypair()[1])
    object.__setattr__(forged, "publics", real.publics)
    assert peer(None, forged).ask(Header(Op.SHUTDOWN), timeout=QUIET_S) is None
    for role in ("function", "graphserver", "coordinator"):
        reply = peer(role).ask(hello)
        assert reply is not None and reply.op is Op.READY, role
    assert not ps.closed


def test_only_the_coordinator_may_stop_the_server_or_replace_its_state(server, caplog):
    caplog.set_level("INFO", logger="dorylus.curve")
    ps, peer = server
    function, graph = peer("function"), peer("graphserver")
    for client, header in [(function, Header(Op.SHUTDOWN)), (graph, Header(Op.SHUTDOWN)),
                           (function, Header(Op.COMMAND, meta={"command": "set_state"})),
                           (graph, Header(Op.COMMAND, meta={"command": "step", "epoch": 1})),
                           (function, Header(Op.STATS))]:
        reply = client.ask(header)
        assert (reply.op, reply.code) == (Op.ERROR, "forbidden"), header
    assert any("SHUTDOWN from function" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    # what a graph server legitimately asks still works
    assert graph.ask(Header(Op.COMMAND, meta={"command": "wait_version", "version": 0})).op is Op.ACK
    coordinator = peer("coordinator")
    assert coordinator.ask(Header(Op.STATS)).meta["errors.forbidden"] == 5
    assert coordinator.ask(Header(Op.SHUTDOWN)).op is Op.ACK
    assert ps.join(WAIT_S)
    assert any("SHUTDOWN from coordinator" in r.getMessage() and r.levelname == "INFO" for r in caplog.records)


def test_without_keys_shutdown_is_logged_with_its_sender(caplog):
    caplog.set_level("INFO", logger="dorylus.curve")
    with ParameterServer(SPEC, 0) as ps:
        ctx = zmq.Context()
        try:
            reply = Peer(ctx, ps.endpoint, None).ask(Header(Op.SHUTDOWN))
            assert reply.op is Op.ACK
            assert ps.join(WAIT_S)
        finally:
            ctx.destroy(linger=0)
    err = caplog.text
    assert "paramserver: SHUTDOWN from a client without CURVE (identity " in err and "address 127.0.0.1" in err


def test_far_future_gradients_and_pins_are_refused_counted_and_not_buffered(server):
    ps, peer = server
    function, coordinator = peer("function"), peer("coordinator")
    grad = [np.ones((6, 4), np.float32), np.ones(4, np.float32)]
    # stepped 0 epochs, staleness 1: epochs up to 0 + 1 + 1 + 1 = 3 are acceptable
    assert function.ask(Header(Op.PUSH_GRADS, layer=0, epoch=3, interval=0, version=0, names=GRAD_NAMES),
                        grad).op is Op.ACK
    for epoch in range(4, 2004):
        reply = function.ask(Header(Op.PUSH_GRADS, layer=0, epoch=epoch, interval=0, version=0, names=GRAD_NAMES),
                             grad)
        assert (reply.op, reply.code) == (Op.ERROR, "epoch_ahead"), epoch
    for epoch in (4, 10**9):
        reply = function.ask(Header(Op.PULL_WEIGHTS, layer=0, epoch=epoch, interval=0, meta={"weights": "pin"}))
        assert (reply.op, reply.code) == (Op.ERROR, "epoch_ahead")
    stats = coordinator.ask(Header(Op.STATS)).meta
    assert stats["errors.epoch_ahead"] == 2002
    assert (stats["pending_grads"], stats["pinned"], stats["stashed_versions"]) == (1, 0, 1)


def test_an_oversized_frame_is_dropped_and_the_server_still_serves(server):
    ps, peer = server
    function = peer("function")
    limit = function.ask(Header(Op.HELLO, role="function")).meta["max_message_bytes"]
    assert limit == ps.max_message_bytes == sockets.message_limit(6 * 4 * 4) == 1 << 20
    huge = np.zeros((limit // 16 + 1, 4), np.float32)  # one frame just over the limit
    assert function.ask(Header(Op.PUSH_GRADS, layer=0, epoch=1, interval=0, version=0, names=("weight",)), [huge],
                        timeout=QUIET_S) is None
    # ZeroMQ dropped the connection, not the server: the same peer reconnects and is served
    assert function.ask(Header(Op.HELLO, role="function")).op is Op.READY
    assert peer("coordinator").ask(Header(Op.STATS)).meta["pushes"] == 0


@pytest.mark.parametrize("command", ["save", "load"])
def test_no_command_reads_or_writes_a_file(server, tmp_path, command):
    """The parameter server once had save/load {path}; its state now travels only as tensors
    (get_state/set_state) and the coordinator writes checkpoints, so a path anywhere, inside
    the run directory or not, is refused and nothing is read or written."""
    ps, peer = server
    coordinator = peer("coordinator")
    before = coordinator.ask(Header(Op.COMMAND, meta={"command": "get_weights"}))
    victim = tmp_path / "victim.npz"
    victim.write_bytes(b"keep me")
    for path in (victim, tmp_path / "new.npz", "/etc/passwd"):
        reply = coordinator.ask(Header(Op.COMMAND, meta={"command": command, "path": str(path)}))
        assert (reply.op, reply.code) == (Op.ERROR, "bad_command")
    assert victim.read_bytes() == b"keep me" and not (tmp_path / "new.npz").exists()
    assert coordinator.ask(Header(Op.COMMAND, meta={"command": "get_weights"})).version == before.version


# ----------------------------------------------------------------------------- keys


def test_keys_command_writes_private_pairs_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "keys"
    assert cli_main(["keys", "--out", str(out)]) == 0
    assert "curve.tfvars.json" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([f"{r}.{k}" for r in curve.ROLES for k in ("public", "secret")] + ["curve.tfvars.json"])
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    keyrings = {role: curve.load_keys(out, role) for role in curve.ROLES}
    assert len({k.public for k in keyrings.values()}) == 4
    tfvars = json.loads((out / "curve.tfvars.json").read_text())
    assert tfvars["curve_public_keys"]["function"] == keyrings["function"].public.decode()
    assert tfvars["curve_secret_keys"]["coordinator"] == keyrings["coordinator"].secret.decode()

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli_main(["keys", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dorylus keys: error: refusing to overwrite CURVE keys") and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_function_reads_its_keys_from_the_environment(keys):
    env = curve.function_environment(keys)
    assert set(env) == {"DORYLUS_CURVE_FUNCTION_PUBLIC", "DORYLUS_CURVE_FUNCTION_SECRET",
                        "DORYLUS_CURVE_GRAPHSERVER_PUBLIC", "DORYLUS_CURVE_PARAMSERVER_PUBLIC"}
    keyring, stored = curve.keys_from_env("function", env), curve.load_keys(keys, "function")
    assert (keyring.public, keyring.secret) == (stored.public, stored.secret)
    assert keyring.publics == {role: stored.publics[role] for role in ("function", "graphserver", "paramserver")}
    assert curve.keys_from_env("function", {}) is None
    with pytest.raises(ConfigError, match="DORYLUS_CURVE_FUNCTION_SECRET is not set"):
        curve.keys_from_env("function", {k: v for k, v in env.items() if not k.endswith("SECRET")})
    with pytest.raises(ConfigError, match="missing the public key of paramserver"):
        curve.keys_from_env("function", {k: v for k, v in env.items() if "PARAMSERVER" not in k})
    with pytest.raises(ConfigError, match="not a Z85-encoded CURVE key|a CURVE key is 40"):
        curve.keys_from_env("function", {**env, "DORYLUS_CURVE_FUNCTION_SECRET": "x" * 39})


def test_bad_key_files_are_clear_errors(tmp_path):
    out = tmp_path / "keys"
    curve.write_keys(out)
    os.chmod(out / "graphserver.secret", 0o644)
    with pytest.raises(ConfigError, match=r"graphserver.secret is readable by other users \(mode 0644\)"):
        curve.load_keys(out, "graphserver")
    os.chmod(out / "graphserver.secret", 0o600)
    (out / "coordinator.secret").write_text((out / "function.secret").read_text())
    with pytest.raises(ConfigError, match="the secret key does not belong to the public key"):
        curve.load_keys(out, "coordinator")
    (out / "function.public").unlink()
    with pytest.raises(ConfigError, match="missing the public key of function"):
        curve.load_keys(out, "paramserver")
