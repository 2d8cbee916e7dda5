"""Choosing configurations to predict: at scale on AWS, and on this machine.

At scale (:func:`plan_scale`), for each workload of :data:`dorylus.plan.catalog.WORKLOADS`, every
registered backend with graph servers (:data:`graphserver.backends.BACKENDS`), each on its
``scale_instance`` unless ``ScaleOptions.servers`` names another:

* (a) ``lambda``: CPU graph servers with Lambda functions for the tensor work;
* (b) ``cpu``: the same graph servers doing the tensor work themselves;
* (c) ``gpu``: GPU instances, one graph server per GPU.

Graph servers: the fewest whose largest partition fits in ``memory_fraction`` of a server's
memory (of a GPU's, for a backend on a GPU), ghost rows included
(:func:`dorylus.plan.model.server_memory_bytes`). Intervals: the backend's ``scale_intervals``
(``cpu`` one per vCPU; ``gpu`` one); for a backend that calls functions (``lambda``) the count
(a power of two up to the account's concurrency over the servers) and the function's memory
(:data:`LAMBDA_MEMORY_MB`, unless given) of highest predicted value among those whose calls fit
in the function's memory, every call of a stage at once.

On this machine (:func:`plan_local`): the setup ``dorylus train`` would run with the same
options, priced as that run is priced (:meth:`dorylus.cost.Pricing.of_run`).

On spot (:func:`spot_estimate`, ``dorylus plan --spot``): any prediction again with its graph
servers on spot instances at a family's typical saving (:data:`dorylus.plan.catalog.SPOT_DISCOUNTS`)
and the expected cost of their interruptions. The parameter server stays on-demand (it hosts the
coordinator, as in terraform/). With ``N`` graph-server instances each interrupted ``r`` times
an hour, a checkpoint every ``K`` epochs of ``T`` seconds and ``R`` seconds to recover (a
replacement's boot, the coordinator's restart from the checkpoint), an epoch meets
``k = N r T / 3600`` interruptions on average, and each costs the whole cluster the work since
the last checkpoint, on average half an interval, ``K T / 2``, plus ``R``::

    epoch_s   = T + k (K T / 2 + R)
    functions = functions(T) * (1 + k K / 2)           (redone epochs call them again)
    servers   = graph_servers(T) * (1 - saving) * epoch_s / T + param_server(T) * epoch_s / T

First order in ``k``: interruptions during the lost work itself are not counted again, which is
close when ``N r (K T / 2 + R) / 3600`` is small (a note says when it is not).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dorylus.config import TrainConfig
from dorylus.cost import DEFAULT_PRICES
from dorylus.errors import ConfigError
from dorylus.plan import environment
from dorylus.plan.calibration import Calibration
from dorylus.plan.catalog import GIB, LAMBDA, WORKLOADS, Workload, instance, spot_discount
from dorylus.models import MODELS
from dorylus.plan.model import Prediction, Setup, Shape, best, even_shape, model_plan, predict, \
    row_bytes, server_memory_bytes
from graphserver.backends import BACKENDS, backend_class

MAX_PARTS = 4096
def predicted_backends() -> list[str]:
    """The backends the planner predicts: every registered backend with graph servers, in the
    registry's order."""
    return [name for name in BACKENDS if backend_class(name).graph_servers]


def local_default_backends() -> list[str]:
    """What a local prediction predicts when no ``--backend`` is named: the predicted backends
    whose tensor work runs on CPU cores, as every calibration has this machine's CPU rates (a
    GPU's only when it was taken on one). The paper's comparison: functions or not, on the same
    graph servers."""
    return [name for name in predicted_backends() if backend_class(name).device == "cpu"]


def and_list(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, (", ".join(words[:-1]), *words[-1:])))


LAMBDA_MEMORY_MB = (512, 1024, 1769, 3008)  # function sizes the planner tries: a third of a vCPU to 1.7 vCPUs
LAMBDA_RUNTIME_MB = 100  # the Python runtime, numpy and pyzmq inside a function


@dataclass(frozen=True)
class ScaleOptions:
    """What the scale table assumes (each a ``dorylus plan`` option)."""

    hidden: int = 128
    layers: int = 2
    cut_fraction: float = 0.5
    lambda_memory_mb: int | None = None  # None: the best of LAMBDA_MEMORY_MB
    servers: tuple[tuple[str, str], ...] = ()  # (backend, graph-server instance); else its scale_instance
    param_server: str = "c5.xlarge"
    mode: str = "pipe"
    evaluate: bool = False
    memory_fraction: float = 0.8
    static_cached: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"plan: memory_fraction must be in (0, 1], got {self.memory_fraction}")
        unknown = [name for name, _ in self.servers if name not in BACKENDS]
        if unknown:
            raise ConfigError(f"plan: no backend {unknown[0]!r} to give a graph-server instance; known: "
                              f"{', '.join(BACKENDS)}")

    def server(self, backend: str) -> str:
        """The graph-server instance of ``backend``'s configuration."""
        return dict(self.servers).get(backend) or backend_class(backend).scale_instance


