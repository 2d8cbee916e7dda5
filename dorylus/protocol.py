"""Dorylus wire protocol: typed, validated, zero-copy ZeroMQ messages.

Imports numpy, pyzmq and the standard library only: the AWS Lambda bundle ships this module
without torch and without the rest of the package.

Message layout
--------------
One message is one ZeroMQ multipart message::

    frame 0        header: UTF-8 JSON object, at most MAX_HEADER_BYTES
    frame 1 .. n   raw little-endian C-order tensor bytes, one frame per tensor
    frame n + 1    (only when the header has ``doc``) a UTF-8 JSON document, at most MAX_DOC_BYTES

The JSON header carries the protocol version ``v``, the operation ``op``, the non-default fields
of :class:`Header` and ``t``: one ``[dtype, shape]`` pair per tensor frame. ``t`` is derived
from the arrays by :func:`encode`, never set by hand, so a header cannot disagree with the
tensors it was built from. Fields equal to their default are omitted, so a typical header is
about 100 bytes.

Operations
----------
Every field not listed as required may still be present. ``rows`` is a half-open range
``[start, stop)`` of the receiver's local rows; "rows tensors" have ``shape[0] == stop - start``.
All tensors of row-carrying ops are 1-D or 2-D (e.g. ``Z [n, F]``, labels ``[n]``).

=============  ======================  =========================================  ==============================
op             direction               required fields                            tensor frames
=============  ======================  =========================================  ==============================
HELLO          any -> server           role                                       none
READY          server -> any           (reply to HELLO)                           none
PULL           function -> graph srv   task, epoch, layer, interval, rows, names  none (asks for ``names``)
ROWS           graph srv -> function   epoch, layer, interval, rows, names        one rows tensor per name (three
                                                                                  for a name in ``csr``)
PUSH           function -> graph srv   task, epoch, layer, interval, rows         one rows tensor per name
ACK            server -> any           (reply to PUSH, PUSH_GRADS, GHOSTS, ...)   none
PULL_WEIGHTS   function -> param srv   layer, epoch, interval                     none
WEIGHTS        param srv -> function   layer, version                             1..MAX_TENSORS float, 1-D/2-D
PUSH_GRADS     function -> param srv   layer, epoch, interval, version            1..MAX_TENSORS float, 1-D/2-D
GHOSTS         graph srv -> graph srv  task, epoch, layer, part, rows             1 float rows tensor
SHUTDOWN       control -> any          (none; answered by ACK)                    none
STATS          control, both ways      (none; counters travel in ``meta``)        none
COMMAND        coordinator -> server   (none; ``meta["command"]`` names it)       0..MAX_TENSORS float (state)
ERROR          server -> any           code, message                              none
=============  ======================  =========================================  ==============================

* PUSH is idempotent per ``(task, interval, epoch, attempt)`` (plus ``layer``): the receiver
  keeps the first result for ``(task, interval, epoch, layer)`` and ACKs late duplicates with
  ``meta={"duplicate": True}``.
* PULL_WEIGHTS without ``version`` asks for the newest weights and pins that version under the
  stash key ``(layer, epoch, interval)``; with ``version`` (backward pass) it asks for exactly
  that stashed version. The reply's ``version`` says which one was sent.
* PULL with ``meta={"sums": "a,b"}``: for each of those comma-separated names (row buffers among
  ``names``: a stage's ``summed`` reads, :class:`dorylus.models.base.Stage`) the ROWS reply
  (whose ``meta`` repeats ``sums``) carries the float32 sum of the rows, ``[1, width]``, instead
  of the rows.
* GHOSTS: ``task`` is ``SC`` (forward activation rows) or ``SC_BWD`` (gradient rows), ``part``
  is the sending partition and ``rows`` the range inside the receiver's ghost block from it.
* ``req`` is a request id chosen by the requester and copied into the reply (:func:`reply_to`),
  so a DEALER client may keep several requests in flight.

Documents
---------
Variable-length control data (a graph server's finished-epoch reports, for one) never travels
in ``meta``, whose strings are capped at :data:`MAX_MESSAGE_CHARS`: it goes in the header's
``doc``, any JSON value, sent as one extra frame after the tensors (the wire header's ``doc`` is
that frame's byte length). A document is at most :data:`MAX_DOC_BYTES`, below every receiver's
frame limit (:data:`dorylus.sockets.MIN_LIMIT_BYTES`), so it is never dropped by ZeroMQ; a sender
with more to say sends it in several replies (:func:`take_fitting` picks what fits one).
Malformed, oversized or non-finite documents are ``bad_doc``.

Sparse rows
-----------
A ROWS reply may carry a name's rows as CSR (sparse input features): the header's ``csr`` maps
that name to its column count ``F``, and its entry in the tensor frames is three tensors instead
of one: values ``float32 [nnz]``, column indices ``int32 [nnz]`` or ``int64 [nnz]`` (in
``[0, F)``, strictly ascending within a row) and row pointers ``int64 [stop - start + 1]``
(rising from 0 to ``nnz``). :func:`rows_reply` builds such a reply from dense or sparse row
blocks, :func:`named_rows` gives one entry per name back (:class:`CsrRows` for the sparse ones).
Any other op with ``csr``, or a CSR payload that breaks these rules, is ``bad_sparse``.

Validation
----------
:func:`decode` checks every message before anything uses it and raises :class:`ProtocolError`
with a short ``code`` (one of :data:`ERROR_CODES`): undecodable header, wrong version, unknown
op or field, field of the wrong type, missing required field, dtype outside the whitelist,
negative dims or wrong ndim, frame count or frame length not matching the header, reversed rows,
rows or ids outside the receiver's :class:`Bounds`, a rows tensor whose length differs from the
range, non-finite floats (``check_finite=True``), bool frames with bytes other than 0/1.
:func:`encode` runs the same checks, so a sender learns about a bad message at once.

Epochs a receiver cannot use yet are refused, never buffered: :func:`check_epoch` raises
``epoch_ahead`` for an epoch beyond ``current + S + 1`` (the receiver's oldest unfinished
epoch, the staleness bound, and one epoch of slack for a peer that already moved on), so a
message for a far-future epoch can neither pile up in memory nor wait there to win over the
real one.

A server turns a ProtocolError into an ERROR reply (:func:`error_reply`) or, for messages that
expect no reply, drops it and counts it in :class:`ProtocolCounters`. :func:`write_rows` is the
only sanctioned way to copy received rows into a destination buffer: it re-checks bounds, dtype
and shape against the destination.

Zero copy
---------
:func:`send` hands numpy buffers to ZeroMQ with ``copy=False`` (non-contiguous arrays are made
contiguous first). The caller must not modify a sent array until ZeroMQ is done with it: pass
``track=True`` and wait on the returned ``zmq.MessageTracker`` before overwriting (over
``inproc://`` the receiver even sees the sender's memory). :func:`recv` receives with
``copy=False`` and builds each array with ``np.frombuffer`` over the frame: no copy is made, and
the arrays are marked read-only. Take a writable copy explicitly (``arr.copy()``) when needed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import operator
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zmq

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 512  # a whole model's parameters and optimizer state travel in one COMMAND
MAX_NDIM = 8
MAX_MESSAGE_CHARS = 1024
MAX_DOC_BYTES = 512 * 1024  # half of sockets.MIN_LIMIT_BYTES: every receiver takes a document frame
_MAX_ID = 2**63 - 1


class ProtocolError(Exception):
    """A message that violates the protocol.

    ``code`` is a short machine-readable reason (one of :data:`ERROR_CODES`); ``req`` is the
    request id when the header was readable far enough to find one, so that the ERROR reply can
    be matched to its request; ``identity`` is the ROUTER envelope when received by
    :func:`recv_routed`, so that a server can reply.
    """

    def __init__(self, code: str, message: str, *, req: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req = req
        self.identity: bytes | None = None


ERROR_CODES = frozenset({
    "empty",             # no frames at all
    "header_too_large",  # header frame above MAX_HEADER_BYTES
    "bad_header",        # header is not a UTF-8 JSON object
    "bad_version",       # missing or different protocol version
    "unknown_op",
    "unknown_field",
    "bad_field",         # field of the wrong type or value
    "missing_field",     # field required by the op is absent
    "bad_dtype",         # dtype outside the whitelist (or not float where the op needs float)
    "bad_shape",         # negative dims, too many dims, or wrong ndim for the op
    "frame_count",       # number of tensor frames differs from the header's list
    "tensor_count",      # number of tensors not allowed for the op
    "frame_length",      # frame bytes != prod(shape) * itemsize
    "bad_rows",          # reversed or negative row range
    "out_of_range",      # rows / interval / layer / part outside the receiver's bounds
    "state_gone",        # get_state of a version the parameter server no longer keeps
    "row_count",         # rows tensor length differs from the row range
    "not_finite",        # NaN or inf in a float tensor (check_finite=True)
    "bad_bool",          # bool frame with bytes other than 0 and 1
    "dest_mismatch",     # write_rows: dtype or row shape differs from the destination
    "internal",          # the server failed while handling a valid request
    "bad_command",       # COMMAND unknown or with bad arguments
    "incomplete",        # a step without every expected gradient
    "bad_state",         # a parameter-server state that does not fit the model
    "bad_sparse",        # a CSR payload (``csr``) that is malformed, or on an op that cannot carry one
    "epoch_ahead",       # an epoch beyond what the receiver's scheduler can accept yet (see check_epoch)
    "forbidden",         # the sender's CURVE key (role) may not send this (dorylus.curve.check_allowed)
    "bad_doc",           # the JSON document frame (``doc``) is malformed, too large or not finite
})


class Op(str, enum.Enum):
    """Operation names; the value is what travels on the wire."""

    HELLO = "HELLO"
    READY = "READY"
    PULL = "PULL"
    ROWS = "ROWS"
    PUSH = "PUSH"
    ACK = "ACK"
    PULL_WEIGHTS = "PULL_WEIGHTS"
    WEIGHTS = "WEIGHTS"
    PUSH_GRADS = "PUSH_GRADS"
    GHOSTS = "GHOSTS"
    SHUTDOWN = "SHUTDOWN"
    STATS = "STATS"
    COMMAND = "COMMAND"
    ERROR = "ERROR"


# Task kinds (DESIGN §2). The graph server's own tasks are fixed; a function's tasks are its
# model's (each model's plan names its stages: AV, AV_BWD, LOSS, AV_LOSS, ...; the graph server
# refuses a PUSH for a stage its plan does not have), so the wire checks only their form.
SCATTER_TASKS = frozenset({"SC", "SC_BWD"})
GRAPH_TASKS = SCATTER_TASKS | {"GA", "GA_BWD"}
_TASK_RE = re.compile(r"[A-Z][A-Z0-9_]{0,31}")


class _TaskNames:
    """Task names given by a rule (``in`` tests it): short upper-case identifiers, with or without
    the graph server's own."""

    def __init__(self, graph_tasks: bool):
        self.graph_tasks = graph_tasks

    def __contains__(self, task: object) -> bool:
        return (isinstance(task, str) and _TASK_RE.fullmatch(task) is not None
                and (self.graph_tasks or task not in GRAPH_TASKS))

    def __repr__(self) -> str:
        return ("an upper-case task name" if self.graph_tasks
                else f"a model's task name (upper-case, not {', '.join(sorted(GRAPH_TASKS))})")


