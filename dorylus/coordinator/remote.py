"""Cluster mode: the coordinator's side of a run on servers that are already running.

``dorylus train --cluster FILE`` reads the cluster file (:mod:`dorylus.coordinator.clusterfile`), finds the
coordinator's CURVE keys (:func:`coordinator_keys`) and the store's ``meta.json``
(:func:`remote_store`), then :class:`RemoteCluster` dials the parameter server and the graph
servers named in the file. They may still be starting (systemd restarts them after each run,
and at boot they install the project first), so the coordinator keeps greeting them until
``wait_s`` has passed; one that still holds an earlier run's state (that run's coordinator died
without stopping it) is stopped and waited for again. Before anything changes on a server it checks each one: the graph server
at index ``i`` owns part ``i`` of the same store, and every server runs the training config
this run uses (:func:`dorylus.config.server_view`); a difference is a ConfigError
naming the server and the fields. Then it connects the graph servers to each other and tells
them the function to invoke (name, region, and the endpoint override of the file).

A run leaves its servers with its state (weights, buffers, the epochs it trained), so at the
end the coordinator stops them (SHUTDOWN, which only its key may send): their service manager
starts them afresh for the next run, as the Terraform module's systemd units do.

A role that dies mid-run (its connection closes, or it answers no heartbeat for
``--watchdog-min-s``) raises :class:`~dorylus.coordinator.errors.RoleDied`, and the training loop
recovers as in local mode (:meth:`RemoteCluster.restart`): the coordinator greets every address
again for up to the cluster file's ``recovery_wait_s``, stopping the roles that survived (they
hold this run's state) so that their service manager starts them afresh, and waiting for the
dead role's replacement (systemd, or a spot graph server's Auto Scaling group, which starts it at
the same address); then it restores the last finished epoch's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dorylus import curve
from dorylus.coordinator.clusterfile import ClusterSpec
from dorylus.config import TrainConfig, server_view
from dorylus.coordinator.cluster import Cluster
from dorylus.coordinator.errors import ClusterError, RoleDied
from dorylus.coordinator.watchdog import Watchdog
from dorylus.errors import ConfigError
from dorylus.partition import PartitionStore, StoreMeta
from dorylus.peer import Peer, PeerError, Pending
from dorylus.protocol import Header, Op, ProtocolError

DEFAULT_WAIT_S = 120.0
HELLO_EVERY_S = 2.0  # greet again: a server that restarted meanwhile lost the first HELLO


@dataclasses.dataclass(frozen=True)
class RemoteStore:
    """The partition store the graph servers load, as the coordinator knows it: ``meta.json`` only."""

    path: str
    meta: StoreMeta

    @property
    def num_parts(self) -> int:
        return self.meta.num_parts

    def fingerprint(self) -> str:
        return PartitionStore(Path(self.path), self.meta).fingerprint()


def remote_store(url: str) -> RemoteStore:
    """``meta.json`` of the store at ``url`` (``s3://`` or a directory), without any part."""
    from dorylus.partition import read_meta

    return RemoteStore(url, read_meta(url))


@dataclasses.dataclass(frozen=True)
class RemoteRole:
    """A server the coordinator did not start: reports name it by its address."""

    name: str
    endpoint: str

    def where(self) -> str:
        return f"at {self.endpoint}"


def coordinator_keys(spec: ClusterSpec, keys_dir: str | Path | None = None) -> curve.Keyring:
    """The coordinator's keyring: from ``keys_dir`` (``--keys``), else the cluster file's
    ``keys``, else the cluster's SSM parameters (Terraform stores them there; the coordinator
    host's instance role may read them). Cluster mode never runs without CURVE."""
    directory = keys_dir or spec.keys
    if directory is not None:
        return curve.load_keys(directory, "coordinator")
    if spec.ssm_prefix and "coordinator" in spec.curve_roles:
        return _keys_from_ssm(spec)
    raise ConfigError(f"cluster mode needs CURVE keys and {spec.path} names none: make them with `dorylus keys "
                      "--out DIR`, start the servers with --keys DIR and pass --keys DIR here (or \"keys\": DIR in "
                      "the cluster file); on AWS give them to Terraform (curve_public_keys, curve_secret_keys)")


def _keys_from_ssm(spec: ClusterSpec) -> curve.Keyring:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    base = f"{spec.ssm_prefix}/curve/"
    found: dict[str, str] = {}
    try:
        pages = boto3.client("ssm", region_name=spec.region).get_paginator("get_parameters_by_path").paginate(
            Path=base, Recursive=True, WithDecryption=True)
        for page in pages:
            for parameter in page["Parameters"]:
                role, _, kind = parameter["Name"][len(base):].partition("/")
                if kind == "public" or (role, kind) == ("coordinator", "secret"):
                    found[curve.env_name(role, kind)] = parameter["Value"]
    except (BotoCoreError, ClientError) as exc:
        raise ConfigError(f"cannot read the CURVE keys under SSM {base} ({spec.path}'s ssm_prefix): {exc}") from None
    keys = curve.keys_from_env("coordinator", found)
    if keys is None:
        raise ConfigError(f"no CURVE keys under SSM {base}; give Terraform curve_public_keys and curve_secret_keys")
    return keys


def differing_fields(ours: TrainConfig, theirs: dict[str, Any]) -> list[str]:
    """``name (server X, here Y)`` for every field servers use on which the two configs differ
    (``theirs``: a server's answer to the ``config`` command)."""
    mine = server_view(ours.to_dict())
    return [f"{name} (server {theirs.get(name, '<unset>')!r}, here {value!r})" for name, value in mine.items()
            if theirs.get(name, "<unset>") != value]


class HeartbeatWatchdog(Watchdog):
    """Cluster mode's watchdog: a role that answers no heartbeat within the bound is taken as gone
    (its host may have vanished without closing its connections: a spot instance taken back), so
    the training loop may recover (:class:`~dorylus.coordinator.errors.RoleDied`). If it was only stalled,
    the recovery's greeting stops it once it answers, and its service manager starts it afresh."""

    def check_heartbeats(self, doing: str, bound_s: float | None = None) -> None:
        try:
            super().check_heartbeats(doing, bound_s)
        except ClusterError as exc:
            now, bound = time.monotonic(), self.min_s if bound_s is None else bound_s
            silent = next(child.name for child, _ in self.roles
                          if (since := self.unanswered_since[child.name]) is not None and now - since > bound)
            raise RoleDied(str(exc), silent) from None


class RemoteCluster(Cluster):
    """The running servers of ``spec`` (see the module docstring); use as a context manager."""

    def __init__(self, config: TrainConfig, spec: ClusterSpec, store: RemoteStore, keys: curve.Keyring,
                 wait_s: float = DEFAULT_WAIT_S):
        super().__init__(config, store, None, keys)
        self.watchdog = self._new_watchdog()
        self.spec = spec
        self.wait_s = wait_s
        self.roles = [RemoteRole("parameter server", spec.param_server.endpoint),
                      *(RemoteRole(f"graph server {i}", s.endpoint) for i, s in enumerate(spec.graph_servers))]
        self.monitors: list[zmq.Socket] = []  # per role: its connection's DISCONNECTED events
        self.noticed: set[str] = set()  # the graph servers whose interruption notice the run handled
        self.died: str | None = None  # the role whose death the next restart() recovers from
        self.touched = False  # a command that changes a server was sent: SHUTDOWN at the end
        self.started = False

    def _new_watchdog(self) -> HeartbeatWatchdog:
        return HeartbeatWatchdog(self.ctx, self.config.watchdog_min_s, self.config.watchdog_factor,
                                 self.config.task_timeout_s, keys=self.keys)

    def start(self) -> None:
        if not self.started:
            self._start(self.wait_s)

    def _start(self, wait_s: float, died: str | None = None) -> None:
        self.ps_endpoint = self.spec.param_server.endpoint
        self.ps = self._peer(self.ps_endpoint, "paramserver")
        self.servers = [self._peer(s.endpoint, "graphserver") for s in self.spec.graph_servers]
        peers = [self.ps, *self.servers]
        ready = self._greet(peers, wait_s, died)
        if died is not None:
            # A survivor may have pushed gradients to a replacement that answered fresh before the
            # survivor was stopped. Once every address answered fresh none of them is left, so
            # greeting again finds a server they changed (and restarts it) for good.
            ready = self._greet(peers, wait_s, died)
        self._check_parts(ready[1:])
        for role, peer in zip(self.roles, peers):
            self._check_config(role, peer)
        for role, peer in zip(self.roles, peers):
            self.watchdog.watch(role, role.endpoint, "paramserver" if peer is self.ps else "graphserver")
        from graphserver.backends import backend_class

        target = backend_class(self.config.backend).cluster_target(self.spec)
        self.touched = True
        self._connect_graph_servers([s.endpoint for s in self.spec.graph_servers], **target)
        # Watched from here on only: the greeting's own stops and restarts close connections too.
        self.monitors = [peer.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) for peer in peers]
        self.started = True

    def restart(self) -> None:
        """Recovery (:meth:`dorylus.coordinator.trainer.DistributedTrainer.recover`): new sockets, so that
        nothing queued for the dead role reaches its replacement, then the greeting of
        :meth:`start` for up to the cluster file's ``recovery_wait_s``: the roles that survived
        hold this run's state and are stopped (their service manager starts them afresh), the
        dead one's replacement must answer at its address. The watchdog keeps what it learned
        of each step's duration; the training loop then restores its last state."""
        durations = self.watchdog.durations
        self._close_sockets()
        self.ctx.term()
        self.ctx = zmq.Context()
        self.watchdog = self._new_watchdog()
        self.watchdog.durations = durations
        self.touched = self.started = False  # the greeting stops what holds state; a failed one leaves none
        self.noticed = set()  # new instances
        print(f"waiting up to {self.spec.recovery_wait_s} s (recovery_wait_s of {self.spec.path}) for "
              f"{self.died} to come back at its address and for the others to restart afresh", file=sys.stderr,
              flush=True)
        self._start(self.spec.recovery_wait_s, self.died)

    def check(self, what: str, elapsed: float, bound: float, why: str) -> None:
        try:
            super().check(what, elapsed, bound, why)
        except RoleDied as exc:
            self.died = exc.role  # for restart(), which the training loop calls without it
            raise

    def _check_alive(self) -> None:
        for role, monitor in zip(self.roles, self.monitors):
            if monitor.poll(0, zmq.POLLIN):
                recv_monitor_message(monitor)
                notice = " after its interruption notice" if role.name in self.noticed else ""
                raise RoleDied(f"{role.name} at {role.endpoint} closed its connection{notice} (its process exited "
                               "or its host went away)", role.name)

    def interruption_handled(self, part: int) -> None:
        self.noticed.add(f"graph server {part}")

    def _close_sockets(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.monitors = []
        super()._close_sockets()

    def _greet(self, peers: list[Peer], wait_s: float, died: str | None = None) -> list[Header]:
        """Every server's READY, waiting up to ``wait_s`` for servers that are still starting.

        A server that answers but holds an earlier run's state (its coordinator died without
        stopping it, or it survived a role of this run that died: ``died``) is stopped, and the
        wait goes on for its service manager to start it afresh: training on its leftover ghost
        rows and weights would silently change the run."""
        deadline = time.monotonic() + wait_s
        answers: dict[int, Header] = {}
        stopped: set[int] = set()
        while len(answers) < len(peers):
            now = time.monotonic()
            if now > deadline:
                self._no_answer([i for i in range(len(peers)) if i not in answers], stopped, wait_s, died)
            # A round: one HELLO to each server not answered yet, their READYs until HELLO_EVERY_S
            # after the sends; the next round's HELLO replaces one not answered (its late READY is dropped).
            round_s = min(HELLO_EVERY_S, deadline - now)
            hellos = {i: peer.send(Header(Op.HELLO, role="coordinator"))
                      for i, peer in enumerate(peers) if i not in answers}
            for i, hello in hellos.items():
                try:
                    reply, _ = hello.reply(round_s)
                except PeerError:
                    continue
                if reply.meta.get("fresh", True):
                    answers[i] = reply
                elif i not in stopped:
                    if died is None:
                        print(f"{self.roles[i].name} at {self.roles[i].endpoint} holds an earlier run's state: "
                              "stopping it and waiting for it to start afresh", file=sys.stderr, flush=True)
                    peers[i].send(Header(Op.SHUTDOWN))
                    stopped.add(i)
            if len(answers) < len(peers):
                time.sleep(max(0.0, now + round_s - time.monotonic()))
        return [answers[i] for i in range(len(peers))]

    def _no_answer(self, missing: list[int], stopped: set[int], wait_s: float, died: str | None) -> None:
        names = [f"{self.roles[i].name} at {self.roles[i].endpoint}" for i in missing]
        restarting = [name for i, name in zip(missing, names) if i in stopped]
        silent = [name for i, name in zip(missing, names) if i not in stopped]
        if died is not None:
            gone = [f"no answer from {', '.join(silent)}"] if silent else []
            if restarting:
                were = "were" if len(restarting) > 1 else "was"
                gone.append(f"{', '.join(restarting)} held this run's state and {were} stopped to start afresh, "
                            "but did not come back")
            raise ClusterError(
                f"cluster {self.spec.path}: recovery after {died} died: within {wait_s:.0f} s (the cluster file's "
                f"recovery_wait_s), {'; '.join(gone)}. Start the roles at those addresses again (systemd restarts a "
                "role 30 s after it exits; a spot graph server's Auto Scaling group launches its replacement at the "
                "same address) and resume")
        if restarting:
            raise ClusterError(
                f"cluster {self.spec.path}: {', '.join(restarting)} held an earlier run's state and was stopped, but "
                f"did not come back within {wait_s:.0f} s; start it again (systemd does, after 30 s: "
                "--cluster-wait-s longer than that)")
        raise ClusterError(
            f"cluster {self.spec.path}: no answer within {wait_s:.0f} s from {', '.join(names)}; is it running "
            "(on AWS: systemctl status dorylus-graphserver / dorylus-paramserver), reachable from here, and started "
            "with --keys holding this coordinator's public key?")

    def _check_parts(self, ready: list[Header]) -> None:
        fingerprint = self.store.fingerprint()
        for i, reply in enumerate(ready):
            where = f"graph server {i} at {self.roles[i + 1].endpoint}"
            if reply.meta.get("part") != i or reply.meta.get("parts") != self.store.num_parts:
                raise ConfigError(f"cluster {self.spec.path}: {where} owns part {reply.meta.get('part')} of "
                                  f"{reply.meta.get('parts')}, the file lists it for part {i} of "
                                  f"{self.store.num_parts}")
            if reply.meta.get("store") != fingerprint:
                raise ConfigError(f"cluster {self.spec.path}: {where} loaded another partition store than "
                                  f"{self.spec.store} (its meta.json sha256 {str(reply.meta.get('store'))[:12]}..., "
                                  f"this store's {fingerprint[:12]}...)")

    def _check_config(self, role: RemoteRole, peer: Peer) -> None:
        reply, _ = self._await(peer.send(Header(Op.COMMAND, meta={"command": "config"})), f"{role.name} config",
                               "config")
        differences = differing_fields(self.config, dict(reply.meta))
        if differences:
            raise ConfigError(f"{role.name} at {role.endpoint} runs another training config than this run: "
                              f"{'; '.join(differences)}. Train with the servers' config (on AWS: --config "
                              "/etc/dorylus/train.json) or restart them with this one")

    def close(self) -> None:
        """Stop the servers if this run used them (their state is spent), close the sockets."""
        if self.touched:
            self._await_acks(self._shutdown_roles(), 5.0)
        self._close_sockets()
        if not self.ctx.closed:
            self.ctx.term()

    @staticmethod
    def _await_acks(sent: list[Pending], timeout_s: float) -> None:
        """Wait (briefly) for each SHUTDOWN's answer: closing a socket drops what it has not sent.
        They were sent together, and each one's timeout counts from its send."""
        for pending in sent:
            with contextlib.suppress(PeerError, ProtocolError):
                pending.reply(timeout_s)
