"""What the training loop needs of the roles, wherever they run (:class:`Cluster`): peers to
the parameter server and the graph servers, commands with the watchdog's bounds, SHUTDOWN at
the end.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import zmq

from dorylus import curve, sockets
from dorylus.config import TrainConfig
from dorylus.coordinator.errors import ClusterError
from dorylus.coordinator.watchdog import Watchdog
from dorylus.models.spec import ModelSpec
from dorylus.peer import Peer, Pending, Refused
from dorylus.protocol import Header, Op


class Cluster:
    """The roles of one run as the training loop sees them (:class:`DistributedTrainer`): a
    socket to the parameter server and one per graph server (CURVE clients with the
    coordinator's key when ``keys`` is given), commands awaited under the watchdog's bounds,
    and SHUTDOWN for every role at the end. Subclasses start or find the roles (:meth:`start`)
    and may check that they are alive (:meth:`_check_alive`). Use as a context manager."""

    def __init__(self, config: TrainConfig, store, run_dir: Path | None, keys: curve.Keyring | None):
        self.config = config
        self.store = store
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keys = keys
        self.ctx = zmq.Context()
        self.servers: list[Peer] = []
        self.ps: Peer | None = None
        self.ps_endpoint = ""
        self.intervals = 0
        self.watchdog = Watchdog(self.ctx, config.watchdog_min_s, config.watchdog_factor, config.task_timeout_s,
                                 keys=keys)
        meta = store.meta
        spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
        # What the coordinator receives: weights and optimizer state from the parameter server
        # (get_state), headers alone from the graph servers.
        self.ps_max_bytes = sockets.message_limit(sockets.largest_weight_bytes(spec.named_shapes().values()),
                                                  config.max_message_mb)
        self.graph_max_bytes = sockets.message_limit(0, config.max_message_mb)

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _peer(self, endpoint: str, server_role: str) -> Peer:
        ps = server_role == "paramserver"
        return Peer(self.ctx, endpoint, "parameter server" if ps else "graph server", server_role=server_role,
                    keys=self.keys, max_bytes=self.ps_max_bytes if ps else self.graph_max_bytes)

    def _connect_graph_servers(self, endpoints: list[str], **meta: Any) -> list[dict[str, Any]]:
        """Tell every graph server its peers (and, in cluster mode, the function to invoke)."""
        replies = self.command("connect", peers=",".join(endpoints), **meta)
        self.intervals = sum(r["intervals"] for r in replies)
        return replies

    def _shutdown_roles(self) -> list[Pending]:
        """Send SHUTDOWN to every role; returns the requests, whose acknowledgements a caller
        may await."""
        sent = []
        for peer in [*self.servers, *([self.ps] if self.ps else [])]:
            with contextlib.suppress(zmq.ZMQError):
                sent.append(peer.send(Header(Op.SHUTDOWN)))
        return sent

    def _close_sockets(self) -> None:
        self.watchdog.close()
        for peer in [*self.servers, *([self.ps] if self.ps else [])]:
            peer.close()
        self.servers, self.ps = [], None

    # ------------------------------------------------------------------ commands

    def _check_alive(self) -> None:
        """Raise ClusterError if a role is known to be gone (local mode: its process exited)."""

    def _await(self, pending: Pending, what: str, step: str) -> tuple[Header, list[np.ndarray]]:
        """The reply to ``pending``, while the watchdog checks the roles' heartbeats and that the
        ``step`` finishes within its bound."""
        start = time.monotonic()
        bound, why = self.watchdog.bound(step)
        try:
            return pending.reply(on_wait=lambda: self.check(what, time.monotonic() - start, bound, why))
        except Refused as exc:
            raise ClusterError(f"{what} failed: {exc.reason}", exc.code) from None

    def check(self, what: str, elapsed: float, bound: float, why: str) -> None:
        """Raise ClusterError if a role died or stalled, or ``what`` ran past its bound."""
        self._check_alive()
        self.watchdog.check_heartbeats(what)
        if elapsed > bound:
            # A role that stopped answering is the likelier culprit than the calls it waits on.
            self.watchdog.check_heartbeats(what, bound_s=3 * Watchdog.PING_S)
            raise ClusterError(f"watchdog: {what} made no progress for {elapsed:.0f} s "
                               f"(bound {bound:.0f} s: {why}); {self.watchdog.in_flight()}")

    def command(self, command: str, **meta: Any) -> list[dict[str, Any]]:
        """Send one command to every graph server at once; returns their replies' meta, by part."""
        return [dict(reply.meta) for reply in self.command_replies(command, **meta)]

    def command_replies(self, command: str, *, each: Sequence[dict[str, Any]] = (), **meta: Any) -> list[Header]:
        """Send one command to every graph server at once (with ``each[part]``'s meta too, when
        given); returns their reply headers (``doc`` included), by part."""
        sent = [peer.send(Header(Op.COMMAND, meta={"command": command, **meta, **(each[part] if each else {})}))
                for part, peer in enumerate(self.servers)]
        return [self._await(pending, command, command)[0] for pending in sent]

    def ps_request(self, header: Header, tensors: list[np.ndarray] = ()) -> tuple[Header, list[np.ndarray]]:
        start = time.monotonic()
        step = f"parameter server {header.meta.get('command', header.op.value)}"
        reply = self._await(self.ps.send(header, tensors), step, step)
        self.watchdog.record(step, time.monotonic() - start)
        return reply

    def emulator_stats(self) -> dict[str, Any]:
        return {}

    def epoch_begins(self, epoch: int) -> None:
        """The training loop starts waiting for ``epoch`` (LocalCluster: ``--preempt``)."""

    def interruption_handled(self, part: int) -> None:
        """The coordinator acted on graph server ``part``'s interruption notice (LocalCluster:
        a ``--preempt`` kill is due now)."""
