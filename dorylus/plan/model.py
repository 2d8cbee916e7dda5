"""The epoch model: seconds, dollars and value of one training epoch from calibrated rates.

The epoch is the model's plan itself (``build_plan`` of its module, any of
:data:`dorylus.models.MODELS`, DESIGN §2): the training pass, then (``evaluate``) the
evaluation pass, each a list of stages, each costed by its model's formulas (each model
module's ``stage_work`` and, for edge work of its own, ``gather_seconds``; the table below is
GCN's); the largest partition sets the pace. With ``n`` owned rows, ``m`` A_hat entries, ``g`` ghost rows and ``s``
rows sent to peers per graph server, ``I`` intervals of ``r = n / I`` rows, ``c`` calls at once
per server, and rates (:class:`~dorylus.plan.calibration.Rates`) scaled to where the work runs
(:mod:`dorylus.plan.environment`), each stage takes

==================  ===========================================================================
stage               seconds
==================  ===========================================================================
GATHER (width w)    ``m w / gather(4 w (n + g) h)``, plus the ghost exchange
                    ``4 w max(g, s) / ghost_link + rtt`` when P > 1
GATHER_BACKWARD     ``m w / gather(4 w n h)`` (the transpose reads the owned rows' gradients),
                    plus the ghost exchange (contributions go back)
VERTEX              ``work(n) / server``
FUNCTION, cpu/gpu   ``work(n) / server + waves * k' * rtt`` (``k'``: weights pulled, gradient pushed)
FUNCTION, lambda    ``max(waves * call, I * bytes(r) / server_link)`` with
                    ``call = invoke + call_s + 2 rtt + bytes(r) / call_link + work(r) / function``;
                    a stage the backend runs on its graph servers (``stage_on_server``: element-wise
                    work without a gradient, or at most ``server_stage_ops`` operations without a
                    dropout mask) as cpu's
==================  ===========================================================================

plus ``stage_s``, the runtime's own cost of a stage. ``gather(size)`` is the Gather rate at a
dense operand of that many bytes (sparse products slow down out of the caches); ``h`` is the
number of graph servers sharing a last-level cache (a local cluster's ``P``; one on AWS), whose
operands add up in it. ``work(rows)``
counts multiply-adds (``rows * in * out`` per product: forward, ``dW``, ``dX``), dropout
elements (``rows * in`` where a task regenerates a layer's dropout mask: its forward while
training, and again in its backward), other element-wise work (an activation without dropout)
and logits through softmax cross-entropy, each at its rate. A call waits for ``2 rtt``: its pulls
go out together, then its pushes together. ``bytes(r)`` counts its input and output rows (static
inputs too, but for the ``static_cached`` share of calls whose warm container served the same
interval before: the handler keeps them, yet a call lands on any
idle container, and local runs show few hits) and its weights and gradient; ``waves = ceil(I /
c)``. Gather runs at the
narrow width because the plan does (DESIGN §2).

Ghost rows: a partition of ``n`` of ``V`` vertices with edge-cut fraction ``phi`` (the share of
its in-edges whose source is remote; METIS on social graphs cuts a sizable share, hence a
parameter) holds ``g = R (1 - exp(-phi d n / R))`` ghost rows, with ``R = V - n`` remote
vertices and ``d = E / V`` in-edges per vertex: the expected number of distinct remote sources
when each cut edge picks one of them uniformly at random (an assumption; a partition store
gives the real ``g``).

Modes: every mode of :data:`graphserver.modes.MODES`, priced by what it answers to
``barrier_after_stage()``. With a barrier after every stage (``sync``) the epoch sums the
stages. Without (``pipe``, ``async``) it splits the epoch into segments at the Gathers (where
the intervals meet) and overlaps, inside a segment, the graph servers' time ``G`` with the
functions' ``F`` as a two-stage pipeline of ``I`` intervals, ``max(G, F) + min(G, F) / I``; only
the lambda backend has anything to overlap (cpu and gpu run both on the same device). ``async``
is priced as ``pipe``: what its staleness bound lets run ahead across epochs is not modelled, so
its prediction is an upper bound. Each epoch adds the parameter server's optimizer step
(``ADAM_PASSES`` element-wise passes over the weights), half a coordinator poll and a round trip.

Dollars are :class:`dorylus.cost.Pricing`'s, as on a run: graph-server instances and the
parameter server for the epoch's seconds, and every call's billed duration (``call - invoke``,
rounded up to the millisecond, at least 1 ms) at the function's memory plus the per-request fee.
Value is ``1 / (epoch_s * cost_usd)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from dorylus.config import TrainConfig
from dorylus.cost import DEFAULT_PRICES, Pricing, PriceTable, value
from dorylus.errors import ConfigError
from dorylus.models import MODELS, get_model, stage_cost
from dorylus.models.base import Work
from dorylus.plan.calibration import Rates
from graphserver.backends import BACKENDS, RunBackend, backend_class
from graphserver.modes import MODES as MODE_REGISTRY, get_mode

FLOAT = 4                  # bytes of a float32
ID = 8                     # bytes of an int64 vertex id or label
INDPTR = 8                 # bytes of an int64 row pointer
ADAM_PASSES = 12           # element-wise passes of one Adam step over the weights (moments, update, decay)
# A call waits for two round trips: its pulls (rows, and weights from the parameter server) go
# out together, then its pushes (results, and the gradient) together (lambdas.handler).
CALL_ROUND_TRIPS = 2
STATIC_ROW_BYTES = {"ids": 8, "labels": 8, "split": 1}  # int64, int64, uint8; "X" is features x float32
STATIC_ROWS = frozenset(("X", *STATIC_ROW_BYTES))  # a partition's own inputs (dorylus.models.base.STATIC)
MODES = tuple(MODE_REGISTRY)  # every mode (graphserver.modes), priced by its stage barrier (_segment)


@dataclass(frozen=True)
class Shape:
    """A partitioned graph as the planner sees it: the largest partition's owned rows, A_hat
    entries, ghost rows and rows sent to peers, and the model's sizes."""

    vertices: int
    parts: int
    owned: int
    nnz: int
    ghosts: int
    send: int
    features: int
    classes: int