FUNCTION_TASKS = _TaskNames(graph_tasks=False)
TASK_KINDS = _TaskNames(graph_tasks=True)
ROLES = frozenset({"function", "graphserver", "paramserver", "coordinator"})

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_FLOAT_NAMES = frozenset({"float32", "float64"})
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.']{0,63}")  # dots: parameters as layers.<l>.<name>
_CODE_RE = re.compile(r"[a-z_]{1,32}")
_META_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")
_MAX_META = 64


@dataclass(frozen=True)
class Header:
    """The typed header of one message; ``None`` means "not set" (omitted on the wire)."""

    op: Op
    req: int = 0                         # request id, echoed in the reply
    epoch: int | None = None
    layer: int | None = None
    interval: int | None = None
    part: int | None = None              # partition id (GHOSTS: the sender's)
    rows: tuple[int, int] | None = None  # [start, stop) in the receiver's local rows
    version: int | None = None           # weight version
    attempt: int = 0                     # relaunch counter of a function call
    task: str | None = None              # in TASK_KINDS
    names: tuple[str, ...] = ()          # tensor names: requested (PULL) or carried
    role: str | None = None              # HELLO: one of ROLES
    code: str | None = None              # ERROR: one of ERROR_CODES
    message: str | None = None           # ERROR: human-readable reason
    meta: dict[str, Any] = field(default_factory=dict)  # flat str -> int/float/str/bool/None
    csr: dict[str, int] = field(default_factory=dict)   # ROWS: names carried as CSR -> column count
    doc: Any = None                      # any JSON value, carried in its own frame (see "Documents")

    @property
    def key(self) -> tuple[str | None, int | None, int | None, int | None]:
        """``(task, interval, epoch, layer)``: the identity of a result, shared by all attempts."""
        return (self.task, self.interval, self.epoch, self.layer)


