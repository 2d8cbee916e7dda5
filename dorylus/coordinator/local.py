"""The roles of a local-mode run (:class:`LocalCluster`): the parameter server and one graph
server per partition, forked from the role zygote (:mod:`dorylus.zygote`; logs in
``<run dir>/logs``), and what the run's backend starts beside them (the ``lambda`` backend: a
Lambda emulator whose worker processes run the function). It stops all of them on success, on
error and on Ctrl-C; children also exit on their own when the coordinator disappears. The
roles listen on Unix sockets (``ipc://``) in a directory of mode 0700, so that only this
user's processes can reach them (docs/security.md). With ``curve`` on, every connection also
uses CURVE with ephemeral keys in ``<run dir>/keys`` (removed at the end).

A dead role is restarted (:meth:`LocalCluster.restart`, the training loop's recovery). With
``--preempt PART@EPOCH`` a local run plays AWS: graph server PART's watcher polls a
:class:`~dorylus.spot.LocalImds`, which posts the notice when the coordinator starts epoch
EPOCH, and the server is killed once the coordinator has checkpointed on that notice (at most
:data:`PREEMPT_GRACE_S` after it was posted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from dorylus import curve, spot, zygote
from dorylus.config import TrainConfig
from dorylus.coordinator.cluster import Cluster
from dorylus.coordinator.errors import ClusterError, RoleDied
from dorylus.coordinator.watchdog import Watchdog
from dorylus.lifecycle import local_process_environment
from dorylus.partition import PartitionStore

STARTUP_TIMEOUT_S = 120.0
# --preempt: a preempted server is killed as soon as the coordinator has checkpointed on its
# notice, so that the kill always follows the checkpoint and falls inside even a short run; if
# the notice never reaches the coordinator, this long after it was posted (AWS gives 120 s). And
# the watcher's poll interval.
PREEMPT_GRACE_S = 10.0
PREEMPT_WATCH_S = 0.1
# A Unix socket's path must fit sockaddr_un's 108 bytes; the longest name here is graphserver-1023.
MAX_SOCKET_DIR_CHARS = 108 - 1 - len("/graphserver-1023")


@dataclasses.dataclass
class _Child:
    name: str
    process: subprocess.Popen | zygote.Role
    log: Path
    preempted: bool = False  # killed by --preempt

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def where(self) -> str:
        """How a report names it: pid, state and log."""
        return f"pid {self.process.pid}, {self.state()}; its log: {self.log}"

    def state(self) -> str:
        """The kernel's word for the process: running, sleeping, stopped (SIGSTOP), ..."""
        try:
            code = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "unknown"
        return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped",
                "Z": "exited"}.get(code, code)


