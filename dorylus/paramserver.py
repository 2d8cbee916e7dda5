"""The parameter server: weights, optimizer state, weight versions and the weight stash.

One ROUTER socket answers every request with exactly one reply (DESIGN §1, §3, §5)::

    HELLO                                   -> READY    meta {num_layers, version, optimizer}
    PULL_WEIGHTS layer, epoch, interval,    -> WEIGHTS  layer, version, names, [one tensor per name],
                 part, meta {weights}                   meta {newest}
    PUSH_GRADS   layer, epoch, interval,    -> ACK      meta {duplicate}
                 version, part, names,
                 [one gradient per name]
    COMMAND configure {expected}            -> ACK      (auto-step, see below)
    COMMAND step  {epoch[, expected]}       -> ACK      meta {version, grads}
    COMMAND wait_version {version}          -> ACK      meta {version}, sent once that version exists
    COMMAND get_state [{version}]           -> WEIGHTS  meta {version, epoch, optimizer}, names, [parameters,
                                                        then optimizer state]
    COMMAND set_state {version, epoch,      -> ACK      meta {version, epoch}
                       optimizer}, tensors as get_state returns them
    COMMAND get_weights                     -> WEIGHTS  layer=0, version, names, [every parameter]
    COMMAND config                          -> ACK      meta: the config's fields servers use (server_view)
    STATS                                   -> STATS    meta {pulls, pushes, applied, dropped, ...}
    SHUTDOWN                                -> ACK, then the loop stops

HELLO's READY also says where functions dial this server (``meta["endpoint"]``: the
``--advertise`` address, else the bound one), its message limit (``max_message_bytes``) and
whether no run has used it yet (``fresh``).

Named parameters
----------------
Each layer has the parameters its model declares (``ModelSpec.param_shapes``: e.g. GCN's
``weight`` and ``bias``). A layer's messages carry them by bare name, ``names`` in the header
listing one tensor frame each: WEIGHTS every parameter of the layer in the model's order, and
PUSH_GRADS exactly the layer's names, each gradient of its parameter's shape and dtype (a
name missing or unknown, or a shape that differs, is ERROR ``bad_field``/``bad_shape``). Where
several layers' parameters travel together (get_state, set_state, get_weights) they are named
``layers.<l>.<name>`` and the optimizer's state ``layers.<l>.<name>.<kind>`` (:mod:`dorylus.optim`).

Weight versions and the stash
-----------------------------
Version ``v`` is the weights after ``v`` optimizer steps (one per epoch); each version's arrays
are immutable (a step writes new arrays), so a version can be pinned and sent without copying.
The stash key of a function call is ``(part, layer, epoch, interval)``; ``part`` comes from the
header or ``meta["part"]`` (default 0) because interval ids are local to a graph server.
``meta["weights"]`` of a PULL_WEIGHTS says which version it wants:

* ``pin`` (forward pass): pins the key to the newest version and returns it. A key already
  pinned (a relaunched attempt) gets its pinned version, so every attempt of a call computes
  with the same weights.
* ``stash`` (backward pass): the version the key pinned; ERROR ``out_of_range`` if none.
* ``newest`` (evaluation): the newest version, not pinned.
* absent: ``version`` given, exactly that version while it is kept; no ``version``, ``pin``.

Pins of epoch ``e`` are released when ``e`` is stepped (a relaunched backward may still pull
them until then); a version that is neither newest nor pinned is freed at once. Every reply
carries ``meta["newest"]`` so that callers can record how far behind their version was.

Gradients and the step
----------------------
Gradients are buffered per ``(epoch, layer)`` under the key ``(part, interval)``; the first
push of a key is applied, later pushes (relaunched attempts, pushes for an epoch already
stepped) are ACKed with ``meta={"duplicate": True}`` and dropped; STATS counts both
(``applied``, ``dropped``). A step sums each parameter's gradients in sorted ``(part, interval)``
order, accumulating in float64 and rounding once to float32, so the result does not depend on
arrival order; then it runs one optimizer step over all parameters with
:func:`dorylus.optim.build_optimizer` (``torch.optim``, one group per parameter with its layer's
``LayerSpec.weight_decay``, biases included), the same optimizer the reference trainer steps with.

After ``configure {expected: N}`` (N = intervals over all graph servers) the server steps by
itself: as soon as every layer of the next epoch has N gradients, in epoch order. Without it,
the ``step`` command does (tests, tools).

State
-----
``get_state`` returns the parameters and the optimizer state as named tensors
(``layers.0.weight``, ``layers.0.weight.exp_avg``, ``layers.0.weight.step``, ...): the newest, or with ``version`` the state right after that
step (the last :data:`KEPT_STATES` steps are kept; a version not reached yet is answered once
it is). ``set_state`` restores a state (a checkpoint's, on resume) and drops every pin and
pending gradient. The coordinator writes checkpoints; the parameter server never touches files.

Transport security
------------------
With ``keys`` (:mod:`dorylus.curve`) the socket is a CURVE server that admits only the
coordinator's, the graph servers' and the function's keys, and each role may send only its own
operations (a function cannot ``set_state``; only the coordinator may SHUTDOWN): others get
ERROR ``forbidden``. Without keys a SHUTDOWN is accepted and logged with its sender. In every
mode, a pull or push for an epoch beyond ``stepped + 1 + S + 1`` (``S``: the run's staleness)
is refused with ``epoch_ahead`` (no scheduler can be there yet), so such requests neither pin
versions nor buffer gradients that would later win over the real ones; frames above the
message limit (:mod:`dorylus.sockets`) are dropped by ZeroMQ. The server has no command that
takes a file path: checkpoints are the coordinator's (``get_state``), so no request can make it
read or write a file.

Errors
------
Every bad request gets an ERROR reply and is counted (STATS ``errors.<code>``); the loop never
dies on a message. Codes beyond :data:`dorylus.protocol.ERROR_CODES`: ``bad_command`` (unknown
command or bad command arguments), ``incomplete`` (step without every layer's gradients, or a
count other than ``expected``), ``bad_state`` (a ``set_state`` whose tensors do not fit the model).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from dorylus import atomic, curve, logs, sockets, spot
from dorylus.endpoints import advertised_endpoint, check_endpoint
from dorylus.commandline import role_main
from dorylus.errors import ConfigError, DorylusError
from dorylus.models.base import param_key
from dorylus.models.spec import ModelSpec
from dorylus.roleopts import add_server_arguments, server_options, watch_parent
from dorylus.protocol import (
    REQUESTS, Bounds, Header, Op, ProtocolCounters, ProtocolError, check_epoch, decode, encode, error_reply, reply_to,
)

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often the loop checks for stop(): the bound on shutdown latency
KEPT_STATES = 8  # optimizer states kept for get_state {version}: the coordinator's lag behind the steps
WEIGHT_REQUESTS = ("pin", "stash", "newest")

StashKey = tuple[int, int, int, int]  # (part, layer, epoch, interval)
Reply = tuple[Header, list[np.ndarray]]


class ParamServerError(DorylusError):
    """A parameter server cannot start (bad bind address, bad model options)."""


def _frozen(layers: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    for params in layers:
        for a in params.values():
            a.flags.writeable = False
    return layers


def _named(layers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every layer's parameters under their ``layers.<l>.<name>`` keys."""
    return {param_key(l, name): a for l, params in enumerate(layers) for name, a in params.items()}


