"""Cluster mode on 127.0.0.1: ``dorylus train --cluster FILE`` against servers started by hand.

The parameter server, two graph servers and the Lambda emulator run as separate ``dorylus``
processes with CURVE keys from ``dorylus keys``; the cluster file names them and sends the
invokes to the emulator. A sync run there equals the single-process reference of the same config
per epoch (as local mode does: test_sync_exactness.py);
a coordinator started before the servers waits for them; servers refuse a coordinator whose
config differs (nothing written) and clients without the right key; a bad cluster file is one
clear error with exit status 2.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dorylus import curve
from dorylus.cli import main as cli_main
from dorylus.config import TrainConfig
from dorylus.protocol import Header, Op
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from tests.distributed.cluster_env import REPO, ask, make_env
from tests.graphs import random_graph

EPOCHS = 3
GRAPH = dict(num_nodes=80, num_edges=300, num_features=6, num_classes=3)
CONFIG = TrainConfig(backend="lambda", hidden=4, epochs=EPOCHS, functions=2, task_timeout_s=60, watchdog_min_s=20)


@pytest.fixture
def env(tmp_path):
    env = make_env(tmp_path, random_graph(**GRAPH), CONFIG)
    try:
        yield env
    finally:
        env.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Servers that wait for a coordinator (none ever trains on them here)."""
    env = make_env(tmp_path_factory.mktemp("live"), random_graph(**GRAPH), CONFIG)
    try:
        env.start_emulator()
        env.write_cluster_file()
        env.start_servers()
        env.wait_ready()
        yield env
    finally:
        env.stop()