_INT_FIELDS = ("epoch", "layer", "interval", "part", "version")
_FIELDS = tuple(f.name for f in dataclasses.fields(Header))


@dataclass(frozen=True)
class _OpSpec:
    required: tuple[str, ...] = ()
    min_tensors: int = 0
    max_tensors: int = 0
    tensors_per_name: bool = False   # exactly one tensor per entry of ``names``
    row_tensors: bool = False        # every tensor has shape[0] == stop - start
    ndims: tuple[int, ...] = (1, 2)
    floats_only: bool = False
    tasks: "frozenset[str] | _TaskNames | None" = None
    sparse: bool = False             # names in ``csr`` carry three tensors (see "Sparse rows")


_ROW_FIELDS = ("epoch", "layer", "interval", "rows", "names")
_OPS: dict[Op, _OpSpec] = {
    Op.HELLO: _OpSpec(("role",)),
    Op.READY: _OpSpec(),
    Op.PULL: _OpSpec(("task", *_ROW_FIELDS), tasks=FUNCTION_TASKS),
    Op.ROWS: _OpSpec(_ROW_FIELDS, tensors_per_name=True, row_tensors=True, sparse=True),
    # A PUSH may carry no tensors at all: a result of scalars only (evaluation counts in meta).
    Op.PUSH: _OpSpec(("task", "epoch", "layer", "interval", "rows"), tensors_per_name=True, row_tensors=True,
                     tasks=FUNCTION_TASKS),
    Op.ACK: _OpSpec(),
    Op.PULL_WEIGHTS: _OpSpec(("layer", "epoch", "interval")),
    Op.WEIGHTS: _OpSpec(("layer", "version"), 1, MAX_TENSORS, floats_only=True),
    Op.PUSH_GRADS: _OpSpec(("layer", "epoch", "interval", "version"), 1, MAX_TENSORS, floats_only=True),
    Op.GHOSTS: _OpSpec(("task", "epoch", "layer", "part", "rows"), 1, 1, row_tensors=True,
                       floats_only=True, tasks=SCATTER_TASKS),
    Op.SHUTDOWN: _OpSpec(),
    Op.STATS: _OpSpec(),
    Op.COMMAND: _OpSpec(max_tensors=MAX_TENSORS, floats_only=True),  # tensors: a state to restore
    Op.ERROR: _OpSpec(("code", "message")),
}

# Ops whose sender waits for a reply; a server replies ERROR to these and drops bad others.
REQUESTS = frozenset({Op.HELLO, Op.PULL, Op.PUSH, Op.PULL_WEIGHTS, Op.PUSH_GRADS, Op.GHOSTS, Op.STATS, Op.SHUTDOWN,
                      Op.COMMAND})