def _meta_int(header: Header, name: str, default: int | None = None) -> int:
    value = header.meta.get(name, default)
    if value is None:
        raise ProtocolError("bad_command", f"{header.meta.get('command', header.op.value)}: "
                            f"meta[{name!r}] is required", req=header.req)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("bad_field", f"meta[{name!r}] must be a non-negative integer, got {value!r}",
                            req=header.req)
    return value


class ParameterServer:
    """Each layer's named parameters (float32, names and shapes from the model:
    ``ModelSpec.param_shapes``) of one model and their optimizer.

    Args:
        spec: the model; initial parameters are ``spec.init_params(seed)``.
        seed: weight-init seed (the reference trainer's ``config.seed``).
        optimizer, lr: passed to :func:`dorylus.optim.build_optimizer` with the spec's per-layer
            weight decays.
        bind: ZeroMQ endpoint; a TCP port of 0 picks a free port (see :attr:`endpoint`).
        context: ZeroMQ context to use; by default the server owns a new one.
        staleness: the run's staleness bound S; requests for epochs beyond ``stepped + S + 2``
            are refused (``epoch_ahead``).
        keys: this server's CURVE keyring (role ``paramserver``); None: no CURVE.
        advertise: the endpoint functions dial, when it differs from the bound one (a NAT, a
            wildcard bind); reported in READY.
        config: the training config it was started with (``TrainConfig.to_dict()``), answered
            to the ``config`` command so that a cluster-mode coordinator can check it.
        max_message_bytes: the largest frame accepted; default: from the model's largest weight
            (:func:`dorylus.sockets.message_limit`).

    Run the loop with :meth:`start` (background thread; :meth:`close` stops it) or
    :meth:`serve_forever` (calling thread, until SHUTDOWN or :meth:`stop`).
    """

    def __init__(self, spec: ModelSpec, seed: int = 0, optimizer: str = "adam", lr: float = 0.01, *,
                 bind: str = "tcp://127.0.0.1:0", context: zmq.Context | None = None, staleness: int = 0,
                 keys: curve.Keyring | None = None, advertise: str | None = None,
                 max_message_bytes: int | None = None, config: dict[str, Any] | None = None):
        self.spec = spec
        self.config = config or {}
        self.staleness = staleness
        self.keys = keys
        self.optimizer_name = optimizer
        self.num_layers = len(spec.layers)
        import torch

        from dorylus.optim import build_optimizer

        self._shapes = spec.param_shapes()  # per layer: {name: shape}
        initial = spec.init_params(seed)
        # The optimizer steps these tensors in place; every version is a frozen numpy copy per layer.
        self._params = [{name: torch.nn.Parameter(torch.from_numpy(w.copy())) for name, w in layer.items()}
                        for layer in initial]
        self._optimizer = build_optimizer({param_key(l, name): p for l, layer in enumerate(self._params)
                                           for name, p in layer.items()}, optimizer, lr, spec.weight_decays())
        self._versions: dict[int, list[dict[str, np.ndarray]]] = {0: _frozen(initial)}
        self._version = 0
        self._epoch = 0                      # last stepped epoch (0: none yet; epochs count from 1)
        self._stepped: set[int] = set()
        self._pins: dict[StashKey, int] = {}
        # (epoch, layer) -> (part, interval) -> {name: gradient}: one buffer per layer and epoch until its step
        self._grads: dict[tuple[int, int], dict[tuple[int, int], dict[str, np.ndarray]]] = {}
        self._expected: int | None = None    # gradients per layer and epoch; set: step by itself
        # version -> (parameters, optimizer arrays) right after that step, for get_state {version}
        self._states: dict[int, tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]] = {}
        self._deferred: list[tuple[bytes, Header]] = []  # wait_version / get_state for a future version
        self._bounds = Bounds(num_layers=self.num_layers)
        self.counters = ProtocolCounters()
        self._stats: Counter[str] = Counter()

        # Weights and the optimizer's state (set_state) travel one tensor per frame.
        self.max_message_bytes = max_message_bytes or sockets.message_limit(
            sockets.largest_weight_bytes(spec.named_shapes().values()))
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._auth = curve.start_authenticator(self._context, keys) if keys is not None else None
        self._socket = sockets.server_socket(self._context, keys, self.max_message_bytes)
        try:
            self._socket.bind(_any_port(bind))
        except zmq.ZMQError as exc:
            self._close_socket()
            raise ParamServerError(f"paramserver: cannot bind {bind}: {zmq.strerror(exc.errno).lower()}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.advertised = advertised_endpoint(self.endpoint, advertise)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handlers: dict[Op, Callable[[Header, list[np.ndarray]], Reply]] = {
            Op.HELLO: self._hello, Op.PULL_WEIGHTS: self._pull, Op.PUSH_GRADS: self._push,
            Op.COMMAND: self._command, Op.STATS: self._stats_reply, Op.SHUTDOWN: self._shutdown,
        }
        self._commands: dict[str, Callable[[Header], Reply]] = {
            "step": self._step, "get_state": self._get_state, "set_state": self._set_state,
            "get_weights": self._get_weights, "configure": self._configure, "wait_version": self._wait_version,
            "config": self._config_reply,
        }

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> "ParameterServer":
        """Serve in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("paramserver already started")
        self._thread = threading.Thread(target=self._serve, name="paramserver", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until SHUTDOWN or :meth:`stop`."""
        self._serve()

    def stop(self) -> None:
        """Ask the loop to stop (thread- and signal-safe); it exits within ``_POLL_MS``."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait for the loop thread to end; True when it has (or never ran)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop, wait for it at most ``timeout`` s, close the socket (linger 0)."""
        self.stop()
        if not self.join(timeout):
            raise RuntimeError(f"paramserver loop did not stop within {timeout} s")
        self._close_socket()

    @property
    def closed(self) -> bool:
        return self._socket.closed

    def _close_socket(self) -> None:
        if not self._socket.closed:
            self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context and not self._context.closed:
            self._context.term()

    def __enter__(self) -> "ParameterServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- loop

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(_POLL_MS, zmq.POLLIN):
                frames = self._socket.recv_multipart(copy=False)
                try:
                    self._handle(frames)
                except Exception as exc:  # _handle answers what it can; nothing one message does stops the loop
                    self._refused(frames[0].bytes, None, ProtocolError("internal", f"{type(exc).__name__}: {exc}"))

    def _refused(self, identity: bytes, header: Header | None, exc: ProtocolError) -> None:
        """Count a message that failed and log it with its sender: the first few of each kind,
        then every thousandth, so that a flood of bad messages cannot fill the disk."""
        self.counters.count(exc)
        seen = self.counters.as_dict().get(exc.code, 0)
        if seen <= 10 or seen % 1000 == 0:
            what = f"{header.op.value} req {header.req}" if header is not None else "a message"
            logger.warning("refused %s from peer %s (%d %s so far): %s", what, identity.hex(), seen, exc.code,
                           exc.message)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        self._stats["bytes_in"] += sum(f.buffer.nbytes for f in frames[1:])
        header: Header | None = None
        try:
            header, tensors = decode(frames[1:], self._bounds, check_finite=True)
            handler = self._handlers.get(header.op)
            if handler is None:
                raise ProtocolError("unknown_op", f"the parameter server does not handle {header.op.value}",
                                    req=header.req)
            curve.authorize("paramserver", "paramserver", self.keys is not None, identity, header, frames[1])
            answer = handler(header, tensors)
            if answer is None:  # deferred: answered when the version it waits for exists
                self._deferred.append((identity, header))
                return
            reply, out = answer
        except ProtocolError as exc:
            self._refused(identity, header, exc)
            if header is not None and header.op not in REQUESTS:
                return  # READY, ACK, ERROR ... sent to us expect no reply: drop (counted)
            reply, out = error_reply(header, exc), []
        except Exception as exc:  # a bug must not kill the server; the client learns what failed
            self._refused(identity, header, ProtocolError("internal", f"{type(exc).__name__}: {exc}"))
            if header is not None and header.op not in REQUESTS:
                return
            reply, out = error_reply(header, exc), []
        try:
            payload = encode(reply, out)
        except ProtocolError as exc:  # our own reply is unencodable (a bug): still answer
            self._refused(identity, header, ProtocolError("internal", f"unencodable reply: {exc.message}"))
            payload = encode(error_reply(header, exc))
        self._send(identity, payload)

    def _send(self, identity: bytes, payload: list) -> None:
        self._stats["bytes_out"] += sum(memoryview(f).nbytes for f in payload)
        self._socket.send_multipart([identity, *payload], copy=False)

    def _answer_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for identity, header in waiting:
            # Each waiting request on its own: one that fails must not lose the others' answers.
            try:
                answer = self._commands[header.meta["command"]](header)
            except ProtocolError as exc:  # e.g. the state asked for is gone after a set_state
                self._refused(identity, header, exc)
                answer = error_reply(header, exc), []
            except Exception as exc:
                self._refused(identity, header, ProtocolError("internal", f"{type(exc).__name__}: {exc}"))
                answer = error_reply(header, exc), []
            if answer is None:
                self._deferred.append((identity, header))
            else:
                self._send(identity, encode(*answer))

    # ------------------------------------------------------------------------- requests

    def _hello(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        return reply_to(header, Op.READY, meta={"num_layers": self.num_layers, "version": self._version,
                                                "optimizer": self.optimizer_name, "endpoint": self.advertised,
                                                "max_message_bytes": self.max_message_bytes,
                                                "fresh": self._fresh()}), []

    def _fresh(self) -> bool:
        """No run has used this server yet: initial weights, nothing configured, pinned or pending."""
        return self._version == 0 and self._expected is None and not self._pins and not self._grads

    @staticmethod
    def _part(header: Header) -> int:
        part = header.part if header.part is not None else _meta_int(header, "part", 0)
        if header.part is not None and "part" in header.meta and header.meta["part"] != header.part:
            raise ProtocolError("bad_field", f"part {header.part} in the header but {header.meta['part']!r} in meta",
                                req=header.req)
        return part

    def _stash_key(self, header: Header) -> StashKey:
        return (self._part(header), header.layer, header.epoch, header.interval)

    def _check_epoch(self, header: Header) -> None:
        """Refuse an epoch no scheduler can be at yet: the oldest unstepped is ``self._epoch + 1``."""
        check_epoch(header, self._epoch + 1, self.staleness)

    def _pull(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        self._check_epoch(header)
        key = self._stash_key(header)
        wanted = header.meta.get("weights")
        if wanted is not None and wanted not in WEIGHT_REQUESTS:
            raise ProtocolError("bad_field", f"meta['weights'] must be one of {', '.join(WEIGHT_REQUESTS)}, "
                                f"got {wanted!r:.40}", req=header.req)
        if wanted == "stash":
            version = self._pins.get(key)
            if version is None:
                raise ProtocolError("out_of_range", f"no weights stashed for part {key[0]} layer {key[1]} epoch "
                                    f"{key[2]} interval {key[3]} (pinned by its forward pull, released when "
                                    "the epoch is stepped)", req=header.req)
        elif wanted == "newest":
            version = self._version
        elif wanted == "pin" or header.version is None:
            version = self._pins.setdefault(key, self._version)
        elif header.version in self._versions:
            version = header.version
        else:
            raise ProtocolError(
                "out_of_range",
                f"weight version {header.version} of layer {header.layer} is not kept (current version "
                f"{self._version}, stashed {sorted(self._versions)}); a version is kept while a stash key pins it",
                req=header.req)
        params = self._versions[version][header.layer]
        self._stats["pulls"] += 1
        return (reply_to(header, Op.WEIGHTS, version=version, names=tuple(params), meta={"newest": self._version}),
                list(params.values()))

    def _free_unpinned(self) -> None:
        keep = set(self._pins.values()) | {self._version}
        for version in [v for v in self._versions if v not in keep]:
            del self._versions[version]

    def _push(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        layer = header.layer
        shapes = self._shapes[layer]
        if len(header.names) != len(tensors):
            raise ProtocolError("tensor_count", f"PUSH_GRADS of layer {layer} names {len(header.names)} gradients "
                                f"but carries {len(tensors)}", req=header.req)
        if set(header.names) != set(shapes):
            missing = [n for n in shapes if n not in header.names]
            unknown = [n for n in header.names if n not in shapes]
            raise ProtocolError("bad_field", f"PUSH_GRADS of layer {layer} must carry the gradient of every parameter "
                                f"of the layer ({', '.join(shapes)}); missing {missing}, unknown {unknown}",
                                req=header.req)
        grads = dict(zip(header.names, tensors))
        for name, grad in grads.items():
            if grad.shape != shapes[name]:
                raise ProtocolError("bad_shape", f"gradient of layer {layer} {name} has shape {list(grad.shape)}, "
                                    f"the parameter is {list(shapes[name])}", req=header.req)
            if grad.dtype != np.float32:
                raise ProtocolError("bad_dtype", f"gradient of layer {layer} {name} is {grad.dtype}, the parameter "
                                    "is float32", req=header.req)
        if header.version > self._version:
            raise ProtocolError("out_of_range", f"gradient computed with version {header.version}, "
                                f"but the newest version is {self._version}", req=header.req)
        self._check_epoch(header)
        key = self._stash_key(header)
        self._stats["pushes"] += 1
        buffer = self._grads.setdefault((header.epoch, layer), {}) if header.epoch not in self._stepped else None
        slot = (key[0], header.interval)
        if buffer is None or slot in buffer:
            self._stats["duplicates"] += 1
            self._stats["dropped"] += 1
            return reply_to(header, Op.ACK, meta={"duplicate": True}), []
        buffer[slot] = {name: grads[name].copy() for name in shapes}  # the received frames belong to ZeroMQ
        self._step_when_complete()
        return reply_to(header, Op.ACK, meta={"duplicate": False}), []

    def _step_when_complete(self) -> None:
        """With ``configure``d counts: step every next epoch whose gradients are all in."""
        while self._expected is not None:
            epoch = self._epoch + 1
            if any(len(self._grads.get((epoch, layer), ())) < self._expected for layer in range(self.num_layers)):
                return
            self._apply_step(epoch)
            self._answer_deferred()

    def _command(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        name = header.meta.get("command")
        command = self._commands.get(name) if isinstance(name, str) else None
        if command is None:
            raise ProtocolError("bad_command", f"unknown command {name!r:.40}; known: {', '.join(self._commands)}",
                                req=header.req)
        if name == "set_state":
            return self._set_state(header, tensors)
        if tensors:
            raise ProtocolError("tensor_count", f"command {name} carries no tensors, got {len(tensors)}",
                                req=header.req)
        return command(header)

    def _stats_reply(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        meta: dict[str, Any] = {name: self._stats[name] for name in
                                ("pulls", "pushes", "duplicates", "applied", "dropped", "steps", "bytes_in",
                                 "bytes_out")}
        errors = self.counters.as_dict()
        meta.update(version=self._version, epoch=self._epoch, pinned=len(self._pins),
                    stashed_versions=len(self._versions), pending_grads=sum(map(len, self._grads.values())),
                    errors=sum(errors.values()))
        meta.update({f"errors.{code}": count for code, count in sorted(errors.items())})
        return reply_to(header, Op.STATS, meta=meta), []

    def _shutdown(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        self.stop()  # the loop sends this ACK, then sees the flag
        return reply_to(header, Op.ACK), []

    # ------------------------------------------------------------------------- commands

    def _step(self, header: Header) -> Reply:
        """``p <- opt(p, sum_{(part, interval) sorted} dp[part, interval])`` for every parameter ``p``."""
        epoch = _meta_int(header, "epoch")
        expected = header.meta.get("expected")
        if expected is not None:
            expected = _meta_int(header, "expected")
        buffers = [self._grads.get((epoch, layer), {}) for layer in range(self.num_layers)]
        for layer, buffer in enumerate(buffers):
            if not buffer:
                why = " (already stepped)" if epoch in self._stepped else ""
                raise ProtocolError("incomplete", f"step epoch {epoch}{why}: layer {layer} has no gradient; "
                                    "sync mode needs every layer's gradients", req=header.req)
            if expected is not None and len(buffer) != expected:
                raise ProtocolError("incomplete", f"step epoch {epoch}: layer {layer} expected {expected} gradient "
                                    f"contributions, received {len(buffer)}", req=header.req)
        grads = self._apply_step(epoch)
        self._answer_deferred()
        return reply_to(header, Op.ACK, version=self._version, meta={"version": self._version, "grads": grads}), []

    def _apply_step(self, epoch: int) -> int:
        """Sum and apply epoch ``epoch``'s gradients; returns how many were summed."""
        import torch

        from dorylus.optim import optimizer_arrays

        buffers = [self._grads.get((epoch, layer), {}) for layer in range(self.num_layers)]
        for params, buffer in zip(self._params, buffers):
            for name, param in params.items():
                total = np.zeros(tuple(param.shape), np.float64)
                for slot in sorted(buffer):
                    total += buffer[slot][name]
                param.grad = torch.from_numpy(total.astype(np.float32))
        self._optimizer.step()
        self._version += 1
        self._versions[self._version] = _frozen([{name: p.detach().numpy().copy() for name, p in params.items()}
                                                 for params in self._params])
        self._epoch = max(self._epoch, epoch)
        self._stepped.add(epoch)
        for layer in range(self.num_layers):
            del self._grads[(epoch, layer)]
        for key in [k for k in self._pins if k[2] <= epoch]:  # the stepped epoch's pins had their last use
            del self._pins[key]
        self._free_unpinned()
        self._states[self._version] = (self._versions[self._version],
                                       {k: v.copy() for k, v in optimizer_arrays(self._optimizer).items()})
        for version in sorted(self._states)[:-KEPT_STATES]:
            del self._states[version]
        applied = sum(map(len, buffers))
        self._stats["steps"] += 1
        self._stats["applied"] += applied
        return applied

    def _configure(self, header: Header) -> Reply:
        self._expected = _meta_int(header, "expected")
        if self._expected < 1:
            raise ProtocolError("bad_field", "meta['expected'] must be >= 1", req=header.req)
        self._step_when_complete()
        return reply_to(header, Op.ACK, meta={"expected": self._expected}), []

    def _config_reply(self, header: Header) -> Reply:
        from dorylus.config import server_view

        return reply_to(header, Op.ACK, meta=server_view(self.config)), []

    def _wait_version(self, header: Header) -> Reply | None:
        if _meta_int(header, "version") > self._version:
            return None
        return reply_to(header, Op.ACK, version=self._version, meta={"version": self._version}), []

    def _get_weights(self, header: Header) -> Reply:
        arrays = _named(self._versions[self._version])
        return (reply_to(header, Op.WEIGHTS, layer=0, version=self._version, names=tuple(arrays),
                         meta={"version": self._version}), list(arrays.values()))

    def _get_state(self, header: Header) -> Reply | None:
        from dorylus.optim import optimizer_arrays

        version = self._version if header.meta.get("version") is None else _meta_int(header, "version")
        if version > self._version:
            return None
        if version == self._version:
            weights, optimizer = self._versions[version], optimizer_arrays(self._optimizer)
        elif version in self._states:
            weights, optimizer = self._states[version]
        else:
            raise ProtocolError("state_gone", f"get_state: the state of version {version} is no longer kept "
                                f"(newest {self._version}, kept {sorted(self._states)})", req=header.req)
        arrays = _named(weights)
        arrays.update(optimizer)
        meta = {"version": version, "epoch": version, "optimizer": self.optimizer_name}
        return (reply_to(header, Op.WEIGHTS, layer=0, version=version, names=tuple(arrays), meta=meta),
                list(arrays.values()))

    def _set_state(self, header: Header, tensors: list[np.ndarray]) -> Reply:
        """Restore a :meth:`_get_state`; nothing changes unless every tensor fits the model."""
        import torch

        from dorylus.optim import load_optimizer_arrays

        def fail(message: str) -> ProtocolError:
            return ProtocolError("bad_state", f"set_state: {message}", req=header.req)

        version, epoch = _meta_int(header, "version"), _meta_int(header, "epoch")
        if header.meta.get("optimizer") != self.optimizer_name:
            raise fail(f"state of optimizer {header.meta.get('optimizer')!r}, this server runs {self.optimizer_name!r}")
        if len(header.names) != len(tensors):
            raise fail(f"{len(tensors)} tensors but {len(header.names)} names")
        arrays = dict(zip(header.names, tensors))
        weights: list[dict[str, np.ndarray]] = []
        for layer, shapes in enumerate(self._shapes):
            weights.append({})
            for name, shape in shapes.items():
                w = arrays.pop(param_key(layer, name), None)
                if w is None:
                    raise fail(f"no {param_key(layer, name)} (the model's parameters: "
                               f"{', '.join(self.spec.named_shapes())})")
                if w.shape != shape or w.dtype != np.float32:
                    raise fail(f"{param_key(layer, name)} is {w.dtype}{list(w.shape)}, the model needs "
                               f"float32{list(shape)}")
                weights[layer][name] = np.array(w)
        try:
            load_optimizer_arrays(self._optimizer, arrays)  # validates everything before changing anything
        except ValueError as exc:
            raise fail(str(exc)) from None
        with torch.no_grad():
            for params, values in zip(self._params, weights):
                for name, param in params.items():
                    param.copy_(torch.from_numpy(values[name]))
        self._version, self._epoch = version, epoch
        self._stepped = set(range(1, epoch + 1))
        self._versions = {version: _frozen(weights)}
        self._pins.clear()   # pins of the old timeline name versions that no longer exist
        self._grads.clear()
        self._states = {version: (self._versions[version], {k: np.array(v) for k, v in arrays.items()})}
        self._answer_deferred()
        return reply_to(header, Op.ACK, version=version, meta={"version": version, "epoch": epoch}), []


def _any_port(endpoint: str) -> str:
    """``tcp://host:0`` -> ``tcp://host:*`` (ZeroMQ's spelling of "a free port")."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dorylus paramserver``."""
    parser.add_argument("--config", metavar="FILE",
                        help="training config (.toml or .json) giving the model (model, layers, hidden), "
                             "optimizer, lr, weight decay and seed; defaults when absent")
    parser.add_argument("--num-features", type=int, required=True, metavar="F", help="input feature dimension")
    parser.add_argument("--num-classes", type=int, required=True, metavar="C", help="number of classes")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", metavar="ENDPOINT",
                        help="ZeroMQ endpoint to listen on; port 0 picks a free port (default: tcp://127.0.0.1:0)")
    parser.add_argument("--ready-file", metavar="PATH",
                        help="after binding, write the actual endpoint into this file (atomically) so that a "
                             "parent process can find the port")
    add_server_arguments(parser, "paramserver")
    spot.add_argument(parser)
    logs.add_argument(parser)


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until SHUTDOWN, SIGTERM or SIGINT; returns the exit status."""
    from dorylus.config import TrainConfig, load_config_file

    logs.setup("paramserver", args.log_level)
    check_endpoint("--bind", args.bind)
    if args.ready_file and not Path(args.ready_file).parent.is_dir():
        raise ConfigError(f"--ready-file {args.ready_file}: directory {Path(args.ready_file).parent} does not exist")

    config = TrainConfig.from_dict(load_config_file(args.config), where=args.config) if args.config else TrainConfig()
    if args.num_features < 1 or args.num_classes < 1:
        raise ParamServerError(f"paramserver: --num-features ({args.num_features}) and --num-classes "
                               f"({args.num_classes}) must be >= 1")
    keys, advertise = server_options(args, "paramserver")
    spec = ModelSpec.from_config(config, args.num_features, args.num_classes)
    limit = sockets.message_limit(sockets.largest_weight_bytes(spec.named_shapes().values()), config.max_message_mb)
    server = ParameterServer(spec, config.seed, config.optimizer, config.lr, bind=args.bind,
                             staleness=config.staleness, keys=keys, advertise=advertise, max_message_bytes=limit,
                             config=config.to_dict())
    previous = {sig: signal.signal(sig, lambda *_: server.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    watch = watch_parent(args, server.stop)
    # No reply carries a notice to the coordinator yet: logged (dorylus.spot) for the operator.
    watcher = spot.start_from_args(args, lambda notice: None, "paramserver")
    try:
        if args.ready_file:
            atomic.write_text(Path(args.ready_file), server.endpoint + "\n")
        logger.info("listening on %s%s%s", server.endpoint,
                    f", advertised as {server.advertised}" if server.advertised != server.endpoint else "",
                    ", CURVE on" if keys is not None else "")
        server.serve_forever()
    finally:
        if watch is not None:
            watch.set()
        if watcher is not None:
            watcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dorylus.paramserver ...``: the same parser and one-line errors as ``dorylus paramserver``."""
    return role_main("paramserver", add_arguments, run_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