def ghost_rows(vertices: int, owned: int, cut_in_edges: float) -> float:
    """Expected distinct remote sources among ``cut_in_edges`` edges, each from one of the
    ``vertices - owned`` remote vertices uniformly at random."""
    remote = vertices - owned
    if remote <= 0 or cut_in_edges <= 0:
        return 0.0
    return remote * -math.expm1(-cut_in_edges / remote)


def even_shape(vertices: int, edges: int, features: int, classes: int, parts: int, cut_fraction: float) -> Shape:
    """``parts`` equal partitions of a graph with ``edges`` directed edges, ``cut_fraction`` of
    every partition's in-edges from remote vertices (see the module docstring)."""
    if not 0.0 <= cut_fraction <= 1.0:
        raise ConfigError(f"plan: the edge-cut fraction must be in [0, 1], got {cut_fraction}")
    if parts < 1:
        raise ConfigError(f"plan: parts must be >= 1, got {parts}")
    owned = math.ceil(vertices / parts)
    nnz = math.ceil((edges + vertices) / parts)
    ghosts = 0 if parts == 1 else round(ghost_rows(vertices, owned, cut_fraction * edges / parts))
    return Shape(vertices=vertices, parts=parts, owned=owned, nnz=nnz, ghosts=ghosts, send=ghosts,
                 features=features, classes=classes)


def store_shape(store) -> Shape:
    """The shape of an opened :class:`~dorylus.partition.PartitionStore`: each figure the
    largest over its partitions."""
    from dorylus.partition import partition_stats

    parts = partition_stats(store)["parts"]
    meta = store.meta
    return Shape(vertices=meta.num_nodes, parts=store.num_parts, owned=max(p["owned"] for p in parts),
                 nnz=max(p["nnz"] for p in parts), ghosts=max(p["ghosts"] for p in parts),
                 send=max(p["send"] for p in parts), features=meta.num_features, classes=meta.num_classes)