@dataclass(frozen=True)
class Bounds:
    """What the receiver owns; ids outside it are rejected with ``out_of_range``.

    ``num_rows``: a row range must satisfy ``stop <= num_rows``. ``intervals``: the ``(start, stop)`` row
    range of each interval; a message's rows must lie inside its interval's range.
    ``num_layers`` / ``num_parts``: ``layer`` / ``part`` must be below them. ``None``: unchecked.
    """

    num_rows: int | None = None
    intervals: Sequence[tuple[int, int]] | None = None
    num_layers: int | None = None
    num_parts: int | None = None

    def check(self, header: Header) -> None:
        req = header.req
        for name, limit in (("layer", self.num_layers), ("part", self.num_parts)):
            value = getattr(header, name)
            if limit is not None and value is not None and value >= limit:
                raise ProtocolError("out_of_range", f"{name} {value} not below {limit}", req=req)
        if header.rows is not None and self.num_rows is not None:
            validate_rows(header, self.num_rows)
        if self.intervals is not None and header.interval is not None:
            if header.interval >= len(self.intervals):
                raise ProtocolError(
                    "out_of_range", f"interval {header.interval} not below {len(self.intervals)}", req=req)
            lo, hi = self.intervals[header.interval]
            if header.rows is not None and not (lo <= header.rows[0] and header.rows[1] <= hi):
                raise ProtocolError(
                    "out_of_range",
                    f"rows {list(header.rows)} outside interval {header.interval} = [{lo}, {hi})", req=req)


def validate_rows(header: Header, num_rows: int) -> tuple[int, int]:
    """``(start, stop)`` of ``header.rows`` after checking ``0 <= start <= stop <= num_rows``."""
    if header.rows is None:
        raise ProtocolError("missing_field", f"{header.op.value} has no rows", req=header.req)
    start, stop = header.rows
    if not 0 <= start <= stop:
        raise ProtocolError("bad_rows", f"row range [{start}, {stop}) is reversed or negative", req=header.req)
    if stop > num_rows:
        raise ProtocolError("out_of_range", f"row range [{start}, {stop}) exceeds {num_rows} rows", req=header.req)
    return start, stop


# ----------------------------------------------------------------------------- header checks


def _allowed(allowed) -> str:
    return str(sorted(allowed)) if isinstance(allowed, (set, frozenset)) else repr(allowed)


def _fail(code: str, message: str, req: int | None) -> None:
    raise ProtocolError(code, message, req=req)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_id(name: str, x: object, req: int | None) -> int:
    if not _is_int(x) or not 0 <= x <= _MAX_ID:
        _fail("bad_field", f"{name} must be an integer in [0, 2^63), got {x!r:.40}", req)
    return x  # type: ignore[return-value]


def _check_meta(meta: object, req: int | None) -> dict[str, Any]:
    if not isinstance(meta, dict) or len(meta) > _MAX_META:
        _fail("bad_field", f"meta must be an object with at most {_MAX_META} entries", req)
    for k, val in meta.items():  # type: ignore[union-attr]
        if not isinstance(k, str) or not _META_KEY_RE.fullmatch(k):
            _fail("bad_field", f"meta key {k!r:.40} is not a short identifier", req)
        ok = val is None or isinstance(val, (bool, int, str)) or (isinstance(val, float) and math.isfinite(val))
        if not ok or (isinstance(val, str) and len(val) > MAX_MESSAGE_CHARS):
            _fail("bad_field", f"meta[{k!r}] must be a finite number, bool, short string or null", req)
    return meta  # type: ignore[return-value]


