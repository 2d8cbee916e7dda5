"""A cluster-mode setup on 127.0.0.1 for tests: real ``dorylus paramserver``, ``dorylus
graphserver`` and ``dorylus lambda-emulator`` processes started by hand (as systemd starts them
on AWS), with CURVE keys from ``dorylus keys`` and a cluster file naming them.

Ports are picked free before the cluster file is written, so that a coordinator may start
before the servers do (it waits for them). Every process is killed when the fixture ends, on
failure too, and every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from dorylus import curve, protocol, sockets, zygote
from dorylus.config import TrainConfig
from dorylus.data.graph import GraphDataset
from dorylus.lifecycle import local_process_environment
from dorylus.partition import assign_parts, write_store
from dorylus.protocol import Header

REPO = Path(__file__).resolve().parents[2]
FUNCTION = "dorylus-test-tensor"
START_S = 90.0
ROLE_MODULES = {"paramserver": "dorylus.paramserver", "graphserver": "graphserver.server"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(endpoint: str, header: Header, *, keys: curve.Keyring | None = None, server_role: str = "graphserver",
        timeout: float = 5.0, tensors=(), raw: list[bytes] | None = None) -> Header | None:
    """One request from a fresh DEALER (a CURVE client with ``keys``); the reply header, or None
    when nothing answers within ``timeout`` s."""
    ctx = zmq.Context.instance()
    sock = sockets.client_socket(ctx, endpoint, keys=keys, server_role=server_role, max_bytes=64 << 20)
    try:
        if raw is not None:
            sock.send_multipart(raw)
        else:
            protocol.send(sock, header, tensors)
        try:
            return protocol.recv(sock, timeout=timeout)[0]
        except TimeoutError:
            return None
    finally:
        sock.close(linger=0)


@dataclass
class ClusterEnv:
    root: Path
    config: TrainConfig
    store: Path
    keys: Path
    parts: int
    ps_port: int = field(default_factory=free_port)
    graph_ports: list[int] = field(default_factory=list)
    processes: list[tuple[str, subprocess.Popen, Path]] = field(default_factory=list)
    emulator_url: str = ""
    # Servers forked from the shared role zygote (dorylus/zygote.py, as local mode starts them)
    # instead of started as `dorylus` commands: the same modules and options, without each
    # start's ~3 CPU-s of imports, for the tests that start many.
    forked: bool = False

    @property
    def config_file(self) -> Path:
        return self.root / "train.json"

    @property
    def cluster_file(self) -> Path:
        return self.root / "cluster.json"

    def key(self, role: str) -> curve.Keyring:
        return curve.load_keys(self.keys, role)

    @property
    def ps_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ps_port}"

    def graph_endpoint(self, part: int) -> str:
        return f"tcp://127.0.0.1:{self.graph_ports[part]}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        with open(log, "a") as out:  # appended: a restarted server keeps its predecessor's log
            if self.forked and args[0] in ROLE_MODULES:
                launcher = zygote.shared(local_process_environment())
                process = launcher.spawn(ROLE_MODULES[args[0]], [*args[1:], "--exit-with-parent", str(launcher.pid)],
                                         out, cwd=str(REPO), env=local_process_environment())
                self.processes.append((name, process, log))
                return process
            process = subprocess.Popen([sys.executable, "-m", "dorylus.cli", *args], cwd=REPO,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
        self.processes.append((name, process, log))
        return process

    def start_emulator(self) -> str:
        """The Lambda emulator with the function's keys in its environment, as Lambda's config has them."""
        self._spawn("emulator", ["lambda-emulator", "--port", "0", "--function", f"{FUNCTION}=lambdas.handler:handler",
                                 "--concurrency", str(self.parts * 3), "--timeout-s", "60"],
                    env=curve.function_environment(self.keys))
        log = self.root / "emulator.log"
        deadline = time.monotonic() + START_S
        while not (match := re.search(r"listening on (http://\S+)", log.read_text())):
            assert self.processes[-1][1].poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the emulator did not start"
            time.sleep(0.05)
        self.emulator_url = match[1]
        return self.emulator_url

    def write_cluster_file(self, **overrides) -> Path:
        self.graph_ports = self.graph_ports or [free_port() for _ in range(self.parts)]
        cluster = {"format": "dorylus-cluster/1", "name": "test", "region": "us-east-1", "store": str(self.store),
                   "function": {"name": FUNCTION, "endpoint_url": self.emulator_url or "http://127.0.0.1:9"},
                   "param_servers": [{"index": 0, "host": "127.0.0.1", "port": self.ps_port}],
                   "graph_servers": [{"part": i, "host": "127.0.0.1", "port": p} for i, p in enumerate(self.graph_ports)],
                   "keys": str(self.keys), **overrides}
        self.cluster_file.write_text(json.dumps(cluster, indent=1))
        return self.cluster_file

    def start_servers(self) -> None:
        """The parameter server and the graph servers, started by hand with their keys."""
        self.start_param_server()
        for part in range(self.parts):
            self.start_graph_server(part)

    def start_param_server(self) -> None:
        meta = json.loads((self.store / "meta.json").read_text())
        self._spawn("paramserver", ["paramserver", "--config", str(self.config_file), "--num-features",
                                    str(meta["num_features"]), "--num-classes", str(meta["num_classes"]),
                                    "--bind", self.ps_endpoint, "--keys", str(self.keys)])

    def start_graph_server(self, part: int) -> None:
        self._spawn(f"graphserver-{part}", [
            "graphserver", "--store", str(self.store), "--part", str(part), "--config", str(self.config_file),
            "--param-server", self.ps_endpoint, "--bind", self.graph_endpoint(part), "--advertise", "127.0.0.1",
            "--keys", str(self.keys), "--threads", "1"])

    def supervise(self, coordinator: subprocess.Popen, run: Path, restart_after_s: float, timeout_s: float,
                  keep_down: frozenset[str] = frozenset()) -> int:
        """Play the servers' service manager (systemd's ``Restart=always``) until ``coordinator``
        exits: a server that exited is started again at its address ``restart_after_s`` later,
        except those named in ``keep_down``, and none once the coordinator's run directory ``run``
        holds its summary (what stops then is stopped by the run's end). Returns the coordinator's
        exit status; fails the test when it runs past ``timeout_s``."""
        starts = {"paramserver": self.start_param_server,
                  **{f"graphserver-{p}": (lambda p=p: self.start_graph_server(p)) for p in range(self.parts)}}
        deadline = time.monotonic() + timeout_s
        exited_at: dict[str, float] = {}
        while coordinator.poll() is None:
            assert time.monotonic() < deadline, f"the coordinator did not finish within {timeout_s:.0f} s"
            now = time.monotonic()
            for name, start in starts.items():
                if name in keep_down or self.server(name).poll() is None or (run / "summary.json").exists():
                    continue
                if now - exited_at.setdefault(name, now) >= restart_after_s:
                    del exited_at[name]
                    start()
            time.sleep(0.05)
        return coordinator.returncode

    def forget_exited(self) -> None:
        """Drop the processes that ended (a server stopped by its run), so names find the new ones."""
        self.processes = [entry for entry in self.processes if entry[1].poll() is None]

    def wait_ready(self) -> None:
        """Until every server answers the coordinator's HELLO."""
        coordinator = self.key("coordinator")
        deadline = time.monotonic() + START_S
        targets = [(self.ps_endpoint, "paramserver")] + [(self.graph_endpoint(p), "graphserver")
                                                          for p in range(self.parts)]
        for endpoint, role in targets:
            while ask(endpoint, Header(protocol.Op.HELLO, role="coordinator"), keys=coordinator,
                      server_role=role, timeout=1.0) is None:
                for name, process, log in self.processes:
                    assert process.poll() is None, f"{name} exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{endpoint} did not start"

    def server(self, name: str) -> subprocess.Popen:
        """The latest process started under ``name``."""
        return next(p for n, p, _ in reversed(self.processes) if n == name)

    def log(self, name: str) -> str:
        return next(log for n, _, log in reversed(self.processes) if n == name).read_text()

    def stop(self) -> None:
        for _, process, _ in self.processes:
            if process.poll() is None:
                process.terminate()
        for _, process, _ in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def make_env(root: Path, graph: GraphDataset, config: TrainConfig, parts: int = 2, forked: bool = False) -> ClusterEnv:
    """Store, config file and keys under ``root``; no process yet (``forked``: see :class:`ClusterEnv`)."""
    store = root / "store"
    write_store(graph, assign_parts(graph.num_nodes, graph.src, graph.dst, parts, "contiguous"), store,
                method="contiguous", seed=config.seed, sparse_features=config.sparse_features)
    curve.write_keys(root / "keys")
    env = ClusterEnv(root=root, config=config, store=store, keys=root / "keys", parts=parts, forked=forked)
    env.config_file.write_text(json.dumps(config.to_dict()))
    return env