@dataclass(frozen=True)
class Setup:
    """A configuration to predict: where the tensor work runs, how many graph servers on which
    instance type, intervals and concurrent calls per server, the model, and the mode."""

    backend: str
    graph_server: str
    parts: int
    intervals: int
    functions: int
    hidden: int
    layers: int = 2
    lambda_memory_mb: int = 1769
    param_server: str = "c5.xlarge"
    mode: str = "sync"
    evaluate: bool = True
    graph_servers_per_instance: int = 1  # GPUs per instance for the gpu backend
    static_cached: float = 0.0  # share of function calls whose warm container holds their static inputs
    server_stage_ops: int = TrainConfig.server_stage_ops  # lambda: stages this small run on the graph server
    model: str = TrainConfig.model
    # None: the model's default (dorylus.config.model_default)
    heads: int | None = None  # gat: heads of every layer but the last
    out_heads: int | None = None  # gat: heads of the last layer
    attention_dropout: float | None = None

    def __post_init__(self) -> None:
        checks = [(self.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}"),
                  (self.backend not in BACKENDS or self.runs.graph_servers,
                   f"the {self.backend} backend has no graph servers to predict"),
                  (self.mode in MODES, f"mode must be one of {', '.join(MODES)}"),
                  (self.parts >= 1 and self.intervals >= 1 and self.functions >= 1 and self.layers >= 1
                   and self.hidden >= 1 and self.graph_servers_per_instance >= 1,
                   "parts, intervals, functions, layers and hidden must be >= 1"),
                  (0.0 <= self.static_cached <= 1.0, "the cached share of static inputs must be in [0, 1]")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"plan: {message}")

    @property
    def runs(self) -> type[RunBackend]:
        """The backend's class: what it costs and where its work runs (its pricing attributes)."""
        return backend_class(self.backend)

    @property
    def instances(self) -> int:
        """Graph-server machines: one per graph server, or one per ``graph_servers_per_instance``."""
        return math.ceil(self.parts / self.graph_servers_per_instance)


@dataclass(frozen=True)
class Environment:
    """Where the roles run, as rates and links.

    ``server``: one graph server's rates (all its cores, or its GPU); ``function``: one function
    call's (lambda backend); ``ghost_link`` between graph servers, ``server_link`` a graph
    server's network for its functions' traffic, ``call_link`` one call's own, all bytes/s;
    ``round_trip_s`` a small request and reply; ``invoke_s`` the Invoke API's latency per call
    (not billed); ``stage_s`` and ``call_s`` the runtime's own cost per stage and per function
    call (:mod:`dorylus.plan.runtime`); ``cache_sharers`` the graph servers whose Gathers share
    one last-level cache (all of a local cluster's: their operands add up there)."""

    server: Rates
    ghost_link: float
    server_link: float
    round_trip_s: float
    function: Rates | None = None
    call_link: float | None = None
    invoke_s: float | None = None
    stage_s: float = 0.0
    call_s: float = 0.0
    cache_sharers: int = 1
    where: str = ""


# --------------------------------------------------------------------------- work of a stage


def task_work(stage, layer, rows: float, training: bool, model: str = "gcn") -> Work:
    """The work of stage ``stage`` (a :class:`dorylus.models.base.Stage`) of ``layer`` (its
    :class:`~dorylus.models.spec.LayerSpec`) of ``model`` on ``rows`` rows: the model module's
    own formula (its ``stage_work``, beside its ``compute``; :func:`dorylus.models.stage_cost`)."""
    if model not in MODELS:
        raise ConfigError(f"plan: no cost formulas for the model {model!r}; known: {', '.join(MODELS)}")
    work = stage_cost(model, stage.task, dict(stage.args), layer, rows, training)
    if work is None:
        raise ConfigError(f"plan: no cost formula for the {model} task {stage.task!r}")
    return work