def _header_from_wire(d: dict[str, Any]) -> tuple[Header, list[tuple[np.dtype, tuple[int, ...]]], int]:
    """Check a wire dict field by field (everything but frames and bounds) and type it; also
    returns the byte length of the document frame (0: none). ``doc`` itself is left unset."""
    raw_req = d.get("req", 0)
    req = raw_req if _is_int(raw_req) and 0 <= raw_req <= _MAX_ID else None

    if d.get("v") != PROTOCOL_VERSION or not _is_int(d.get("v")):
        _fail("bad_version", f"protocol version {d.get('v')!r:.20} (expected {PROTOCOL_VERSION})", req)
    raw_op = d.get("op")
    if not isinstance(raw_op, str) or raw_op not in Op.__members__:
        _fail("unknown_op", f"unknown operation {raw_op!r:.40}", req)
    op = Op(raw_op)
    spec = _OPS[op]
    unknown = set(d) - set(_FIELDS) - {"v", "t"}
    if unknown:
        _fail("unknown_field", f"unknown header field(s) {sorted(map(str, unknown))[:5]}", req)

    kw: dict[str, Any] = {"op": op, "req": _check_id("req", raw_req, req)}
    kw["attempt"] = _check_id("attempt", d.get("attempt", 0), req)
    for name in _INT_FIELDS:
        if d.get(name) is not None:
            kw[name] = _check_id(name, d[name], req)
    rows = d.get("rows")
    if rows is not None:
        if not isinstance(rows, list) or len(rows) != 2 or not all(_is_int(r) for r in rows):
            _fail("bad_field", "rows must be [start, stop] integers", req)
        if not 0 <= rows[0] <= rows[1] <= _MAX_ID:
            _fail("bad_rows", f"row range [{rows[0]}, {rows[1]}) is reversed or negative", req)
        kw["rows"] = (rows[0], rows[1])
    names = d.get("names", [])
    if (not isinstance(names, list) or len(names) > MAX_TENSORS
            or not all(isinstance(n, str) and _NAME_RE.fullmatch(n) for n in names)
            or len(set(names)) != len(names)):
        _fail("bad_field", "names must be a list of distinct short identifiers", req)
    kw["names"] = tuple(names)
    for name, allowed in (("task", TASK_KINDS), ("role", ROLES)):
        if d.get(name) is not None:
            if not isinstance(d[name], str) or d[name] not in allowed:
                _fail("bad_field", f"{name} {d[name]!r:.40} not one of {_allowed(allowed)}", req)
            kw[name] = d[name]
    if d.get("code") is not None:
        if not isinstance(d["code"], str) or not _CODE_RE.fullmatch(d["code"]):
            _fail("bad_field", "code must be a short lower_case word", req)
        kw["code"] = d["code"]
    if d.get("message") is not None:
        if not isinstance(d["message"], str) or len(d["message"]) > MAX_MESSAGE_CHARS:
            _fail("bad_field", f"message must be a string of at most {MAX_MESSAGE_CHARS} characters", req)
        kw["message"] = d["message"]
    kw["meta"] = _check_meta(d.get("meta", {}), req)
    csr = d.get("csr", {})
    if not isinstance(csr, dict) or not all(isinstance(k, str) and _is_int(v) and 0 <= v <= _MAX_ID
                                            for k, v in csr.items()):
        _fail("bad_sparse", "csr must map tensor names to column counts (non-negative integers)", req)
    if set(csr) - set(kw["names"]):
        _fail("bad_sparse", f"csr names {sorted(set(csr) - set(kw['names']))[:5]} are not in names", req)
    kw["csr"] = dict(csr)
    doc_bytes = d.get("doc", 0)
    if not _is_int(doc_bytes) or not 0 <= doc_bytes <= MAX_DOC_BYTES:
        _fail("bad_doc", f"doc must be the document frame's byte length, at most {MAX_DOC_BYTES}, "
                         f"got {doc_bytes!r:.40}", req)
    header = Header(**kw)

    for name in spec.required:
        if getattr(header, name) in (None, ()):
            _fail("missing_field", f"{op.value} requires field {name!r}", req)
    if spec.tasks is not None and header.task not in spec.tasks:
        _fail("bad_field", f"{op.value} task must be one of {_allowed(spec.tasks)}, got {header.task!r}", req)
    if header.csr and not spec.sparse:
        _fail("bad_sparse", f"{op.value} cannot carry CSR rows (csr is for ROWS)", req)

    t = d.get("t", [])
    if not isinstance(t, list):
        _fail("bad_field", "t must be a list of [dtype, shape]", req)
    n = len(t)
    per_name = len(header.names) + 2 * len(header.csr)
    expected = (per_name, per_name) if spec.tensors_per_name else (spec.min_tensors, spec.max_tensors)
    if not expected[0] <= n <= expected[1]:
        want = str(expected[0]) if expected[0] == expected[1] else f"{expected[0]}..{expected[1]}"
        _fail("tensor_count", f"{op.value} carries {want} tensor(s), header lists {n}", req)
    roles = _tensor_roles(header) if spec.tensors_per_name else [("", ROWS_ROLE)] * n
    summed = set(summed_names(header)) if header.op is Op.ROWS else set()
    specs = []
    for i, entry in enumerate(t):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            _fail("bad_field", f"t[{i}] must be [dtype, shape]", req)
        dtype_name, shape = entry
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            _fail("bad_dtype", f"tensor {i} dtype {dtype_name!r:.20} not in {sorted(DTYPES)}", req)
        if spec.floats_only and dtype_name not in _FLOAT_NAMES:
            _fail("bad_dtype", f"{op.value} tensor {i} must be float32 or float64, got {dtype_name}", req)
        if not all(_is_int(s) and 0 <= s <= _MAX_ID for s in shape) or len(shape) > MAX_NDIM:
            _fail("bad_shape", f"tensor {i} shape {shape!r:.60} has negative, non-integer or too many dims", req)
        if len(shape) not in spec.ndims:
            _fail("bad_shape", f"{op.value} tensor {i} must have ndim in {spec.ndims}, got {len(shape)}", req)
        name, role = roles[i]
        if role != ROWS_ROLE:
            _check_csr_spec(header, name, role, dtype_name, shape, specs, req)
        elif spec.row_tensors:
            start, stop = header.rows  # required for every row_tensors op
            want = 1 if name in summed else stop - start  # a sum of the range's rows is one row
            if shape[0] != want:
                _fail("row_count", f"tensor {i} has {shape[0]} rows, range [{start}, {stop}) has {stop - start}"
                      + (" (a sum: 1)" if name in summed else ""), req)
        specs.append((DTYPES[dtype_name], tuple(shape)))
    return header, specs, doc_bytes


ROWS_ROLE = "rows"
_CSR_ROLES = ("values", "column indices", "row pointers")


def _tensor_roles(header: Header) -> list[tuple[str, str]]:
    """``(name, role)`` of each tensor frame of a one-tensor-per-name message: ``rows``, or one
    of :data:`_CSR_ROLES` for a name in ``csr``."""
    return [(name, role) for name in header.names
            for role in (_CSR_ROLES if name in header.csr else (ROWS_ROLE,))]


