"""How long a step of the training loop may take before the coordinator names what hangs
(:class:`Watchdog`), with the heartbeats it sends the roles between steps (cluster mode's
:class:`~dorylus.coordinator.remote.HeartbeatWatchdog` takes a silent role as gone).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from dorylus import curve, protocol, sockets
from dorylus.coordinator.errors import ClusterError
from dorylus.peer import Peer, PeerError
from dorylus.protocol import Header, Op


class Watchdog:
    """Finds a role that stopped making progress without exiting.

    * Heartbeat: every role (parameter server, graph servers) is pinged with HELLO over a socket
      of its own every ``PING_S``; one that answers nothing for ``min_s`` is stalled (stopped,
      deadlocked, or starved), whatever it was doing.
    * Phases: a phase (or parameter-server command) may take ``max(min_s, factor x the moving
      mean of the same step)``; a step seen for the first time gets ``first_s`` (the task
      timeout). When it runs over while every role answers, the calls still in flight are the
      stalled ones: the graph servers' STATS name them (a request of :class:`dorylus.peer.Peer`
      on a connection of its own; the heartbeat is a stream of pings, any answer to any of them
      a sign of life).
    """

    PING_S = 1.0
    WINDOW = 10  # epochs in the moving mean

    def __init__(self, ctx: zmq.Context, min_s: float, factor: float, first_s: float,
                 keys: curve.Keyring | None = None):
        self.ctx, self.min_s, self.factor, self.first_s, self.keys = ctx, min_s, factor, first_s, keys
        self.roles: list[tuple[Any, zmq.Socket]] = []  # (a role with .name and .where(), its socket)
        self.stats: dict[str, Peer] = {}  # graph server's name -> the peer its STATS go through
        self.unanswered_since: dict[str, float | None] = {}  # when the oldest unanswered ping was sent
        self.last_ping: dict[str, float] = {}
        self.durations: dict[str, list[float]] = {}

    def watch(self, child: Any, endpoint: str, server_role: str) -> None:
        socket = sockets.client_socket(self.ctx, endpoint, keys=self.keys, server_role=server_role,
                                       max_bytes=sockets.message_limit(0))
        self.roles.append((child, socket))
        self.unanswered_since[child.name], self.last_ping[child.name] = None, 0.0
        if server_role == "graphserver":
            self.stats[child.name] = Peer(self.ctx, endpoint, child.name, server_role=server_role, keys=self.keys,
                                          max_bytes=sockets.message_limit(0))

    def bound(self, step: str) -> tuple[float, str]:
        """Seconds ``step`` may take, and why."""
        history = self.durations.get(step)
        if not history:
            return self.first_s, f"the task timeout {self.first_s:g} s, for a step not seen before"
        mean = sum(history) / len(history)
        return (max(self.min_s, self.factor * mean),
                f"max({self.min_s:g} s, {self.factor:g} x its moving mean {mean:.3g} s)")

    def record(self, step: str, seconds: float) -> None:
        history = self.durations.setdefault(step, [])
        history.append(seconds)
        del history[:-self.WINDOW]

    def check_heartbeats(self, doing: str, bound_s: float | None = None) -> None:
        """Raise ClusterError naming a role whose oldest unanswered ping is older than ``bound_s``
        (default ``min_s``)."""
        bound_s = self.min_s if bound_s is None else bound_s
        now = time.monotonic()
        for child, socket in self.roles:
            self._drain(child, socket)
            if now - self.last_ping[child.name] >= self.PING_S:
                protocol.send(socket, Header(Op.HELLO, role="coordinator"))
                self.last_ping[child.name] = now
                if self.unanswered_since[child.name] is None:
                    self.unanswered_since[child.name] = now
            since = self.unanswered_since[child.name]
            if since is not None and (silent := now - since) > bound_s:
                raise ClusterError(f"watchdog: {child.name} ({child.where()}) has not answered a heartbeat for "
                                   f"{silent:.0f} s while the run was doing {doing}")

    def _drain(self, child: Any, socket: zmq.Socket) -> None:
        """Take the heartbeat replies that arrived: the role answered."""
        while socket.poll(0, zmq.POLLIN):
            socket.recv_multipart()
            self.unanswered_since[child.name] = None

    def in_flight(self) -> str:
        """What the graph servers report as still running, one clause per server."""
        found = []
        for child, _ in self.roles:
            peer = self.stats.get(child.name)
            if peer is None:
                continue
            try:
                reply, _ = peer.request(Header(Op.STATS), timeout=2.0)
            except PeerError:
                continue  # silent or refusing: the heartbeat names a silent role
            if reply.meta.get("oldest_call"):
                found.append(f"{child.name}: {reply.meta['in_flight']} call(s) in flight, the oldest "
                             f"{reply.meta['oldest_call']} ({child.where()})")
        return "; ".join(found) or "no function call in flight"

    def close(self) -> None:
        for _, socket in self.roles:
            socket.close(linger=0)
        for peer in self.stats.values():
            peer.close()
        self.roles, self.stats = [], {}
