"""Local mode authenticates its peers without options (issue 21 item 6): the roles listen on
Unix sockets in a directory of mode 0700, so a process of another user that knows a role's
address cannot reach it. Here a forger, started as root and then turned into ``nobody``, sends
PUSH_GRADS for every epoch of the run to the parameter server while it trains: the run's
epochs equal an uninterrupted run's, and the forger got no answer. The same script as the
run's own user does get an answer at that address, so the address was right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from dorylus.config import TrainConfig
from dorylus.models.spec import ModelSpec
from dorylus.runs import read_metrics
from tests.distributed.background import EPOCHS, REPO, assert_same_epochs

NOBODY = 65534
CORA_FEATURES, CORA_CLASSES = 1433, 7

# argv: endpoint, uid to become (-1: stay), the layers' gradient shapes (JSON), and the pid of the
# training to forge during (0: say HELLO only). Prints the rounds of pushes, the messages ZeroMQ
# took (queued or sent) and the replies received.
FORGER = r"""
import json, os, sys, time
import numpy as np, zmq
import zmq.utils.garbage  # imported lazily by a zero-copy send: after setuid a checkout under a
                          # directory only its owner may enter (mktemp -d) could not be read
from dorylus import protocol
from dorylus.protocol import Header, Op
endpoint, uid, layers, victim = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
socket = zmq.Context().socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.setsockopt(zmq.SNDTIMEO, 100)  # a DEALER without a connection blocks on send
socket.connect(endpoint)
rounds, sent, answered = 0, 0, 0


def send(*message):
    global sent
    try:
        protocol.send(socket, *message)
        sent += 1
    except zmq.Again:
        pass


def training():
    try:
        with open(f"/proc/{victim}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


send(Header(Op.HELLO, role="coordinator", req=1))
deadline = time.monotonic() + 300
while victim and training() and time.monotonic() < deadline:
    # Pushes for every epoch, part and interval: the one just ahead of the parameter server
    # is taken before the real one, which is then dropped as a duplicate.
    rounds += 1
    for epoch in range(1, %d + 1):
        for layer, shapes in enumerate(layers):
            for part in (0, 1):
                for interval in (0, 1):
                    send(Header(Op.PUSH_GRADS, layer=layer, epoch=epoch, interval=interval, part=part,
                                version=0, names=tuple(shapes), req=2),
                         [np.full(shape, 1e3, np.float32) for shape in shapes.values()])
    while socket.poll(0):
        socket.recv_multipart(); answered += 1
if socket.poll(10_000 if not victim else 1_000):
    answered += 1
print(json.dumps({"rounds": rounds, "sent": sent, "answered": answered, "uid": os.getuid()}))
""" % EPOCHS


def forger(endpoint: str, uid: int, victim: int) -> subprocess.Popen:
    layers = ModelSpec.from_config(TrainConfig(), CORA_FEATURES, CORA_CLASSES).param_shapes()
    return subprocess.Popen([sys.executable, "-c", FORGER, endpoint, str(uid), json.dumps(layers), str(victim)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def result(process: subprocess.Popen) -> dict:
    try:
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err[-2000:]
    return json.loads(out)


def forge_during(training, run):
    """The background run, once its parameter server listens, and that server's address: a
    forger started then pushes from the run's first epoch to its end."""
    t = training(run)
    ready = run / "logs" / "paramserver.endpoint"
    deadline = time.monotonic() + 120
    while not ready.is_file():
        assert t.process.poll() is None and time.monotonic() < deadline, "no parameter server"
        time.sleep(0.01)
    endpoint = ready.read_text().strip()
    assert endpoint.startswith("ipc://"), endpoint
    return t, endpoint


@pytest.mark.skipif(os.geteuid() != 0, reason="the forger must run as another user, which only root can start")
def test_a_forger_of_another_user_cannot_touch_the_weights(uninterrupted, training, tmp_path):
    run = tmp_path / "run"
    t, endpoint = forge_during(training, run)
    forging = forger(endpoint, NOBODY, t.process.pid)
    control = forger(endpoint, -1, 0)
    assert result(control)["answered"] == 1  # the run's own user reaches the server at that address
    for pid in t.watch():  # nothing of the run listens on TCP
        listening = [c for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert not listening, (pid, listening)
    code, output = t.wait()
    forged = result(forging)
    assert code == 0, output[-3000:]
    assert forged["uid"] == NOBODY and forged["rounds"] > 0 and forged["answered"] == 0, forged
    assert_same_epochs(read_metrics(run), uninterrupted)


@pytest.mark.slow  # shows the test above can fail: the same forger as the run's own user
def test_the_forger_changes_the_run_when_it_reaches_the_parameter_server(uninterrupted, training, tmp_path):
    run = tmp_path / "run"
    t, endpoint = forge_during(training, run)
    forging = forger(endpoint, -1, t.process.pid)
    code, output = t.wait()
    forged = result(forging)
    assert forged["rounds"] > 0 and forged["answered"] > 0, forged
    metrics = read_metrics(run)
    assert code != 0 or any(g["loss"] != pytest.approx(w["loss"], rel=1e-5) for g, w in zip(metrics, uninterrupted))