def gather_seconds(stage, layer, model: str, width: int, shape: "Shape", rates: Rates, training: bool,
                   cache_sharers: int = 1) -> float:
    """One Gather or backward Gather of the largest partition, its kernels alone: by default one
    sparse product at ``width`` (a model whose aggregation is one; forward: ``nnz`` entries over [owned; ghost]
    rows; backward: the transpose, over the owned rows' gradients: a smaller operand, so more of
    it in the caches); a model with edge work of its own prices it with its ``gather_seconds``
    (GAT: a product per head and its edge softmax). The rate is the Gather curve's at the operand
    times ``cache_sharers``: graph servers gathering at once on one machine share its cache."""
    rows = shape.owned + (shape.ghosts if stage.kind == "gather" else 0)

    def rate(row_width: int) -> float:
        return rates.gather_per_s(cache_sharers * FLOAT * row_width * rows)

    own = getattr(get_model(model), "gather_seconds", None)
    if own is None:
        return shape.nnz * width / rate(width)
    return own(stage, layer, shape.nnz, rate, rates, training)


def row_bytes(name: str, widths: dict[str, int], features: int) -> int:
    """Bytes of one row of buffer or static input ``name``."""
    if name == "X":
        return FLOAT * features
    return STATIC_ROW_BYTES[name] if name in STATIC_ROW_BYTES else FLOAT * widths[name]


def call_bytes(stage, weight_size: int, widths: dict[str, int], features: int, rows: float, training: bool,
               static_cached: float = 0.0) -> float:
    """Bytes one function call of ``stage`` on ``rows`` rows moves: its input rows (static ones
    unless cached: a warm function keeps them when it serves the same interval again, which
    happens for a ``static_cached`` share of calls) and output rows, the layer's weights
    (``weight_size`` floats), and its gradient. A ``summed`` read moves one row."""
    moved = sum(row_bytes(name, widths, features) * (1 - static_cached if name in STATIC_ROWS else 1)
                for name in (*stage.reads, *stage.writes) if name not in stage.summed)
    summed = sum(row_bytes(name, widths, features) for name in stage.summed)
    weights = FLOAT * weight_size
    return (rows * moved + summed + (weights if stage.weights else 0)
            + (weights if stage.grad and training else 0))


# --------------------------------------------------------------------------- the epoch


@dataclass
class Prediction:
    """One predicted epoch: seconds per task kind (named as the metrics' ``task_s``), the
    function calls and their billed GB-seconds, dollars by component, and value."""

    setup: Setup
    shape: Shape
    where: str
    epoch_s: float
    task_s: dict[str, float]
    calls: int
    billed_gb_s: float
    cost_by_component_usd: dict[str, float]
    cost_usd: float
    value: float
    memory_gib: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def model_spec(shape: Shape, setup: Setup):
    from dorylus.models.spec import ModelSpec

    config = TrainConfig(model=setup.model, layers=setup.layers, hidden=setup.hidden, heads=setup.heads,
                         out_heads=setup.out_heads, attention_dropout=setup.attention_dropout)
    return ModelSpec.from_config(config, shape.features, shape.classes)


def model_plan(shape: Shape, setup: Setup):
    """The model's spec and plan, the same stages the graph servers run."""
    from dorylus.models import get_model

    spec = model_spec(shape, setup)
    return spec, get_model(setup.model).build_plan(spec)