class LocalCluster(Cluster):
    """Every process of a local-mode run; use as a context manager."""

    def __init__(self, config: TrainConfig, store: PartitionStore, run_dir: Path, config_file: Path):
        self.keys_dir = Path(run_dir) / "keys" if config.curve else None
        keys = self._make_keys() if self.keys_dir is not None else None
        super().__init__(config, store, run_dir, keys)
        self.config_file = config_file
        self.children: list[_Child] = []
        self._services = contextlib.ExitStack()  # what the backend starts beside the roles (lambda: the emulator)
        self.services = None
        self.socket_dir: Path | None = None
        # --preempt: the (part, epoch) notices not yet posted, each preempted part's metadata
        # service, and the kills that are due (monotonic time, part).
        self.preempts = set(config.preemptions())
        self.imds: dict[int, spot.LocalImds] = {}
        self.kills: list[tuple[float, int]] = []

    def _make_keys(self) -> curve.Keyring:
        """Ephemeral keys for this run (a resumed run makes new ones), removed by :meth:`close`."""
        shutil.rmtree(self.keys_dir, ignore_errors=True)  # left by a run that was killed
        curve.write_keys(self.keys_dir)
        return curve.load_keys(self.keys_dir, "coordinator")

    # ------------------------------------------------------------------ start and stop

    def _make_socket_dir(self) -> Path:
        """A new directory for the roles' Unix sockets, mode 0700 (mkdtemp's): the kernel lets
        no other user (root aside) connect to a socket in it. The run directory's path may be
        too long for a socket's address; the system's temporary directory usually is not."""
        for parent in (None, "/tmp"):
            path = Path(tempfile.mkdtemp(prefix="dorylus-", dir=parent))
            if len(str(path)) <= MAX_SOCKET_DIR_CHARS:
                return path
            path.rmdir()
        raise ClusterError(f"no directory for the roles' sockets: {path.parent} and /tmp make paths over "
                           f"{MAX_SOCKET_DIR_CHARS} characters (set TMPDIR to a shorter directory)")

    def start(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.socket_dir = self._make_socket_dir()
        meta = self.store.meta
        keys_args = ["--keys", str(self.keys_dir)] if self.keys_dir is not None else []
        ps_ready = logs / "paramserver.endpoint"
        self._spawn("parameter server", logs / "paramserver.log", "dorylus.paramserver", [
            "--config", str(self.config_file), "--num-features", str(meta.num_features),
            "--num-classes", str(meta.num_classes), "--bind", f"ipc://{self.socket_dir}/paramserver",
            "--ready-file", str(ps_ready), *keys_args], ps_ready)
        self.ps_endpoint = self._wait_ready(ps_ready, self.children[-1])
        self.ps = self._peer(self.ps_endpoint, "paramserver")
        self.watchdog.watch(self.children[-1], self.ps_endpoint, "paramserver")

        from graphserver.backends import backend_class

        self.services = self._services.enter_context(backend_class(self.config.backend).local_services(
            self.config, self.store.num_parts, self.keys_dir))

        ready_files = []
        threads = max(1, len(os.sched_getaffinity(0)) // self.store.num_parts)
        for i in range(self.store.num_parts):
            ready = logs / f"graphserver-{i}.endpoint"
            ready_files.append(ready)
            watch_args: list[str] = []
            if any(part == i for part, _ in self.preempts):  # a fresh instance: no notice yet
                self.imds[i] = spot.LocalImds()
                watch_args = ["--spot-watch", self.imds[i].url, "--spot-watch-interval-s", str(PREEMPT_WATCH_S)]
            self._spawn(f"graph server {i}", logs / f"graphserver-{i}.log", "graphserver.server", [
                "--store", str(self.store.path), "--part", str(i),
                "--config", str(self.config_file), "--param-server", self.ps_endpoint, "--ready-file", str(ready),
                "--bind", f"ipc://{self.socket_dir}/graphserver-{i}", "--threads", str(threads), *self.services.graph_server_args,
                *keys_args, *watch_args], ready)
        endpoints = [self._wait_ready(f, child) for f, child in zip(ready_files, self.children[1:])]
        self.servers = [self._peer(e, "graphserver") for e in endpoints]
        for child, endpoint in zip(self.children[1:], endpoints):
            self.watchdog.watch(child, endpoint, "graphserver")
        self._connect_graph_servers(endpoints)

    def _spawn(self, name: str, log: Path, module: str, args: list[str], ready_file: Path) -> None:
        """Start ``python -m module *args``: forked from this process's zygote (:mod:`dorylus.zygote`),
        or a plain subprocess with ``DORYLUS_ZYGOTE=0``. Either way the role stops once its
        parent (the zygote, or this process) is gone."""
        ready_file.unlink(missing_ok=True)  # a resumed run's directory holds the previous roles' files
        env = local_process_environment()
        with open(log, "a") as out:  # appended: a resumed run keeps the logs of its earlier attempts
            try:
                if zygote.enabled():
                    launcher = zygote.shared(env)
                    process = launcher.spawn(module, [*args, "--exit-with-parent", str(launcher.pid)], out,
                                             cwd=os.getcwd(), env=env)
                else:
                    process = subprocess.Popen([sys.executable, "-m", module, *args, "--exit-with-parent",
                                                str(os.getpid())], stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=env)
            except zygote.ZygoteError as exc:
                raise ClusterError(f"{name}: {exc}") from None
        self.children.append(_Child(name, process, log))

    def _wait_ready(self, ready_file: Path, child: _Child) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready_file.exists():
            if child.process.poll() is not None:
                raise ClusterError(f"{child.name} exited with code {child.process.returncode} while starting; "
                                   f"its log ({child.log}) ends with:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{child.name} did not start within {STARTUP_TIMEOUT_S:.0f} s (log: {child.log})")
            time.sleep(0.05)
        return ready_file.read_text().strip()

    def close(self) -> None:
        """Stop every role: ask politely, then terminate, then kill. Safe to call twice."""
        for child in self.children:  # a stopped role (SIGSTOP, a debugger) must run to answer SHUTDOWN
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGCONT)
        self._shutdown_roles()
        deadline = time.monotonic() + 5.0
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.terminate()
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGCONT)  # a stopped role must run to see SIGTERM
        for child in self.children:
            try:
                child.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(timeout=5.0)
        self.children = []
        self._close_sockets()
        self._services.close()
        self.services = None
        if not self.ctx.closed:
            self.ctx.term()
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None
        for imds in self.imds.values():
            imds.close()
        self.imds, self.kills = {}, []

    def epoch_begins(self, epoch: int) -> None:
        """``--preempt``: post the notices of ``epoch`` (once: a recovered run trains it again)
        and schedule each server's kill."""
        for part, at in sorted(self.preempts):
            if at == epoch:
                self.preempts.discard((part, at))
                self.imds[part].interrupt(seconds=PREEMPT_GRACE_S)
                self.kills.append((time.monotonic() + PREEMPT_GRACE_S, part))
                print(f"--preempt {part}@{epoch}: spot interruption notice posted to graph server {part}, which is "
                      f"killed once the run has checkpointed (within {PREEMPT_GRACE_S:g} s)", file=sys.stderr,
                      flush=True)

    def interruption_handled(self, part: int) -> None:
        self.kills = [(0.0 if p == part else due, p) for due, p in self.kills]

    def _preempt_due(self) -> None:
        """Kill (SIGKILL: the instance is gone, nothing runs after) the servers whose grace ran out."""
        now = time.monotonic()
        for due in [k for k in self.kills if k[0] <= now]:
            self.kills.remove(due)
            child = self.children[1 + due[1]]
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait(timeout=5.0)
            child.preempted = True

    def _check_alive(self) -> None:
        if self.kills:
            self._preempt_due()
        for child in self.children:
            if child.process.poll() is not None:
                why = " (preempted: --preempt)" if child.preempted else ""
                if isinstance(child.process, zygote.Role) and child.process.returncode == zygote.STATUS_LOST:
                    why = f" (unknown: the role zygote, pid {child.process.zygote.pid}, that started it is gone)"
                raise RoleDied(f"{child.name} exited with code {child.process.returncode}{why}; "
                               f"its log ({child.log}) ends with:\n{child.tail()}", child.name)

    def restart(self) -> None:
        """Stop every role that is left and start them all again, fresh (a new parameter server
        without state, graph servers without epochs, a new emulator and keys): the training
        loop then restores its last state into them. The watchdog keeps what it learned of
        each step's duration."""
        durations = self.watchdog.durations
        self.close()
        self.ctx = zmq.Context()
        if self.keys_dir is not None:  # close() removed the run's keys: a restarted run makes new ones
            self.keys = self._make_keys()
        self.watchdog = Watchdog(self.ctx, self.config.watchdog_min_s, self.config.watchdog_factor,
                                 self.config.task_timeout_s, keys=self.keys)
        self.watchdog.durations = durations
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def emulator_stats(self) -> dict[str, Any]:
        return self.services.stats() if self.services is not None else {}