def _train(*args: str, timeout: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dorylus.cli", "train", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_cluster_run_equals_the_reference_and_stops_the_servers(env, tmp_path):
    env.start_emulator()
    cluster_file = env.write_cluster_file()
    # The coordinator starts first and waits for the servers, as after a reboot.
    coordinator = _train("--cluster", str(cluster_file), "--config", str(env.config_file),
                         "--run-dir", str(tmp_path / "cluster-run"))
    try:
        time.sleep(0.5)
        env.start_servers()
        local = tmp_path / "reference-run"
        run_training(TrainConfig(**{**CONFIG.to_dict(), "backend": "reference", "run_dir": str(local)}),
                     random_graph(**GRAPH), progress=io.StringIO())
        out, err = coordinator.communicate(timeout=120)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait(timeout=10)
    assert coordinator.returncode == 0, err[-3000:]
    got, want = read_metrics(tmp_path / "cluster-run"), read_metrics(local)
    assert [m["epoch"] for m in got] == list(range(1, EPOCHS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]
        for split in ("train", "val", "test"):
            assert g[f"{split}_acc"] == pytest.approx(w[f"{split}_acc"], abs=1.5 / GRAPH["num_nodes"])
        assert g["calls"] > 0  # the graph servers invoked the function
    summary = json.loads((tmp_path / "cluster-run" / "summary.json").read_text())
    assert summary["cluster"] == str(cluster_file) and summary["parts"] == 2
    saved = json.loads((tmp_path / "cluster-run" / "config.json").read_text())
    assert saved["partitions"] == str(env.store)
    # Every connection used CURVE, and the run ended by stopping the servers (its key only).
    for name in ("paramserver", "graphserver-0", "graphserver-1"):
        assert "CURVE on" in env.log(name)
        assert "SHUTDOWN from coordinator" in env.log(name)
        assert env.server(name).wait(timeout=20) == 0
    assert "Traceback" not in err


def test_servers_started_with_another_config_are_refused_nothing_written(live, tmp_path):
    run = tmp_path / "run"
    process = _train("--cluster", str(live.cluster_file), "--config", str(live.config_file), "--hidden", "5",
                     "--lr", "0.02", "--run-dir", str(run))
    out, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("dorylus train: error: parameter server at tcp://127.0.0.1:") and \
        "hidden (server 4, here 5)" in lines[-1] and "lr (server 0.01, here 0.02)" in lines[-1], err
    assert not run.exists()
    # Nothing changed on the servers: they still wait, and answer the coordinator.
    ready = ask(live.graph_endpoint(0), Header(Op.HELLO, role="coordinator"), keys=live.key("coordinator"))
    assert ready is not None and ready.op is Op.READY and ready.meta["part"] == 0
    assert ready.meta["endpoint"] == live.graph_endpoint(0)


def _stranger(live, role: str = "function") -> curve.Keyring:
    """A key pair nobody listed, that knows the servers' public keys."""
    public, secret = zmq.curve_keypair()
    publics = {r: live.key("coordinator").publics[r] for r in curve.SERVER_ROLES}
    return curve.Keyring(role, public, secret, {**publics, role: public})


@pytest.mark.parametrize("server_role", ["graphserver", "paramserver"])
def test_clients_without_the_right_key_get_no_answer(live, server_role):
    endpoint = live.graph_endpoint(1) if server_role == "graphserver" else live.ps_endpoint
    hello = Header(Op.HELLO, role="coordinator")
    assert ask(endpoint, hello, keys=None, server_role=server_role, timeout=1.0) is None
    assert ask(endpoint, hello, keys=_stranger(live), server_role=server_role, timeout=1.0) is None
    assert ask(endpoint, Header(Op.SHUTDOWN), keys=_stranger(live, "coordinator"), server_role=server_role,
               timeout=1.0) is None
    # ... while a legitimate client is served, and the server keeps running.
    ready = ask(endpoint, hello, keys=live.key("function"), server_role=server_role)
    assert ready is not None and ready.op is Op.READY


def test_roles_may_send_only_their_own_operations(live):
    function, peer = live.key("function"), live.key("graphserver")
    endpoint = live.graph_endpoint(0)
    for header, keys in [(Header(Op.SHUTDOWN), function), (Header(Op.SHUTDOWN), peer),
                         (Header(Op.COMMAND, meta={"command": "progress", "min_epoch": 99}), function),
                         (Header(Op.STATS), function)]:
        reply = ask(endpoint, header, keys=keys)
        assert reply is not None and (reply.op, reply.code) == (Op.ERROR, "forbidden"), (header.op, reply)
    reply = ask(live.ps_endpoint, Header(Op.COMMAND, meta={"command": "set_state", "version": 9, "epoch": 9,
                                                           "optimizer": "adam"}),
                keys=function, server_role="paramserver")
    assert (reply.op, reply.code) == (Op.ERROR, "forbidden")
    assert "SHUTDOWN from function" in live.log("graphserver-0") and "refused" in live.log("graphserver-0")
    stats = ask(endpoint, Header(Op.STATS), keys=live.key("coordinator"))
    assert stats.meta["rejected.forbidden"] >= 4
    for name in ("paramserver", "graphserver-0"):
        assert live.server(name).poll() is None


def test_far_future_ghosts_are_refused_and_counted_not_buffered(live):
    peer, coordinator = live.key("graphserver"), live.key("coordinator")
    endpoint = live.graph_endpoint(0)
    before = ask(endpoint, Header(Op.STATS), keys=coordinator).meta
    rows = np.ones((1, 4), np.float32)
    for epoch in range(10, 210):
        reply = ask(endpoint, Header(Op.GHOSTS, task="SC", epoch=epoch, layer=0, part=1, rows=(0, 1), names=("H",)),
                    keys=peer, tensors=[rows])
        assert (reply.op, reply.code) == (Op.ERROR, "epoch_ahead"), reply
    after = ask(endpoint, Header(Op.STATS), keys=coordinator).meta
    assert after.get("rejected.epoch_ahead", 0) - before.get("rejected.epoch_ahead", 0) == 200
    assert after["buffered_ghosts"] == before["buffered_ghosts"] == 0
    # a function's far-future PUSH too
    reply = ask(endpoint, Header(Op.PUSH, task="AV", epoch=500, layer=0, interval=0, rows=(0, 1), names=("P0",)),
                keys=live.key("function"), tensors=[rows])
    assert (reply.op, reply.code) == (Op.ERROR, "epoch_ahead")


def test_an_oversized_frame_is_dropped_and_the_server_still_serves(live):
    coordinator = live.key("coordinator")
    endpoint = live.graph_endpoint(1)
    limit = ask(endpoint, Header(Op.HELLO, role="coordinator"), keys=coordinator).meta["max_message_bytes"]
    assert limit < 2 << 20  # a tiny partition: the limit is the 1 MiB floor
    huge = np.zeros(limit // 4 + 1024, np.float32)
    header = Header(Op.GHOSTS, task="SC", epoch=1, layer=0, part=0, rows=(0, huge.size), names=("H",))
    assert ask(endpoint, header, keys=live.key("graphserver"), tensors=[huge[:, None]], timeout=1.5) is None
    assert ask(endpoint, Header(Op.HELLO, role="coordinator"), keys=coordinator).op is Op.READY
    assert live.server("graphserver-1").poll() is None


# ----------------------------------------------------------------------------- bad cluster files


def _good_cluster(tmp_path: Path) -> dict:
    return {"format": "dorylus-cluster/1", "region": "us-east-1", "store": str(tmp_path / "store"),
            "function": {"name": "f"}, "param_servers": [{"index": 0, "host": "127.0.0.1", "port": 5600}],
            "graph_servers": [{"part": 0, "host": "127.0.0.1", "port": 5500},
                              {"part": 1, "host": "127.0.0.1", "port": 5501}]}


@pytest.mark.parametrize("change, words", [
    (lambda c: c.update(format="dorylus-cluster/9"), "format must be 'dorylus-cluster/1'"),
    (lambda c: c["graph_servers"][1].update(port="x"), "graph_servers[1].port must be an integer from 1 to 65535"),
    (lambda c: c["graph_servers"][1].update(part=0), "graph_servers[1].part 0 is listed twice"),
    (lambda c: c.pop("function"), "function must be a JSON object"),
    (lambda c: c.update(param_servers=[]), "param_servers must list exactly one parameter server"),
    (lambda c: c.update(regoin="us-east-1"), "unknown key(s) regoin"),
    (lambda c: c["param_servers"][0].update(host="0.0.0.0"), "param_servers[0].host '0.0.0.0' is not an address"),
    (lambda c: c["function"].update(endpoint_url="ftp://x"), "function.endpoint_url 'ftp://x' is not an http(s) URL"),
    (lambda c: c.update(recovery_wait_s=0), "recovery_wait_s must be an integer from 1 to 3600, got 0"),
    (lambda c: c.update(recovery_wait_s=1.5), "recovery_wait_s must be an integer from 1 to 3600, got 1.5"),
    (None, "is not valid JSON"),
])
def test_a_malformed_cluster_file_is_one_clear_error(tmp_path, capsys, change, words):
    path = tmp_path / "cluster.json"
    if change is None:
        path.write_text('{"format": "dorylus-cluster/1",')
    else:
        cluster = _good_cluster(tmp_path)
        change(cluster)
        path.write_text(json.dumps(cluster))
    run = tmp_path / "run"
    assert cli_main(["train", "--cluster", str(path), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dorylus train: error: cluster file {path}") and words in err, err
    assert len(err.splitlines()) == 1 and not run.exists()


def test_cluster_mode_without_keys_is_refused(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_good_cluster(tmp_path)))
    assert cli_main(["train", "--cluster", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "cluster mode needs CURVE keys" in err and "dorylus keys --out DIR" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_cluster_run_resumes_on_restarted_servers(env, tmp_path):
    """Two epochs, the servers stop with the run and start again (as systemd restarts them), and
    ``--resume --cluster`` trains the third: the three epochs equal an uninterrupted local run."""
    env.start_emulator()
    cluster_file = env.write_cluster_file()
    run = tmp_path / "run"
    for args in (["--config", str(env.config_file), "--run-dir", str(run), "--epochs", "2"],
                 ["--resume", str(run), "--epochs", str(EPOCHS)]):
        env.start_servers()
        process = _train("--cluster", str(cluster_file), *args)
        try:
            _, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        assert process.returncode == 0, err[-3000:]
        for name in ("paramserver", "graphserver-0", "graphserver-1"):
            assert env.server(name).wait(timeout=20) == 0
        env.forget_exited()
    local = tmp_path / "local"
    run_training(TrainConfig(**{**CONFIG.to_dict(), "run_dir": str(local)}), random_graph(**GRAPH),
                 progress=io.StringIO())
    got, want = read_metrics(run), read_metrics(local)
    assert [m["epoch"] for m in got] == list(range(1, EPOCHS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]


@pytest.mark.slow
def test_a_server_left_with_an_earlier_runs_state_is_restarted_before_training(env, tmp_path):
    """A coordinator that died after connecting graph server 1 left it with its run's state; the
    next coordinator stops it, waits for it to come back fresh (here started by hand, as systemd
    would), and trains."""
    env.start_emulator()
    cluster_file = env.write_cluster_file()
    env.start_servers()
    env.wait_ready()
    peers = ",".join(env.graph_endpoint(p) for p in range(env.parts))
    reply = ask(env.graph_endpoint(1), Header(Op.COMMAND, meta={"command": "connect", "peers": peers}),
                keys=env.key("coordinator"), timeout=30)
    assert reply is not None and reply.op is Op.ACK
    run = tmp_path / "run"
    coordinator = _train("--cluster", str(cluster_file), "--config", str(env.config_file), "--run-dir", str(run),
                         "--cluster-wait-s", "90")
    try:
        assert env.server("graphserver-1").wait(timeout=60) == 0  # stopped by the new coordinator
        env.forget_exited()
        env.start_graph_server(1)
        _, err = coordinator.communicate(timeout=120)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait(timeout=10)
    assert coordinator.returncode == 0, err[-3000:]
    assert f"graph server 1 at {env.graph_endpoint(1)} holds an earlier run's state" in err
    assert [m["epoch"] for m in read_metrics(run)] == list(range(1, EPOCHS + 1))