def fit_parts(workload: Workload, setup: Setup, capacity_bytes: float, cut_fraction: float) -> Shape:
    """The shape with the fewest partitions whose largest fits in ``capacity_bytes``."""
    for parts in range(1, MAX_PARTS + 1):
        shape = even_shape(workload.vertices, workload.edges, workload.features, workload.classes, parts,
                           cut_fraction)
        if server_memory_bytes(shape, replace(setup, parts=parts)) <= capacity_bytes:
            return shape
    raise ConfigError(f"plan: {workload.name} does not fit in {MAX_PARTS} graph servers of "
                      f"{capacity_bytes / GIB:.1f} GiB each")


def call_fits(shape: Shape, setup: Setup, memory_fraction: float) -> bool:
    """Whether every function call's rows (its inputs and outputs, and as much again for
    temporaries) fit in the function's memory beside the runtime."""
    _, plan = model_plan(shape, setup)
    rows = shape.owned / setup.intervals
    widest = max(sum(row_bytes(name, plan.widths, shape.features) for name in (*s.reads, *s.writes))
                 for s in plan.train if s.kind == "function")
    need = 2 * rows * widest
    return need <= (memory_fraction * setup.lambda_memory_mb - LAMBDA_RUNTIME_MB) * 2 ** 20


def plan_workload(workload: Workload, calibration: Calibration, options: ScaleOptions) -> list[Prediction]:
    """A prediction of every backend with graph servers for ``workload`` (see the module docstring)."""
    o = options
    common = dict(hidden=o.hidden, layers=o.layers, param_server=o.param_server, mode=o.mode, evaluate=o.evaluate,
                  static_cached=o.static_cached)
    predictions = []
    for backend in predicted_backends():
        runs, server_type = backend_class(backend), o.server(backend)
        on_gpu = runs.device == "gpu"
        machine = instance(server_type, gpu=on_gpu)
        per_instance = machine.gpus if on_gpu else 1
        capacity = o.memory_fraction * GIB * (environment.GPUS[machine.gpu].memory_gib if on_gpu else
                                              machine.memory_gib)
        intervals = runs.scale_intervals(machine)
        setup = Setup(backend=backend, graph_server=server_type, parts=1, intervals=intervals, functions=intervals,
                      lambda_memory_mb=o.lambda_memory_mb or LAMBDA_MEMORY_MB[-1],
                      graph_servers_per_instance=per_instance, **common)
        shape = fit_parts(workload, setup, capacity, o.cut_fraction)
        setup = replace(setup, parts=shape.parts)
        if runs.calls_functions:
            limit = max(1, LAMBDA.account_concurrency // shape.parts)
            counts = [2 ** k for k in range(int(math.log2(limit)) + 1)]
            sizes = (o.lambda_memory_mb,) if o.lambda_memory_mb else LAMBDA_MEMORY_MB
            fitting = [replace(setup, intervals=i, functions=i, lambda_memory_mb=mb) for mb in sizes for i in counts
                       if call_fits(shape, replace(setup, intervals=i, lambda_memory_mb=mb), o.memory_fraction)]
            if not fitting:
                raise ConfigError(f"plan: {workload.name}'s function calls do not fit in {max(sizes)} MB even as "
                                  f"{limit} intervals per graph server")
            prediction = best(predict(shape, s, environment.aws(calibration, s)) for s in fitting)
        else:
            prediction = predict(shape, setup, environment.aws(calibration, setup))
        prediction.notes.append(f"{workload.name}: {workload.source}")
        predictions.append(prediction)
    return predictions


def plan_scale(calibration: Calibration, options: ScaleOptions = ScaleOptions(),
               workloads: list[str] | None = None) -> list[Prediction]:
    names = workloads or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ConfigError(f"plan: unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    return [p for name in names for p in plan_workload(WORKLOADS[name], calibration, options)]


# --------------------------------------------------------------------------- this machine


@dataclass(frozen=True)
class LocalOptions:
    """A local run's options, with ``dorylus train``'s defaults."""

    backend: str = TrainConfig.backend
    parts: int | None = None
    intervals: int = 2
    functions: int | None = None  # default: intervals (the autotuner starts at min(intervals, 4))
    hidden: int = 16
    layers: int = 2
    lambda_memory_mb: int = 1024
    graph_server_instance: str | None = None
    param_server_instance: str = "c5.xlarge"
    mode: str = "sync"
    evaluate: bool = True
    cut_fraction: float = 0.5
    static_cached: float = 0.0
    model: str = TrainConfig.model
    heads: int = TrainConfig.heads
    out_heads: int = TrainConfig.out_heads
    attention_dropout: float = TrainConfig.attention_dropout
    server_stage_ops: int = TrainConfig.server_stage_ops


def local_shape(dataset: str | None, partitions: str | None, parts: int | None, cut_fraction: float) -> Shape:
    """The graph of a preset or dataset file (partitioned evenly into ``parts``, 2 by default),
    or of a partition store (its real partitions)."""
    if partitions is not None:
        from dorylus.partition import open_store

        store = open_store(partitions, verify=False)
        if parts not in (None, store.num_parts):
            raise ConfigError(f"plan: --parts {parts} disagrees with the partition store {partitions}, which has "
                              f"{store.num_parts} parts")
        from dorylus.plan.model import store_shape

        return store_shape(store)
    if dataset is None:
        raise ConfigError("plan: name a --dataset or --partitions to predict a local run")
    from dorylus.data.synthetic import PRESETS

    if dataset in PRESETS:
        spec = PRESETS[dataset]
        sizes = (spec.num_nodes, spec.num_edges, spec.num_features, spec.num_classes)
    else:
        from dorylus.data.loaders import load_dataset

        data = load_dataset(dataset)
        edges = data.num_edges if data.directed else 2 * data.num_edges  # symmetrized, as training does
        sizes = (data.num_nodes, edges, data.num_features, data.num_classes)
    return even_shape(*sizes, parts=parts or 2, cut_fraction=cut_fraction)


def plan_local(calibration: Calibration, shape: Shape, options: LocalOptions) -> Prediction:
    o = options
    setup = Setup(backend=o.backend, graph_server=o.graph_server_instance or backend_class(o.backend).graph_server_instance,
                  parts=shape.parts, intervals=o.intervals, functions=min(o.functions or o.intervals, o.intervals),
                  hidden=o.hidden, layers=o.layers, lambda_memory_mb=o.lambda_memory_mb,
                  param_server=o.param_server_instance, mode=o.mode, evaluate=o.evaluate,
                  static_cached=o.static_cached, model=o.model, heads=o.heads, out_heads=o.out_heads,
                  attention_dropout=o.attention_dropout, server_stage_ops=o.server_stage_ops)
    for name in (setup.graph_server, setup.param_server):
        if name not in DEFAULT_PRICES.ec2_hour_usd:
            raise ConfigError(f"plan: instance type {name!r} is not in the price table")
    return predict(shape, setup, environment.local(calibration, setup))


def measured_epoch_s(run_dir: str | Path, evaluated: bool, skip: int = 1) -> tuple[float, int]:
    """The median ``epoch_s`` of a run's epochs after the first ``skip`` (start-up: cold caches,
    first calls) that ran the evaluation pass (``evaluated``) or did not, and how many epochs
    that is (all epochs of that kind when none is left after ``skip``)."""
    from dorylus.report import load_run

    history = [m for m in load_run(run_dir).metrics if (m.get("test_acc") is not None) == evaluated]
    if not history:
        raise ConfigError(f"plan: {run_dir} has no epoch {'with' if evaluated else 'without'} an evaluation pass "
                          f"to compare with")
    timed = [m["epoch_s"] for m in history[skip:]] or [m["epoch_s"] for m in history]
    return statistics.median(timed), len(timed)


def run_options(run_dir: str | Path) -> tuple[LocalOptions, Shape]:
    """The :class:`LocalOptions` and shape of an existing run directory (its config.json and
    partition store), to predict the same run."""
    from dorylus.report import load_run

    run = load_run(run_dir)
    c = run.config
    if c.get("backend") not in predicted_backends():
        raise ConfigError(f"plan: {run_dir} ran backend {c.get('backend')!r}; the planner predicts "
                          f"{and_list(predicted_backends())} runs")
    if c.get("model", "gcn") not in MODELS:
        raise ConfigError(f"plan: {run_dir} trained {c.get('model')!r}; the planner models "
                          f"{', '.join(MODELS)}")
    store = c.get("partitions") or str(Path(run_dir) / "partitions")
    options = LocalOptions(backend=c["backend"], intervals=c["intervals"], functions=c.get("functions"),
                           hidden=c["hidden"], layers=c["layers"], lambda_memory_mb=c["lambda_memory_mb"],
                           graph_server_instance=c.get("graph_server_instance"),
                           param_server_instance=c["param_server_instance"],
                           mode="sync" if c.get("mode", "sync") == "sync" else "pipe",
                           evaluate=c.get("eval_every", 1) == 1, model=c.get("model", TrainConfig.model),
                           heads=c.get("heads", TrainConfig.heads), out_heads=c.get("out_heads", TrainConfig.out_heads),
                           attention_dropout=c.get("attention_dropout", TrainConfig.attention_dropout),
                           # a run from before the option invoked every stage with more than element-wise work
                           server_stage_ops=c.get("server_stage_ops", 0))
    return options, local_shape(None, store, None, options.cut_fraction)


# --------------------------------------------------------------------------- spot


@dataclass(frozen=True)
class SpotOptions:
    """What an estimate on spot assumes (``dorylus plan --spot`` options)."""

    # An assumption, not a measurement: about one interruption per instance in 20 hours. The
    # spot-events log group of a spot cluster (terraform/interruptions.tf) gives a real rate.
    interruptions_per_hour: float = 0.05  # per graph-server instance
    checkpoint_every: int = TrainConfig.checkpoint_every  # epochs
    # A replacement instance's boot and install (user data: torch and the project) and the
    # coordinator's restart from the checkpoint: minutes on AWS.
    recovery_s: float = 300.0
    saving: float | None = None  # None: the instance family's typical saving (catalog.SPOT_DISCOUNTS)

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.interruptions_per_hour) and 0 <= self.interruptions_per_hour <= 60,
             f"--spot-interruptions-per-hour must be from 0 to 60 per instance, got {self.interruptions_per_hour}"),
            (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 1,
             f"--checkpoint-every must be a whole number of epochs >= 1, got {self.checkpoint_every}"),
            (math.isfinite(self.recovery_s) and 0 <= self.recovery_s <= 86400,
             f"--recovery-s must be from 0 to 86400 seconds, got {self.recovery_s}"),
            (self.saving is None or (math.isfinite(self.saving) and 0 <= self.saving < 1),
             f"--spot-saving must be a fraction in [0, 1), got {self.saving}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"plan: {message}")


@dataclass(frozen=True)
class SpotEstimate:
    """A :class:`Prediction` again on spot graph servers (see the module docstring)."""

    saving: float
    saving_source: str
    interruptions_per_epoch: float
    lost_s_per_interruption: float
    epoch_s: float
    cost_by_component_usd: dict[str, float]
    cost_usd: float
    value: float
    on_demand_value: float
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def spot_estimate(prediction: Prediction, options: SpotOptions) -> SpotEstimate:
    """``prediction`` with its graph servers on spot and the expected cost of interruptions."""
    from dorylus.cost import value

    p, o = prediction, options
    if o.saving is not None:
        saving, source = o.saving, "--spot-saving"
    else:
        found = spot_discount(p.setup.graph_server)
        saving, source = found.saving, f"{found.family}: {found.source}, {found.as_of}"
    T, K = p.epoch_s, o.checkpoint_every
    per_epoch = p.setup.instances * o.interruptions_per_hour * T / 3600
    lost = K * T / 2 + o.recovery_s
    epoch_s = T + per_epoch * lost
    c = p.cost_by_component_usd
    components = {
        "functions": c["functions"] * (1 + per_epoch * K / 2),
        "graph_servers": c["graph_servers"] * (1 - saving) * epoch_s / T,
        "param_server": c["param_server"] * epoch_s / T,
    }
    cost = sum(components.values())
    notes = []
    risk = p.setup.instances * o.interruptions_per_hour * lost / 3600
    if risk > 0.1:
        notes.append(f"{risk:.2f} interruptions are expected within the work one interruption loses: the estimate "
                     f"(first order) is optimistic; checkpoint more often")
    return SpotEstimate(saving=saving, saving_source=source, interruptions_per_epoch=per_epoch,
                        lost_s_per_interruption=lost, epoch_s=epoch_s, cost_by_component_usd=components,
                        cost_usd=cost, value=value(epoch_s, cost), on_demand_value=p.value, notes=notes)


def to_json(predictions: list[Prediction], calibration: Calibration,
            spot: list[SpotEstimate] | None = None) -> str:
    out: dict[str, Any] = {"calibration": calibration.to_dict(), "predictions": [p.to_dict() for p in predictions]}
    if spot is not None:
        out["spot"] = [e.to_dict() for e in spot]  # one per prediction, in the same order
    return json.dumps(out, indent=2) + "\n"