def server_memory(shape: Shape, setup: Setup) -> dict[str, float]:
    """A graph server's resident bytes per structure, as it holds a format-3 partition
    (:mod:`dorylus.partition.store`, :class:`graphserver.state.PartitionState`; the names are
    :func:`graphserver.state.memory_figures`'): with ``n`` owned rows, ``l = n + g`` local rows,
    ``m`` A_hat entries and ``s`` rows sent to peers,

    ==============  ======================================================================
    indices         ``m`` local column ids (int32 below 2^31 local rows, else int64)
    indptr          the store's ``n + 1`` row pointers and the intervals' own (int64)
    norm            ``(1 + indeg)^-1/2`` of every local row (float32): no per-entry value
    global_ids      int64 per local row, and the store's owned ids (int64 per owned row)
    features        ``n x F`` float32 (dense: at scale the planner does not know the density);
                    none where the backend leaves them in the store (``features_stored``: lambda)
    labels_masks    int64 label, three bool masks and the uint8 split per owned row
    exchange        ghost ids and send lists (int64 per ghost and per sent row)
    buffers         every row buffer of the plan, float32, ghost rows for those Gather reads
                    (and a backward Gather run as one: ``Plan.ghosted_on``)
    ==============  ======================================================================

    A backend on a GPU (the ``gpu`` backend's :class:`graphserver.backends.gpu_device.DeviceState`) holds:
    torch CSR matrices of A_hat and its transpose, each a column id and a float32 value per
    entry and a row pointer of the indices' type per row, the static inputs (features, int64 ids
    and labels, uint8 split) and the row buffers.
    """
    from dorylus.normalize import vertex_dtype

    _, plan = model_plan(shape, setup)
    n, local, m = shape.owned, shape.owned + shape.ghosts, shape.nnz
    ghosted = plan.ghosted_on(undirected=True)  # the datasets' graphs are undirected (symmetrized)
    buffers = FLOAT * sum(width * (local if name in ghosted else n) for name, width in plan.widths.items())
    if setup.runs.device == "gpu":
        forward, backward = vertex_dtype(local).itemsize, vertex_dtype(n).itemsize
        return {"matrix": m * (forward + FLOAT) + forward * (n + 1),
                "transpose": m * (backward + FLOAT) + backward * (local + 1),
                "features": FLOAT * n * shape.features, "static": n * (ID + ID + 1), "buffers": buffers}
    return {
        "indices": m * vertex_dtype(local).itemsize,
        "indptr": INDPTR * ((n + 1) + (n + setup.intervals)),
        "norm": FLOAT * local,
        "global_ids": ID * (local + n),
        "features": 0 if setup.runs.features_stored else FLOAT * n * shape.features,
        "labels_masks": n * (ID + 3 + 1),
        "exchange": ID * (shape.ghosts + shape.send + 2 * (shape.parts + 1)),
        "buffers": buffers,
    }


def server_memory_bytes(shape: Shape, setup: Setup) -> float:
    """A graph server's resident bytes: the sum of :func:`server_memory`."""
    return sum(server_memory(shape, setup).values())


def graph_bytes(shape: Shape, setup: Setup) -> tuple[float, float]:
    """``(bytes per A_hat entry, bytes per owned vertex)`` of the graph structures of
    :func:`server_memory` (all but the features and the row buffers): the structures' bytes
    that grow with the entries, over ``nnz``, and the rest over the owned rows."""
    memory = server_memory(shape, setup)
    structure = sum(v for k, v in memory.items() if k not in ("features", "buffers"))
    per_entry = (sum(server_memory(replace(shape, nnz=shape.nnz + 1), setup).values())
                 - sum(memory.values()))
    return per_entry, (structure - per_entry * shape.nnz) / max(shape.owned, 1)


