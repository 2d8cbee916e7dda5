"""Roles that come back in cluster mode (issue 21 item 2): ``dorylus train --cluster FILE``
against servers started by hand on 127.0.0.1 (tests/distributed/cluster_env.py), one of which is
killed with SIGKILL mid-run. The test plays the servers' service manager (systemd's
``Restart=always``): what exits is started again at its address. The coordinator sees the dead
role's connection close, stops the roles that survived (they hold the run's state), waits for all
of them to answer afresh and resumes from the last finished epoch: the command exits 0 and its
per-epoch metrics equal an uninterrupted run's. With no replacement within the cluster file's
``recovery_wait_s`` the run stops with one error naming the role, and a checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dorylus.config import TrainConfig
from dorylus.coordinator.errors import RoleDied
from dorylus.data.loaders import load_dataset
from dorylus.coordinator.remote import HeartbeatWatchdog, RemoteRole
from dorylus.runs import read_metrics
from tests.distributed.background import EPOCHS, assert_same_epochs
from tests.distributed.cluster_env import REPO, ClusterEnv, make_env
from tests.graphs import shared_data

KILL_AT = 3
# conftest.py's `uninterrupted` (the single-process reference of Cora with the defaults) is the
# oracle: the servers run the same model and options, on the cpu backend in sync mode.
CONFIG = TrainConfig(backend="cpu", epochs=EPOCHS, checkpoint_every=EPOCHS)
ROLES = ("paramserver", "graphserver-0", "graphserver-1")


@pytest.fixture
def env(tmp_path):
    env = make_env(tmp_path / "cluster", load_dataset(shared_data("cora.npz")), CONFIG, forked=True)
    try:
        yield env
    finally:
        env.stop()


class Coordinator:
    """``dorylus train --cluster`` in the background, its output in a file; killed when the test ends."""

    def __init__(self, env: ClusterEnv, run: Path):
        self.log = run.parent / "coordinator.log"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dorylus.cli", "train", "--cluster", str(env.cluster_file), "--config",
                 str(env.config_file), "--run-dir", str(run)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT)

    def wait_for_epoch(self, run: Path, epoch: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not ((run / "metrics.jsonl").exists() and any(m["epoch"] >= epoch for m in read_metrics(run))):
            assert self.process.poll() is None, f"training exited early: {self.output()[-2000:]}"
            assert time.monotonic() < deadline, f"training did not reach epoch {epoch}"
            time.sleep(0.02)

    def output(self) -> str:
        return self.log.read_text()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def _kill_mid_run(env: ClusterEnv, coordinator: Coordinator, run: Path, victim: str = "graphserver-1") -> None:
    coordinator.wait_for_epoch(run, KILL_AT)
    process = env.server(victim)
    process.kill()
    process.wait(timeout=10)


@pytest.mark.parametrize("victim, role", [
    ("graphserver-1", "graph server 1"),
    pytest.param("paramserver", "parameter server", marks=pytest.mark.slow),
])
def test_a_killed_role_comes_back_and_the_cluster_run_equals_an_uninterrupted_one(env, uninterrupted, tmp_path,
                                                                                 victim, role):
    env.write_cluster_file(recovery_wait_s=120)
    env.start_servers()
    run = tmp_path / "run"
    with Coordinator(env, run) as coordinator:
        _kill_mid_run(env, coordinator, run, victim)
        code = env.supervise(coordinator.process, run, restart_after_s=0.5, timeout_s=240)
    output = coordinator.output()
    assert code == 0, output[-3000:]
    assert f"{role} died during epoch" in output and "closed its connection" in output, output[-3000:]
    assert "recovery 1 of 3" in output and "recovery 2" not in output, output[-3000:]
    metrics = read_metrics(run)
    assert_same_epochs(metrics, uninterrupted)
    assert sum(m["recoveries"] for m in metrics) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recoveries"] == 1 and summary["epochs"] == EPOCHS
    since = summary["gradients"]["since_epoch"]  # the restarted parameter server's own count
    assert since > KILL_AT and summary["gradients"]["applied"] == 2 * 2 * 2 * (EPOCHS - since + 1)
    # The survivors were stopped (SHUTDOWN, status 0) and started afresh, the victim replaced;
    # the run's end stopped the second generation.
    for name in ROLES:
        started = [p for n, p, _ in env.processes if n == name]
        assert len(started) == 2, (name, len(started))
        assert started[0].returncode == (-9 if name == victim else 0), name
        assert started[1].wait(timeout=30) == 0, name


def test_no_replacement_within_the_wait_stops_the_run_naming_the_role_with_a_checkpoint(env, tmp_path):
    cluster_file = env.write_cluster_file(recovery_wait_s=2)
    env.start_servers()
    run = tmp_path / "run"
    with Coordinator(env, run) as coordinator:
        _kill_mid_run(env, coordinator, run)
        code = env.supervise(coordinator.process, run, restart_after_s=0.5, timeout_s=120, keep_down=frozenset(ROLES))
    output = coordinator.output()
    assert code == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("dorylus train: error:")]
    assert len(errors) == 1, output[-3000:]
    assert f"recovery after graph server 1 died: within 2 s (the cluster file's recovery_wait_s), no answer from " \
           f"graph server 1 at {env.graph_endpoint(1)}" in errors[0], errors[0]
    import torch

    saved = int(torch.load(run / "checkpoint.pt", weights_only=True)["epoch"])
    assert saved >= KILL_AT and saved == read_metrics(run)[-1]["epoch"] < EPOCHS
    assert f"run stopped by a failure after epoch {saved}; checkpoint {run / 'checkpoint.pt'}" in output
    assert f"dorylus train --resume {run} --cluster {cluster_file}" in output


def test_a_role_that_answers_no_heartbeat_is_taken_as_dead():
    """A host that vanished closes no connection: the heartbeat names it, as a death the run may
    recover from. The role that answers is not named."""
    ctx = zmq.Context()
    answering, silent = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    watchdog = HeartbeatWatchdog(ctx, min_s=0.3, factor=3.0, first_s=10.0)
    try:
        endpoints = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (answering, silent)]
        watchdog.watch(RemoteRole("parameter server", endpoints[0]), endpoints[0], "paramserver")
        watchdog.watch(RemoteRole("graph server 1", endpoints[1]), endpoints[1], "graphserver")
        deadline = time.monotonic() + 10
        with pytest.raises(RoleDied) as died:
            while time.monotonic() < deadline:
                while answering.poll(0, zmq.POLLIN):
                    answering.send_multipart(answering.recv_multipart())
                watchdog.check_heartbeats("epoch 4")
                time.sleep(0.02)
        assert died.value.role == "graph server 1", died.value
        assert f"graph server 1 (at {endpoints[1]}) has not answered a heartbeat" in str(died.value)
    finally:
        watchdog.close()
        answering.close(linger=0)
        silent.close(linger=0)
        ctx.term()