def _check_csr_spec(header: Header, name: str, role: str, dtype_name: str, shape: list, specs: list,
                    req: int | None) -> None:
    """The dtype and shape of one of the three CSR tensors of ``name`` (``specs``: the tensors before it)."""
    want = {"values": ("float32",), "column indices": ("int32", "int64"), "row pointers": ("int64",)}[role]
    if dtype_name not in want or len(shape) != 1:
        _fail("bad_sparse", f"CSR {role} of {name!r} must be 1-D {' or '.join(want)}, got {dtype_name}{shape}", req)
    if role == "column indices" and shape[0] != specs[-1][1][0]:
        _fail("bad_sparse", f"CSR of {name!r} has {specs[-1][1][0]} values but {shape[0]} column indices", req)
    if role == "row pointers":
        start, stop = header.rows
        if shape[0] != stop - start + 1:
            _fail("bad_sparse", f"CSR row pointers of {name!r} must have {stop - start + 1} entries (rows "
                                f"[{start}, {stop}) + 1), got {shape[0]}", req)


def _check_csr_arrays(header: Header, tensors: Sequence[np.ndarray]) -> None:
    """Every CSR payload's contents: row pointers rising from 0 to nnz, columns in ``[0, F)``
    and strictly ascending within each row (no duplicate entries)."""
    if not header.csr:
        return
    arrays = {(name, role): a for (name, role), a in zip(_tensor_roles(header), tensors)}
    for name, width in header.csr.items():
        values, columns, pointers = (arrays[(name, role)] for role in _CSR_ROLES)
        steps = np.diff(pointers)
        if pointers[0] != 0 or pointers[-1] != values.shape[0] or (steps < 0).any():
            _fail("bad_sparse", f"CSR row pointers of {name!r} must rise from 0 to nnz = {values.shape[0]}",
                  header.req)
        if columns.size and (columns.min() < 0 or columns.max() >= width):
            _fail("bad_sparse", f"CSR column indices of {name!r} must be in [0, {width})", header.req)
        descents = np.flatnonzero(np.diff(columns.astype(np.int64)) <= 0) + 1
        if not np.isin(descents, pointers[1:-1]).all():
            _fail("bad_sparse", f"CSR column indices of {name!r} must ascend strictly within each row", header.req)


def _wire_dict(header: Header, tensors: Sequence[np.ndarray]) -> dict[str, Any]:
    if not isinstance(header.op, str) or header.op not in Op.__members__:
        raise ProtocolError("unknown_op", f"unknown operation {header.op!r:.40}")
    d: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": Op(header.op).value}
    for name in _FIELDS:
        value = getattr(header, name)
        if name in ("op", "doc") or value is None:  # doc: its length is set by encode, beside its frame
            continue
        if name in _INT_FIELDS or name in ("req", "attempt"):
            value = operator.index(value)  # numpy integers are fine; floats are not
        elif name == "rows":
            value = [operator.index(v) for v in value]
        elif name == "names":
            value = list(value)
        elif name == "csr":
            value = {k: operator.index(v) for k, v in value.items()}
        if name not in ("req", "attempt", "names", "meta", "csr") or value:  # defaults stay off the wire
            d[name] = value
    if tensors:
        d["t"] = [[_dtype_name(a.dtype), list(a.shape)] for a in tensors]
    return d


def _dtype_name(dtype: np.dtype) -> str:
    for name, wire in DTYPES.items():
        if dtype == wire or (dtype.kind == wire.kind and dtype.itemsize == wire.itemsize):
            return name
    raise ProtocolError("bad_dtype", f"dtype {dtype} not in {sorted(DTYPES)}")


def _json_default(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite constant {name}")


# ----------------------------------------------------------------------------- encode / decode


def encode(header: Header, tensors: Sequence[np.ndarray] = ()) -> list[Any]:
    """Frames ``[header_bytes, buf_0, ..., buf_{n-1}]`` for ``send_multipart(copy=False)``.

    Each ``buf_i`` is the tensor itself when it is C-contiguous little-endian, else a contiguous
    little-endian copy. Raises ProtocolError when the message would not pass :func:`decode`.
    """
    arrays = []
    for a in tensors:
        a = np.asarray(a)
        wire = DTYPES.get(_dtype_name(a.dtype))
        if a.dtype != wire or not a.flags.c_contiguous:
            a = np.ascontiguousarray(a, dtype=wire)
        arrays.append(a)
    doc = encode_doc(header.doc) if header.doc is not None else None
    try:
        d = _wire_dict(header, arrays)
        if doc is not None:
            d["doc"] = len(doc)
        raw = json.dumps(d, separators=(",", ":"), allow_nan=False, default=_json_default).encode()
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", f"header not encodable: {exc}", req=None) from None
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"header is {len(raw)} bytes (limit {MAX_HEADER_BYTES})")
    # The same checks the receiver runs: a bad message fails at the sender, not across the wire.
    _header_from_wire(json.loads(raw))
    _check_csr_arrays(header, arrays)
    frames: list[Any] = [raw]
    for a in arrays:
        if a.dtype == np.bool_ and a.size and a.view(np.uint8).max() > 1:
            raise ProtocolError("bad_bool", "bool tensor holds bytes other than 0 and 1")
        frames.append(a.reshape(-1).view(np.uint8))  # a flat byte buffer is what every zmq version takes
    if doc is not None:
        frames.append(doc)
    return frames


def encode_doc(doc: Any) -> bytes:
    """The document frame of ``doc``: compact JSON; ``bad_doc`` when it is not finite JSON or
    above :data:`MAX_DOC_BYTES`."""
    try:
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False, default=_json_default).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError("bad_doc", f"document not encodable as finite JSON: {str(exc)[:80]}") from None
    if len(raw) > MAX_DOC_BYTES:
        raise ProtocolError("bad_doc", f"document is {len(raw)} bytes (limit {MAX_DOC_BYTES}); send it in parts "
                                       "(protocol.take_fitting)")
    return raw