def predict(shape: Shape, setup: Setup, env: Environment, prices: PriceTable = DEFAULT_PRICES) -> Prediction:
    """Seconds, dollars and value of one epoch of ``setup`` on ``shape`` in ``env``."""
    functions = setup.runs.calls_functions
    if functions and (env.function is None or env.call_link is None or env.invoke_s is None):
        raise ConfigError(f"plan: the {setup.backend} backend needs function rates, a call link and an invoke "
                          f"latency ({env.where or 'environment'} has none)")
    spec, plan = model_plan(shape, setup)
    layers = {layer.index: layer for layer in spec.layers}
    weight_sizes = spec.layer_sizes()
    n, I = shape.owned, setup.intervals
    rows = n / I
    waves = math.ceil(I / min(setup.functions, I))
    task_s: dict[str, float] = {}
    calls, billed_s = 0, 0.0
    epoch_s = 0.0
    passes = [("train", plan.train, True)] + ([("eval", plan.evaluate, False)] if setup.evaluate else [])
    for pass_name, stages, training in passes:
        graph_side = function_side = 0.0  # of the current pipe segment
        for stage in stages:
            layer = layers[stage.layer]
            if stage.kind in ("gather", "gather_backward"):
                width = plan.widths[stage.reads[0]]
                seconds = gather_seconds(stage, layer, setup.model, width, shape, env.server, training,
                                         env.cache_sharers)
                if shape.parts > 1:  # the ghost rows of what Gather reads, or the contributions back
                    exchanged = sum(plan.widths[name] for name in (stage.reads if stage.kind == "gather"
                                                                   else stage.writes))
                    seconds += FLOAT * exchanged * max(shape.ghosts, shape.send) / env.ghost_link + env.round_trip_s
                graph = True
            elif stage.kind == "vertex":
                seconds = task_work(stage, layer, n, training, setup.model).seconds(env.server)
                graph = True
            elif functions and not setup.runs.stage_on_server(
                    work := task_work(stage, layer, rows, training, setup.model), stage.grad and training,
                    setup.server_stage_ops):
                moved = call_bytes(stage, weight_sizes[stage.layer], plan.widths, shape.features, rows, training,
                                   setup.static_cached)
                call = (env.invoke_s + env.call_s + CALL_ROUND_TRIPS * env.round_trip_s
                        + moved / env.call_link + work.seconds(env.function))
                seconds = max(waves * call, I * moved / env.server_link)
                calls += I * shape.parts
                billed_s += I * shape.parts * max(0.001, math.ceil((call - env.invoke_s) * 1000) / 1000)
                graph = False
            else:  # the model's compute in the graph server (cpu, gpu, lambda's small stages); weights and
                # gradient over the network
                messages = (1 if stage.weights else 0) + (1 if stage.grad and training else 0)
                seconds = (task_work(stage, layer, n, training, setup.model).seconds(env.server)
                           + waves * messages * env.round_trip_s)
                graph = True  # the same machine as Gather: nothing to overlap
            seconds += env.stage_s
            key = stage.task.lower() + ("_eval" if pass_name == "eval" else "") + "_s"
            task_s[key] = task_s.get(key, 0.0) + seconds
            if stage.kind in ("gather", "gather_backward"):  # intervals meet: a new segment starts
                epoch_s += _segment(setup, graph_side, function_side)
                graph_side, function_side = seconds, 0.0
            elif graph:
                graph_side += seconds
            else:
                function_side += seconds
        epoch_s += _segment(setup, graph_side, function_side)
    weights = sum(weight_sizes)
    epoch_s += ADAM_PASSES * weights / env.server.elementwise_per_s + env.round_trip_s
    billed_gb_s = billed_s * setup.lambda_memory_mb / 1024
    pricing = Pricing(graph_server_instance=setup.graph_server, graph_servers=setup.instances,
                      param_server_instance=setup.param_server, param_servers=1,
                      lambda_memory_mb=setup.lambda_memory_mb if functions else None, prices=prices)
    components = pricing.epoch_cost(epoch_s, billed_gb_s, calls)
    cost = sum(components.values())
    return Prediction(setup=setup, shape=shape, where=env.where, epoch_s=epoch_s, task_s=task_s, calls=calls,
                      billed_gb_s=billed_gb_s, cost_by_component_usd=components, cost_usd=cost,
                      value=value(epoch_s, cost), memory_gib=server_memory_bytes(shape, setup) / 2 ** 30)


def _segment(setup: Setup, graph_side: float, function_side: float) -> float:
    """A segment's seconds: the sum (a mode with a barrier after every stage: sync), or a
    two-stage pipeline of the intervals (pipe, async)."""
    if get_mode(setup.mode).barrier_after_stage():
        return graph_side + function_side
    return max(graph_side, function_side) + min(graph_side, function_side) / setup.intervals


def best(predictions: Iterable[Prediction]) -> Prediction:
    """The prediction of highest value."""
    return max(predictions, key=lambda p: p.value)


