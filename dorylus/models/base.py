"""What a model module declares, and what the roles interpret (DESIGN §2).

A model is a :class:`Plan` (the stages of a training pass and of an evaluation pass, and the
row buffers they read and write), its layers' named parameters, and three functions:

* ``compute(task, layer, rows, params, args) -> Result``: the tensor work of a ``FUNCTION`` or
  ``VERTEX`` stage on one interval, in torch-free numpy; ``params`` maps each of the layer's
  parameter names to its array (``None`` for stages without weights);
* ``gather(task, layer, graph, rows, inputs, args) -> list``: a ``GATHER`` stage on the owned
  rows ``rows = (start, stop)``, from the local rows (owned and ghost) of its ``reads``;
* ``gather_backward(task, layer, graph, inputs, args) -> list``: a ``GATHER_BACKWARD`` stage on
  every owned row; ``inputs`` are the owned rows of the gradient ``reads[0]`` and the local rows
  of the rest; each result is ``[local rows, width]``, its ghost rows being contributions to
  rows that peers own.

``graph`` is a :class:`dorylus.models.graph.CsrGraph` (in-edges of the owned rows, columns the
local rows), and ``args`` are the stage's ``args`` plus ``seed``, ``epoch``, ``training`` and
``train_count``. The ``gpu`` backend runs the same stages on a torch device: ``compute(...,
ops=dorylus.models.torch_ops)`` (``compute`` is written once over an ``ops`` module, numpy by
default) and ``gather_torch`` / ``gather_backward_torch``, the graph functions on tensors. The graph server runs the stages; the function (``lambdas.handler``) and the
``cpu`` backend call ``compute``; none of them knows which model it runs. A new model is a new
module in ``dorylus/models/`` registered in :data:`dorylus.models.MODELS`, with
``build_plan(spec)``, ``params(layer)`` (``{name: shape}`` of the layer's parameters, in order,
e.g. ``{"weight": (in, out), "bias": (out,)}``), ``init_params(layer, rng)`` (``{name: float32
array}``), the three functions above, ``gather_torch`` and ``gather_backward_torch``, and
``reference_layer`` (its torch twin for the single-process reference, on a ``{name: tensor}``
of parameters).

Every role names a parameter ``layers.<l>.<name>`` (:func:`param_key`) where it holds more than
one layer's (the parameter server's state, checkpoints, the reference's ``named_parameters``);
a layer's own messages (``PULL_WEIGHTS``, ``PUSH_GRADS``) carry the bare names with ``layer``
in the header. A stage with ``grad`` returns the gradient of every parameter of its layer:
each layer's gradients are pushed by one call per interval.

Stage kinds:

==================  ==============  ===================================================================
kind                runs in         does
==================  ==============  ===================================================================
``FUNCTION``        backend         ``compute`` on one interval's rows of ``reads``; writes ``writes``
``VERTEX``          graph server    the same, for cheap element-wise work
``GATHER``          graph server    ``gather`` on one interval's rows (Scatter first: every buffer in
                                    ``reads`` has ghost rows, filled from the peers)
``GATHER_BACKWARD`` graph server    ``gather_backward`` on the partition, then the backward Scatter:
                                    ghost rows' contributions go to their owners and are summed
==================  ==============  ===================================================================

A ``symmetric`` ``GATHER_BACKWARD`` stage on a part of an undirected graph runs as a ``GATHER``
instead: Scatter of its input (the peers' gradient rows fill its ghost rows), then ``gather`` of
each interval's rows. For an owned row ``v``, ``(M^T g)[v] = sum_u M[u, v] g[u]`` runs over ``v``'s
out-neighbours, which on an undirected graph are its in-neighbours, all in its own row of the
part, with ``M[u, v] = M[v, u]``: so ``M^T g`` on the owned rows is ``M g`` over the local rows. A
pull over every entry replaces a pull over the owned block plus a push to the ghost rows and a
scattered sum of the peers' contributions (on ogbn-products-sized parts, 0.35 s against 0.61 s
per backward Gather on one core), and each interval's next stage starts when its own rows are done.

Buffers named in ``reads``/``writes`` are float32 ``[rows, width]`` matrices of the graph
server; :data:`STATIC` names are the partition's own inputs, which never change, so a warm
function container keeps them between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

FUNCTION, VERTEX, GATHER, GATHER_BACKWARD = "function", "vertex", "gather", "gather_backward"

# How a stage's function gets the weights of its layer (DESIGN §3, weight stashing):
PIN = "pin"        # the newest version, pinned under (part, interval, epoch, layer)
STASH = "stash"    # the version the same key pinned in the forward pass
NEWEST = "newest"  # the newest version, not pinned (evaluation)

# Stages that end in the loss: in an evaluation pass they only count correct predictions.
LOSS_TASKS = ("LOSS", "AV_LOSS")

# Inputs every graph server holds for its owned rows: features, global ids, labels, split codes.
STATIC = ("X", "ids", "labels", "split")


@dataclass(frozen=True)
class Stage:
    kind: str
    task: str                       # the task's name in messages and metrics, e.g. "AV", "GA", "LOSS"
    layer: int
    reads: tuple[str, ...]
    writes: tuple[str, ...] = ()
    weights: str | None = None      # PIN, STASH, NEWEST, or None: the stage uses no weights
    grad: bool = False              # the stage pushes the gradients of its layer's parameters
    args: tuple[tuple[str, Any], ...] = ()  # model-specific, static per stage (dropout, activation, ...)
    # GATHER_BACKWARD only: its matrix is the transpose of one that is symmetric on an undirected
    # graph (A_hat, A + I), so there it is the forward ``gather`` of its one input (see below).
    symmetric: bool = False
    # FUNCTION only: reads that ``compute`` uses only through their sum over the interval's rows
    # (a bias gradient, ``db = sum dY``). A function pulls that one row, ``[1, width]``, instead of
    # the interval's rows; ``compute`` takes either and must give the same result for both.
    summed: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return (self.task, self.layer)

    def pulled_on(self, undirected: bool) -> bool:
        """A ``symmetric`` backward Gather on a part of an undirected graph: it runs as a Gather
        of its one input there (see the module docstring)."""
        return undirected and self.kind == GATHER_BACKWARD and self.symmetric

    @property
    def backward(self) -> bool:
        return self.weights == STASH or self.kind == GATHER_BACKWARD or self.task.endswith("_BWD")


@dataclass(frozen=True)
class Plan:
    """The stages of one pass, in order, and the widths of the buffers they use."""

    train: tuple[Stage, ...]
    evaluate: tuple[Stage, ...]
    widths: dict[str, int] = field(default_factory=dict)  # buffer name -> columns (static names excluded)

    @classmethod
    def of(cls, forward: list[Stage], backward: list[Stage], widths: dict[str, int]) -> "Plan":
        """The training pass is ``forward + backward``; the evaluation pass is the forward one with
        the newest weights unpinned, no gradient, and loss stages that write nothing (their
        accuracy counts are what evaluation wants)."""
        evaluate = tuple(replace(s, weights=NEWEST if s.weights else None, grad=False,
                                 writes=() if s.task in LOSS_TASKS else s.writes) for s in forward)
        return cls(train=tuple(forward + backward), evaluate=evaluate, widths=widths)

    @property
    def ghosted(self) -> frozenset[str]:
        """Buffers Gather reads: they have ghost rows after the owned ones."""
        return frozenset(name for s in (*self.train, *self.evaluate) if s.kind == GATHER for name in s.reads)

    def ghosted_on(self, undirected: bool) -> frozenset[str]:
        """:attr:`ghosted`, and on a part of an undirected graph the inputs of the ``symmetric``
        backward Gathers, which run as Gathers there."""
        return self.ghosted | {s.reads[0] for s in self.train if s.pulled_on(undirected)}

    def ghost_columns(self, training: bool) -> int:
        """Float32 columns one ghost row carries in one pass: every Gather's inputs (Scatter)
        plus every backward Gather's outputs (backward Scatter; one run as a Gather sends its
        input instead, of the same width)."""
        stages = self.train if training else self.evaluate
        return (sum(self.widths[name] for s in stages if s.kind == GATHER for name in s.reads)
                + sum(self.widths[name] for s in stages if s.kind == GATHER_BACKWARD for name in s.writes))

    def function_calls_per_interval(self, training: bool) -> int:
        return sum(s.kind == FUNCTION for s in (self.train if training else self.evaluate))


@dataclass
class Result:
    """What ``compute`` returns: rows for the buffers in ``stage.writes``, the gradients of the
    layer's parameters by name (stages with ``grad``, training only: every parameter of the
    layer) and scalars (loss, accuracy counts)."""

    rows: list[np.ndarray]            # one per name in the stage's ``writes``, in order
    grads: dict[str, np.ndarray] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Work:
    """What a stage computes on some rows, for the planner (:mod:`dorylus.plan.model`): multiply-adds,
    dropout elements, other elements, logits. A model module's ``stage_work(task, args, layer,
    rows, training, prepare) -> Work | None`` gives it per task (``prepare``: the layer input's
    dropout or activation, the planner's), beside its ``compute``."""

    macs: float = 0.0
    dropout: float = 0.0
    elementwise: float = 0.0
    softmax: float = 0.0

    def seconds(self, rates) -> float:
        """At ``rates`` (:class:`dorylus.plan.calibration.Rates`)."""
        return (self.macs / rates.matmul_per_s + self.dropout / rates.dropout_per_s
                + self.elementwise / rates.elementwise_per_s + self.softmax / rates.softmax_per_s)

    def __add__(self, other: "Work") -> "Work":
        return Work(self.macs + other.macs, self.dropout + other.dropout, self.elementwise + other.elementwise,
                    self.softmax + other.softmax)


def param_key(layer: int, name: str) -> str:
    """``layers.<layer>.<name>``: a parameter's name among every layer's (state, checkpoints)."""
    return f"layers.{layer}.{name}"


def split_param_key(key: str) -> tuple[int, str]:
    """``(layer, name)`` of a :func:`param_key`; ``ValueError`` for anything else."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or not parts[2]:
        raise ValueError(f"{key!r} is not a parameter name of the form layers.<layer>.<name>")
    return int(parts[1]), parts[2]


def check_params(params: dict[str, Any] | None, shapes: dict[str, tuple[int | None, ...]], what: str) -> dict[str, Any]:
    """``params`` if it holds exactly the names of ``shapes``, each of that shape (``None``: any
    size in that dimension; numpy arrays or tensors); ``ValueError`` naming the first that does not."""
    if params is None:
        raise ValueError(f"{what}: this stage needs the layer's parameters ({', '.join(shapes)}), got none")
    if not isinstance(params, dict):
        raise ValueError(f"{what}: the layer's parameters must be a name -> array dict, got {type(params).__name__}")
    missing, unknown = [n for n in shapes if n not in params], [n for n in params if n not in shapes]
    if missing or unknown:
        raise ValueError(f"{what}: parameters must be {', '.join(shapes)}; missing {missing}, unknown {unknown}")
    for name, shape in shapes.items():
        got = tuple(params[name].shape)
        if len(got) != len(shape) or any(want is not None and g != want for g, want in zip(got, shape)):
            raise ValueError(f"{what}: parameter {name} has shape {tuple(params[name].shape)}, expected {tuple(shape)}")
    return params
