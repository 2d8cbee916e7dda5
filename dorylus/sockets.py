"""The ZeroMQ sockets of every role, made in one place so that none misses CURVE or the size limit.

* :func:`server_socket`: a ROUTER that is a CURVE server when the role has keys, with
  ``ZMQ_MAXMSGSIZE`` set before it binds (ZeroMQ copies the option into the listener at bind
  time; setting it later has no effect on the connections it accepts).
* :func:`client_socket`: a DEALER that is a CURVE client of its server role when keys are
  given, with the same limit on what it receives, connected to ``endpoint``.

The size limit. ZeroMQ buffers a whole frame before anyone can look at it, so without a limit
one 256 MB frame costs the receiver 256 MB. With ``ZMQ_MAXMSGSIZE`` a frame above the limit
makes ZeroMQ drop the connection instead (the sender reconnects on its own; the frame is
lost). The limit applies per frame. Each receiver's limit is :func:`message_limit` of the
largest frame it legitimately receives (rows of its partition at its widest buffer; a weight
matrix), unless the run's config sets ``max_message_mb``.

Pure pyzmq: the Lambda bundle imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import zmq

from dorylus.curve import Keyring
from dorylus.protocol import MAX_HEADER_BYTES

LIMIT_MARGIN = 2  # legitimate frames may be this much larger than the estimate before they are dropped
MIN_LIMIT_BYTES = 1 << 20


def message_limit(largest_frame_bytes: int, override_mb: float | None = None) -> int:
    """Bytes a receiver accepts per frame: ``override_mb`` MB when set, else
    ``max(1 MiB, 2 x largest_frame_bytes + the header limit)``."""
    if override_mb is not None:
        return int(override_mb * (1 << 20))
    return max(MIN_LIMIT_BYTES, LIMIT_MARGIN * int(largest_frame_bytes) + MAX_HEADER_BYTES)


def largest_weight_bytes(weight_shapes: Iterable[Sequence[int]], itemsize: int = 4) -> int:
    """The largest weight (or optimizer-state) tensor of a model, in bytes."""
    return max((math.prod(shape) * itemsize for shape in weight_shapes), default=0)


def server_socket(context: zmq.Context, keys: Keyring | None, max_bytes: int) -> zmq.Socket:
    """An unbound ROUTER: CURVE server with ``keys``, frames above ``max_bytes`` dropped."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if keys is not None:
        keys.serve(socket)
    return socket


def client_socket(context: zmq.Context, endpoint: str, *, keys: Keyring | None, server_role: str,
                  max_bytes: int) -> zmq.Socket:
    """A DEALER connected to the ``server_role`` server at ``endpoint``: CURVE client with
    ``keys``, frames above ``max_bytes`` dropped."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if keys is not None:
        keys.connect(socket, server_role)
    socket.connect(endpoint)
    return socket