def take_fitting(items: Sequence[Any], limit: int = MAX_DOC_BYTES) -> int:
    """How many of ``items``, from the first, fit in one document (a JSON list) of at most
    ``limit`` bytes; at least 1 when there is any (a single item above the limit is the
    caller's to refuse: :func:`encode_doc` will)."""
    size, count = 2, 0  # the brackets
    for item in items:
        size += len(encode_doc(item)) + (1 if count else 0)
        if count and size > limit:
            break
        count += 1
    return count


def _frame_buffer(frame: Any) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def decode(frames: Sequence[Any], bounds: Bounds | None = None, *,
           check_finite: bool = False) -> tuple[Header, list[np.ndarray]]:
    """``(header, tensors)`` from received frames (``zmq.Frame``, bytes or any buffer).

    Tensors are read-only views over the frames (no copy). ``bounds`` rejects rows and ids the
    receiver does not own; ``check_finite`` rejects NaN/inf in float tensors.
    """
    if len(frames) == 0:
        raise ProtocolError("empty", "message has no frames")
    head = _frame_buffer(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"header is {head.nbytes} bytes (limit {MAX_HEADER_BYTES})")
    try:
        d = json.loads(bytes(head).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError("bad_header", f"header is not UTF-8 JSON ({str(exc)[:80]})") from None
    if not isinstance(d, dict):
        raise ProtocolError("bad_header", f"header is a JSON {type(d).__name__}, not an object")
    header, specs, doc_bytes = _header_from_wire(d)
    req = header.req
    expected_frames = len(specs) + (1 if doc_bytes else 0)
    if len(frames) - 1 != expected_frames:
        raise ProtocolError("frame_count", f"header lists {len(specs)} tensor(s)"
                            + (" and a document" if doc_bytes else "") + f", message has {len(frames) - 1} frame(s) "
                            f"after the header", req=req)
    if doc_bytes:
        header = dataclasses.replace(header, doc=_decode_doc(frames[-1], doc_bytes, req))
    if bounds is not None:
        bounds.check(header)

    tensors = []
    for i, ((dtype, shape), frame) in enumerate(zip(specs, frames[1:])):
        buf = _frame_buffer(frame)
        count = math.prod(shape)
        if buf.nbytes != count * dtype.itemsize:
            raise ProtocolError("frame_length",
                                f"tensor {i} {dtype.name}{list(shape)} needs {count * dtype.itemsize} bytes, frame has {buf.nbytes}",
                                req=req)
        arr = np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
        arr.flags.writeable = False
        if dtype == np.bool_ and count and arr.view(np.uint8).max() > 1:
            raise ProtocolError("bad_bool", f"tensor {i} is bool but holds bytes other than 0 and 1", req=req)
        if check_finite and dtype.kind == "f" and not np.isfinite(arr).all():
            raise ProtocolError("not_finite", f"tensor {i} ({_name_of(header, i)}) has NaN or inf", req=req)
        tensors.append(arr)
    _check_csr_arrays(header, tensors)
    return header, tensors


def _decode_doc(frame: Any, length: int, req: int) -> Any:
    buf = _frame_buffer(frame)
    if buf.nbytes != length:
        raise ProtocolError("bad_doc", f"document frame has {buf.nbytes} bytes, the header says {length}", req=req)
    try:
        return json.loads(bytes(buf).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError("bad_doc", f"document is not finite UTF-8 JSON ({str(exc)[:80]})", req=req) from None


def _name_of(header: Header, i: int) -> str:
    return header.names[i] if i < len(header.names) else f"#{i}"


# ----------------------------------------------------------------------------- sockets


def send(socket: zmq.Socket, header: Header, tensors: Sequence[np.ndarray] = (), *,
         copy: bool = False, track: bool = False) -> zmq.MessageTracker | None:
    """Send one message. With ``track=True`` returns a tracker: wait on it before reusing arrays."""
    return socket.send_multipart(encode(header, tensors), copy=copy, track=track)


def recv(socket: zmq.Socket, bounds: Bounds | None = None, *, timeout: float | None = None,
         check_finite: bool = False, copy: bool = False) -> tuple[Header, list[np.ndarray]]:
    """Receive and validate one message; ``TimeoutError`` when none arrives within ``timeout`` s."""
    _wait(socket, timeout)
    return decode(socket.recv_multipart(copy=copy), bounds, check_finite=check_finite)


def send_routed(socket: zmq.Socket, identity: bytes, header: Header, tensors: Sequence[np.ndarray] = (), *,
                copy: bool = False, track: bool = False) -> zmq.MessageTracker | None:
    """Send through a ROUTER socket to the DEALER peer ``identity``."""
    return socket.send_multipart([identity, *encode(header, tensors)], copy=copy, track=track)


def recv_routed(socket: zmq.Socket, bounds: Bounds | None = None, *, timeout: float | None = None,
                check_finite: bool = False, copy: bool = False) -> tuple[bytes, Header, list[np.ndarray]]:
    """``(identity, header, tensors)`` from a ROUTER socket whose peers are DEALER sockets.

    A ProtocolError raised here carries ``identity`` so that the server can send the ERROR reply.
    """
    _wait(socket, timeout)
    frames = socket.recv_multipart(copy=copy)
    identity = bytes(_frame_buffer(frames[0]))
    try:
        header, tensors = decode(frames[1:], bounds, check_finite=check_finite)
    except ProtocolError as exc:
        exc.identity = identity
        raise
    return identity, header, tensors


def _wait(socket: zmq.Socket, timeout: float | None) -> None:
    if timeout is not None and not socket.poll(int(timeout * 1000), zmq.POLLIN):
        raise TimeoutError(f"no message within {timeout} s")


# ----------------------------------------------------------------------------- server helpers


_REPLY_FIELDS = ("req", "epoch", "layer", "interval", "part", "rows", "version", "attempt", "task", "names")


def reply_to(request: Header, op: Op, **fields: Any) -> Header:
    """A reply header for ``request``: same request id and task identity, overridden by ``fields``."""
    kw = {name: getattr(request, name) for name in _REPLY_FIELDS}
    kw.update(fields)
    return Header(op=op, **kw)


class CsrRows(NamedTuple):
    """A name's rows carried as CSR in a ROWS message (see "Sparse rows"): ``indptr`` has one
    entry per row plus one, ``width`` is the column count."""

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    width: int


def rows_reply(request: Header, rows: Sequence[Any]) -> tuple[Header, list[np.ndarray]]:
    """The ROWS reply to a PULL and its tensors, one row block per name of ``request``: a dense
    block is one tensor; a sparse one (any object with CSR arrays ``data``, ``indices``,
    ``indptr`` and a ``shape``, such as ``dorylus.models.sparse.SparseRows``) is three, and
    its name is entered in the header's ``csr``."""
    csr: dict[str, int] = {}
    tensors: list[np.ndarray] = []
    for name, block in zip(request.names, rows):
        if hasattr(block, "indptr"):
            csr[name] = int(block.shape[1])
            tensors += [block.data, block.indices, block.indptr]
        else:
            tensors.append(block)
    sums = {"sums": request.meta["sums"]} if request.meta.get("sums") else {}
    return reply_to(request, Op.ROWS, csr=csr, meta=sums), tensors


def summed_names(header: Header) -> list[str]:
    """The names whose rows a PULL asks for, or a ROWS carries, as their sum (``meta["sums"]``,
    comma-separated; see "Messages"). A ``sums`` that is not a string is refused as ``bad_field``."""
    sums = header.meta.get("sums", "")
    if not isinstance(sums, str):
        raise ProtocolError("bad_field", f"meta sums must be comma-separated names, got {sums!r:.40}", req=header.req)
    return sums.split(",") if sums else []


def named_rows(header: Header, tensors: Sequence[np.ndarray]) -> list[np.ndarray | CsrRows]:
    """One entry per name of a decoded ROWS message: its tensor, or :class:`CsrRows` for a name in ``csr``."""
    out: list[np.ndarray | CsrRows] = []
    position = 0
    for name in header.names:
        if name in header.csr:
            out.append(CsrRows(*tensors[position:position + 3], width=header.csr[name]))
            position += 3
        else:
            out.append(tensors[position])
            position += 1
    return out


def error_reply(request: Header | None, exc: BaseException) -> Header:
    """The ERROR header answering ``request`` (or, if it was unreadable, the id in ``exc``)."""
    if isinstance(exc, ProtocolError):
        code, message, req = exc.code, exc.message, exc.req
    else:  # the server's own failure on a valid request: report it without leaking a traceback
        code, message, req = "internal", f"{type(exc).__name__}: {exc}", None
    if request is not None:
        req = request.req
    return Header(op=Op.ERROR, req=req or 0, code=code, message=message[:MAX_MESSAGE_CHARS])


class ProtocolCounters:
    """Counts of rejected messages by error code, for messages dropped without a reply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, exc: ProtocolError) -> None:
        with self._lock:
            self._counts[exc.code] += 1

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        """``{code: count}``, e.g. for a STATS reply's ``meta``."""
        with self._lock:
            return dict(self._counts)


def check_epoch(header: Header, current: int, staleness: int) -> None:
    """Raise ``epoch_ahead`` if ``header.epoch`` is beyond ``current + staleness + 1``: no
    scheduler whose oldest unfinished epoch is ``current`` can have produced it yet."""
    limit = current + staleness + 1
    if header.epoch is not None and header.epoch > limit:
        raise ProtocolError("epoch_ahead", f"epoch {header.epoch} is beyond {limit}, the newest this server accepts "
                            f"now (current epoch {current} + staleness {staleness} + 1)", req=header.req)


def write_rows(dest: np.ndarray, header: Header, rows: np.ndarray) -> None:
    """``dest[start:stop] = rows`` for ``header.rows = (start, stop)``, after checking that the
    range fits ``dest`` and that ``rows`` has ``stop - start`` rows of ``dest``'s dtype and row shape.
    """
    start, stop = validate_rows(header, dest.shape[0])
    if rows.dtype != dest.dtype:
        raise ProtocolError("dest_mismatch", f"rows are {rows.dtype}, destination is {dest.dtype}", req=header.req)
    if rows.shape[1:] != dest.shape[1:] or rows.ndim != dest.ndim:
        raise ProtocolError("dest_mismatch",
                            f"row shape {rows.shape[1:]} differs from destination's {dest.shape[1:]}", req=header.req)
    if rows.shape[0] != stop - start:
        raise ProtocolError("row_count", f"{rows.shape[0]} rows for range [{start}, {stop})", req=header.req)
    dest[start:stop] = rows
