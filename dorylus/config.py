"""The one typed configuration of a training run.

Values come from three layers, later ones winning: the defaults below, a config file
(``--config run.toml`` or ``.json``; unknown keys are an error), and command-line flags. The
resolved config is saved into the run directory and into every checkpoint and result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dorylus.errors import ConfigError
from dorylus.function import FUNCTION_HANDLER
from dorylus.models import MODELS, get_model
from dorylus.models.sparse import AUTO_MAX_DENSITY, SPARSE_MODES
from graphserver.backends import BACKENDS, backend_class
from graphserver.backends.serverless import MAX_FALLBACK_AFTER, SERVER_STAGE_OPS, WORKER_MB, WORKERS_PER_CPU
from graphserver.modes import MODES, mode_class

# dorylus.partition.placement.CHOICES (a test holds them equal; importing it here would load the store)
PARTITION_METHODS = ("auto", "metis", "random", "contiguous", "ldg", "fennel")

# Intervals per graph server: each is a function call per stage, a thread and a slot in the
# scheduler; beyond this the calls cost more invokes than any overlap repays (a part with fewer
# owned vertices than intervals gets one interval per vertex).
MAX_INTERVALS = 1024
# Concurrent function calls per graph server: AWS Lambda's default concurrency limit per region.
MAX_FUNCTIONS = 1000
# Automatic restarts of a run's roles: a run that loses roles more often than this is not unlucky.
MAX_RECOVERIES = 100


# Fields only the coordinator (or the local emulator, or pricing) reads: a cluster-mode run may
# set them as it likes. Every other field changes what the servers compute or how they run, so
# a cluster's servers must have been started with the coordinator's values.
COORDINATOR_FIELDS = frozenset({
    "dataset", "partitions", "parts", "partition_method", "epochs", "eval_every", "checkpoint_every", "run_dir",
    "watchdog_min_s", "watchdog_factor", "function_handler", "lambda_memory_mb", "lambda_start_latency_ms",
    "lambda_cold_start_ms", "lambda_keep_warm_s", "lambda_bandwidth_mbps", "lambda_cpu_share", "aws_like",
    "fault_raise", "fault_crash", "fault_hang", "fault_straggle", "fault_straggle_factor", "fault_seed",
    "graph_server_instance", "param_server_instance", "curve", "max_recoveries", "preempt",
})
PREEMPT = re.compile(r"(\d+)@(\d+)")


def server_view(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config (``TrainConfig.to_dict()``) that the servers use: every field but
    :data:`COORDINATOR_FIELDS`. Flat scalars, so that they travel as a message's ``meta``."""
    return {name: value for name, value in config.items() if name not in COORDINATOR_FIELDS}


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def _model_opt(fallback: Any, help: str, choices: tuple | None = None) -> Any:
    """A field whose default is the model's: its module's ``DEFAULTS`` (the published recipe),
    else ``fallback`` (a field the model does not use)."""
    return field(default=None, metadata={"help": help, "choices": choices, "model_default": fallback})


def model_default(name: str, model: str) -> Any:
    """Field ``name``'s default under ``model`` (a field made with :func:`_model_opt`)."""
    declared = getattr(get_model(model), "DEFAULTS", {})
    return declared[name] if name in declared else _BASE_FIELDS[name].metadata["model_default"]


def _model_help() -> str:
    return "model architecture: " + "; ".join(f"'{name}' ({get_model(name).DESCRIPTION})" for name in MODELS)


def _mode_help() -> str:
    exact = [name for name in MODES if mode_class(name).exact]
    return ("scheduler: " + "; ".join(f"'{name}' = {mode_class(name).description}" for name in MODES)
            + f"; exact (equal the reference epoch by epoch): {', '.join(exact)}")


def staleness_modes() -> list[str]:
    """The modes that take ``--staleness`` (:attr:`graphserver.modes.Mode.bounded_staleness`)."""
    return [name for name in MODES if mode_class(name).bounded_staleness]


def _staleness_modes_text() -> str:
    return "--mode " + " or ".join(staleness_modes())


@dataclass
class _Config:
    """A training run's configuration (:data:`TrainConfig`: these fields plus those the models
    declare). Model-related fields left unset take the model's published defaults."""

    # data
    dataset: str = _opt("synthetic-small", "dataset: a preset name (synthetic-small, synthetic-1m, "
                        "synthetic-reddit) or a path (.npz, edge list, OGB directory)")
    row_normalize_features: bool = _opt(True, "divide each feature row by its sum (the Planetoid recipe)")
    sparse_features: str = _opt("auto", "layout of the input features in memory and in the partition store "
                                "written at start: 'on' = sparse (CSR: layer 0's X W, its dW and its dropout "
                                "cost what the non-zeros cost; same results), 'off' = dense, 'auto' = sparse "
                                f"when their density (non-zeros / entries) is below {AUTO_MAX_DENSITY:g}, as "
                                "for bag-of-words (each graph server judges its own part)", SPARSE_MODES)
    # model
    model: str = _opt("gcn", _model_help(), tuple(MODELS))
    layers: int = _opt(2, "number of graph convolution layers")
    hidden: int | None = _model_opt(16, "hidden width of every layer but the last (gat: per head; a model with an "
                                    "MLP per layer: also its inner width)")
    dropout: float | None = _model_opt(0.5, "dropout on the input of every layer after the first")
    input_dropout: float | None = _model_opt(0.5, "dropout on the input features (layer 0)")
    heads: int | None = _model_opt(8, "gat: attention heads of every layer but the last (their outputs are "
                                   "concatenated)")
    out_heads: int | None = _model_opt(1, "gat: attention heads of the last layer (their outputs are averaged)")
    attention_dropout: float | None = _model_opt(0.0, "gat: dropout on the attention coefficients (after the edge "
                                                 "softmax)")
    # optimizer
    optimizer: str = _opt("adam", "optimizer", ("adam", "sgd"))
    lr: float | None = _model_opt(0.01, "learning rate")
    weight_decay: float | None = _model_opt(5e-4, "L2 weight decay (added to the gradient, as torch.optim.Adam "
                                            "does), on every parameter of the layers it applies to, biases included")
    weight_decay_scope: str | None = _model_opt("first", "layers that get weight decay: 'first' (Kipf & Welling) "
                                                "or 'all'", ("first", "all"))
    # run
    backend: str = _opt("lambda", "where the tensor work runs: 'lambda' = functions through the Lambda Invoke API "
                        "(local emulator), 'cpu' = in the graph servers, 'gpu' = in the graph servers on a torch "
                        "device (--device), Gather and Scatter included, 'reference' = single-process PyTorch",
                        tuple(BACKENDS))
    device: str = _opt("cuda", "gpu backend: the torch device every graph server keeps its partition on and computes "
                       "on: 'cuda' (the current CUDA device), 'cuda:N', or 'cpu' (torch's CPU kernels; for "
                       "machines without a GPU and for tests)")
    allow_tf32: bool = _opt(False, "gpu backend: let CUDA matrix products use TF32 (faster on Ampere and later, "
                            "about 1e-3 relative error: sync mode then no longer equals the reference to 1e-5)")
    gpu_memory_fraction: float | None = _opt(None, "gpu backend on CUDA: the share of the device's memory, in (0, 1], "
                                             "that each graph server's tensors may take (torch's caching allocator, "
                                             "torch.cuda.set_per_process_memory_fraction), so that several share one "
                                             "GPU; default 1 / parts less 512 MiB of the device for each process's "
                                             "CUDA context, which lives outside that budget (a local run puts every "
                                             "graph server on the one --device; set about 0.95 when each has its own)")
    mode: str = _opt("sync", _mode_help(), tuple(MODES))
    staleness: int = _opt(0, f"{_staleness_modes_text()}: an interval starts epoch e only when e <= min_epoch + S, "
                          "and training's Gather reads ghost rows at most S epochs old (weights and evaluation "
                          "are never stale)")
    stale_correction: bool = _opt(False, f"{_staleness_modes_text()} with staleness >= 1: where a peer's ghost rows "
                                  "or ghost gradients are stale, the training pass uses their running average over "
                                  "the versions received, g = gamma g + (1 - gamma) received, instead of the stale "
                                  "rows as received (PipeGCN's smoothing); rows of the reader's own epoch are used "
                                  "as received")
    # 0.5, not PipeGCN's 0.95: an average over ~20 versions lagged a model that still moved fast,
    # costing 1-1.5 points of test accuracy on synthetic-1m where 0.5 cost none (benchmarks/README)
    stale_gamma: float = _opt(0.5, "--stale-correction's decay gamma, in [0, 1)")
    partitions: str | None = _opt(None, "partition store directory to train on (default: partition --dataset "
                                  "into the run directory)")
    parts: int | None = _opt(None, "number of graph servers (partitions): 2 when partitioning at start, the "
                             "store's count with --partitions (giving another count is an error)")
    partition_method: str = _opt("auto", "partitioner used at start: 'auto' = METIS where its memory estimate fits "
                                 "25 percent of available memory, else the streaming Fennel (as dorylus partition "
                                 "--method auto); ldg and fennel stream the edges and write the store part by part",
                                 PARTITION_METHODS)
    intervals: int = _opt(2, "intervals per graph server: one function call per interval and stage (more "
                          f"overlap Gather with functions; each call costs an invoke); 1 to {MAX_INTERVALS} "
                          "(a part with fewer owned vertices gets one interval per vertex)")
    functions: int | None = _opt(None, "concurrent function calls per graph server; default: autotuned while "
                                 f"training, between 1 and --intervals. At most {MAX_FUNCTIONS} (Lambda's default "
                                 "regional limit); a local lambda run needs an emulator worker process per call in "
                                 "flight, so there parts x (calls in flight per server + 1) must not exceed "
                                 f"min(available memory / {WORKER_MB} MB, {WORKERS_PER_CPU} x cores)")
    relaunch_min_s: float = _opt(5.0, "a function call not finished within max(this, relaunch_ratio x the moving "
                                 "mean of its task kind) is launched again")
    relaunch_ratio: float = _opt(3.0, "multiple of a task kind's moving mean duration before a relaunch")
    fallback_after: int = _opt(4, "lambda backend: after this many failed attempts of one function call (a call "
                               "is relaunched with jittered backoff after each failure), or with no result "
                               "within --task-timeout-s plus this many relaunch periods of its first launch, "
                               "the graph server runs the task itself on its own rows, as "
                               "the cpu backend does (counted as fallback_calls); only a task that fails "
                               f"there too stops the run. 1 to {MAX_FALLBACK_AFTER}")
    server_stage_ops: int = _opt(SERVER_STAGE_OPS, "lambda backend: a function stage with at most this many "
                                 "multiply-adds, elements and logits on an interval and no dropout mask to "
                                 "regenerate runs on its graph server instead of as a call (cheaper than an "
                                 "invoke); 0: only stages with element-wise work alone and no gradient do. "
                                 "0 to 2^40")
    function_handler: str = _opt(FUNCTION_HANDLER, "the function the local Lambda emulator runs (module:callable)")
    lambda_memory_mb: int = _opt(1024, "function memory size in MB, 128-10240 as Lambda allows (billing, and the "
                                 "emulator's setting)")
    lambda_start_latency_ms: float = _opt(0.0, "emulator: invoke latency added to each function call (not billed)")
    lambda_cold_start_ms: float = _opt(0.0, "emulator: extra latency of a call on a worker that has not run the "
                                       "function within --lambda-keep-warm-s (billed, as Lambda bills INIT)")
    lambda_keep_warm_s: float = _opt(600.0, "emulator: how long an idle worker stays warm")
    lambda_bandwidth_mbps: float = _opt(0.0, "emulator: cap on each call's ZeroMQ traffic in megabits/s (0: none)")
    lambda_cpu_share: bool = _opt(False, "emulator: slow each call to the CPU share its memory buys on Lambda "
                                  "(1,769 MB = one vCPU)")
    aws_like: bool = _opt(False, "emulator: AWS Lambda's measured latencies, bandwidth and CPU share, and EC2's "
                          "network latency, bandwidth and compute variability between graph servers (see "
                          "dorylus/emulator/physics.py); overrides the lambda_* and net_*/compute_jitter options")
    net_latency_ms: float = _opt(0.0, "local emulation: one-way latency added to every message a graph server "
                                 "sends to another graph server (ghost rows) or to the parameter server, and to "
                                 "its reply (docs/modes.md#physics)")
    net_bandwidth_mbps: float = _opt(0.0, "local emulation: per-link bandwidth, in megabits/s, of graph-server "
                                     "messages (ghost rows, weights and gradients the graph server sends or pulls "
                                     "for the cpu and gpu backends); 0: unlimited")
    compute_jitter: float = _opt(0.0, "local emulation: sigma of a seeded log-normal slowdown of each "
                                 "graph-server stage (Gather, vertex, backward Gather): d seconds become "
                                 "d * exp(sigma * |z|), z drawn per part, pass, epoch, stage and interval from "
                                 "--seed; 0: none")
    fault_raise: float = _opt(0.0, "emulator fault injection: fraction of calls that raise a function error")
    fault_crash: float = _opt(0.0, "emulator fault injection: fraction of calls whose sandbox crashes")
    fault_hang: float = _opt(0.0, "emulator fault injection: fraction of calls that hang until the timeout")
    fault_straggle: float = _opt(0.0, "emulator fault injection: fraction of calls slowed by --fault-straggle-factor")
    fault_straggle_factor: float = _opt(10.0, "emulator fault injection: slowdown of a straggling call")
    fault_seed: int = _opt(0, "emulator fault injection: seed of which calls fail")
    graph_server_instance: str | None = _opt(None, "EC2 instance type a graph server is priced at (default: "
                                             "c5.2xlarge; p3.2xlarge with --backend gpu)")
    param_server_instance: str = _opt("c5.xlarge", "EC2 instance type the parameter server is priced at")
    task_timeout_s: float = _opt(600.0, "a function call (and a phase never seen before) fails after this long; "
                                 "at most 900 with the lambda backend, Lambda's limit")
    watchdog_min_s: float = _opt(30.0, "watchdog: a role that answers no heartbeat for this long, or a phase "
                                 "that runs longer than max(this, watchdog_factor x its moving mean), stops "
                                 "the run with a checkpoint")
    watchdog_factor: float = _opt(10.0, "watchdog: multiple of a phase's moving mean duration it may take")
    curve: bool = _opt(False, "encrypt and authenticate every ZeroMQ connection of a local run with CURVE "
                       "(ephemeral keys in the run directory, removed when it ends); cluster mode always does, "
                       "with the keys of `dorylus keys`. Off by default: it costs 10 to 15 percent of an epoch "
                       "on synthetic-1m (docs/security.md)")
    max_message_mb: float | None = _opt(None, "largest ZeroMQ frame a role accepts, in MB; a larger one makes "
                                        "ZeroMQ drop the connection. Default: per receiver, twice the largest "
                                        "legitimate frame (its partition's rows x widest buffer; the largest "
                                        "weight) plus 64 KB, at least 1 MB")
    max_recoveries: int = _opt(3, "times a run recovers by itself after one of its roles died (a graph "
                               "server or the parameter server exited, e.g. SIGKILL or out of memory: local mode "
                               "restarts it, cluster mode waits for it at its address up to the cluster file's "
                               "recovery_wait_s) and goes on "
                               "from the state after the last finished epoch; a role that dies again within the "
                               f"same epoch, or one death more, stops the run with a checkpoint. 0 to "
                               f"{MAX_RECOVERIES}; 0: every death stops the run")
    preempt: str | None = _opt(None, "local mode: PART@EPOCH, graph server PART gets a spot interruption notice "
                               "when the coordinator starts epoch EPOCH, as AWS gives one two minutes before it "
                               "takes a spot instance back: the coordinator checkpoints at once, then the server "
                               "is killed and the run recovers by itself (--max-recoveries). Repeat the "
                               "flag for more (a config file lists them comma-separated); each epoch named counts "
                               "one recovery")
    checkpoint_every: int = _opt(10, "write checkpoint.pt every K epochs (also at the end, on Ctrl-C/SIGTERM "
                                 "and when a role fails)")
    epochs: int = _opt(200, "number of training epochs")
    seed: int = _opt(0, "seed of weight init and dropout masks")
    eval_every: int = _opt(1, "evaluate train/val/test accuracy (dropout off) every N epochs")
    run_dir: str | None = _opt(None, "run directory (default: runs/<time>-<dataset>-<backend>); must not exist or be empty")

    def __post_init__(self) -> None:
        self._resolve_model_defaults()
        if self.graph_server_instance is None and self.backend in BACKENDS:  # else validate names it
            self.graph_server_instance = backend_class(self.backend).graph_server_instance
        self.validate()

    def _resolve_model_defaults(self) -> None:
        """Fields left at None take the model's default (:func:`model_default`); an unknown model
        is left for :meth:`validate` to name."""
        if self.model not in MODELS:
            return
        unknown = set(getattr(get_model(self.model), "DEFAULTS", {})) - set(_BASE_FIELDS)
        if unknown:
            raise ConfigError(f"model {self.model!r} declares defaults for unknown config fields {sorted(unknown)}")
        for f in fields(_Config):
            if "model_default" in f.metadata and getattr(self, f.name) is None:
                setattr(self, f.name, model_default(f.name, self.model))

    def validate(self) -> "TrainConfig":
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not one of {', '.join(choices)}")
        checks = [
            (self.layers >= 1, "layers must be >= 1"),
            (self.hidden >= 1, "hidden must be >= 1"),
            (0.0 <= self.dropout < 1.0, "dropout must be in [0, 1)"),
            (0.0 <= self.input_dropout < 1.0, "input_dropout must be in [0, 1)"),
            (self.heads >= 1 and self.out_heads >= 1, "heads and out_heads must be >= 1"),
            (0.0 <= self.attention_dropout < 1.0, "attention_dropout must be in [0, 1)"),
            (math.isfinite(self.lr) and self.lr > 0, "lr must be a positive number"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.seed >= 0, f"seed must be >= 0, got {self.seed}"),  # numpy's generators take no negative seed
            (self.eval_every >= 1, "eval_every must be >= 1"),
            (self.parts is None or self.parts >= 1, "parts must be >= 1"),
            (1 <= self.intervals <= MAX_INTERVALS, f"intervals must be in [1, {MAX_INTERVALS}], got {self.intervals}"),
            (self.functions is None or 1 <= self.functions <= MAX_FUNCTIONS,
             f"functions must be in [1, {MAX_FUNCTIONS}] (Lambda's default concurrency limit), got {self.functions}"),
            (self.staleness >= 0, "staleness must be >= 0"),
            (self.staleness == 0 or mode_class(self.mode).bounded_staleness,  # the mode is known: choices above
             f"staleness applies to {_staleness_modes_text()} only, got mode {self.mode!r} with staleness "
             f"{self.staleness}"),
            (math.isfinite(self.relaunch_min_s) and self.relaunch_min_s > 0, "relaunch_min_s must be > 0"),
            (math.isfinite(self.relaunch_ratio) and self.relaunch_ratio >= 1, "relaunch_ratio must be >= 1"),
            (all(math.isfinite(v) and v >= 0 for v in (self.net_latency_ms, self.net_bandwidth_mbps,
                                                        self.compute_jitter)),
             "net_latency_ms, net_bandwidth_mbps and compute_jitter must be finite numbers >= 0"),
            (self.compute_jitter <= 2, f"compute_jitter must be at most 2 (a median slowdown of 4x), got "
                                       f"{self.compute_jitter}"),
            (math.isfinite(self.stale_gamma) and 0 <= self.stale_gamma < 1,
             f"stale_gamma must be in [0, 1), got {self.stale_gamma}"),
            (not self.stale_correction or (self.mode in staleness_modes() and self.staleness >= 1),
             f"stale_correction needs {_staleness_modes_text()} with --staleness >= 1 (older ghost rows to correct), "
             f"got mode {self.mode!r} with staleness {self.staleness}"),
            (math.isfinite(self.task_timeout_s) and self.task_timeout_s > 0, "task_timeout_s must be > 0"),
            (math.isfinite(self.watchdog_min_s) and self.watchdog_min_s > 0, "watchdog_min_s must be > 0"),
            (math.isfinite(self.watchdog_factor) and self.watchdog_factor >= 1, "watchdog_factor must be >= 1"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (0 <= self.max_recoveries <= MAX_RECOVERIES,
             f"max_recoveries must be in [0, {MAX_RECOVERIES}], got {self.max_recoveries}"),
            (self.max_message_mb is None or (math.isfinite(self.max_message_mb) and self.max_message_mb >= 1),
             "max_message_mb must be >= 1"),
            # the options the run's backend owns and the combinations it refuses
            *backend_class(self.backend).check_config(self),
        ]
        from dorylus.cost import DEFAULT_PRICES

        for name in ("graph_server_instance", "param_server_instance"):
            if getattr(self, name) not in DEFAULT_PRICES.ec2_hour_usd:
                checks.append((False, f"{name}={getattr(self, name)!r} is not in the price table; known: "
                                      + ", ".join(sorted(DEFAULT_PRICES.ec2_hour_usd))))
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"invalid config: {message}")
        self.preemptions()
        return self

    def graph_server_physics(self):
        """The :class:`~dorylus.emulator.physics.NetPhysics` graph servers apply: EC2's measured
        figures with ``aws_like``, else the ``net_*`` and ``compute_jitter`` options."""
        from dorylus.emulator.physics import AWS_NET_LIKE, NetPhysics

        if self.aws_like:
            return AWS_NET_LIKE
        return NetPhysics(latency_ms=self.net_latency_ms, bandwidth_mbps=self.net_bandwidth_mbps,
                          compute_jitter=self.compute_jitter)

    def preemptions(self) -> list[tuple[int, int]]:
        """``preempt`` as ``(part, epoch)`` pairs, checked against the run: a graph server that
        exists (once ``parts`` is known), an epoch it trains, recoveries enough for every epoch."""
        if self.preempt is None:
            return []
        pairs = []
        for item in self.preempt.split(","):
            match = PREEMPT.fullmatch(item.strip())
            if match is None:
                raise ConfigError(f"invalid config: preempt {item.strip()!r} is not PART@EPOCH (e.g. 1@5)")
            part, epoch = int(match.group(1)), int(match.group(2))
            if self.parts is not None and part >= self.parts:
                raise ConfigError(f"invalid config: preempt {item.strip()}: there is no graph server {part}, the run "
                                  f"has {self.parts} (0 to {self.parts - 1})")
            if not 1 <= epoch <= self.epochs:
                raise ConfigError(f"invalid config: preempt {item.strip()}: epoch {epoch} is not one the run trains "
                                  f"(1 to {self.epochs})")
            if (part, epoch) in pairs:
                raise ConfigError(f"invalid config: preempt {item.strip()} is given twice")
            pairs.append((part, epoch))
        epochs = len({epoch for _, epoch in pairs})
        if epochs > self.max_recoveries:
            raise ConfigError(f"invalid config: preempt names {epochs} epoch(s), each a recovery, but "
                              f"max_recoveries is {self.max_recoveries}")
        return pairs

    def check_machine(self, parts: int | None = None) -> None:
        """What the backend needs of this machine for a local run of ``parts`` graph servers
        (default: the config's, else 2), checked before anything is written or started
        (:meth:`graphserver.backends.RunBackend.check_machine`)."""
        backend_class(self.backend).check_machine(self, parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "config") -> "TrainConfig":
        known = {f.name: f for f in fields(cls)}
        if "max_attempts" in values and "fallback_after" not in values:
            # Run directories from before the fallback policy: their attempt cap is its K.
            values = {("fallback_after" if k == "max_attempts" else k): v for k, v in values.items()}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
        typed = {name: _coerce(known[name], value, where) for name, value in values.items()}
        try:
            return cls(**typed)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


_BASE_FIELDS = {f.name: f for f in fields(_Config)}


def _declared_fields() -> list[tuple[str, str, Any]]:
    """The config fields model modules declare (``CONFIG_FIELDS``: ``{name: (default, help)}``),
    e.g. a model's own option; each becomes a ``--flag`` like every other field."""
    declared = []
    for model in MODELS:
        for name, (default, help_text) in getattr(get_model(model), "CONFIG_FIELDS", {}).items():
            if name in _BASE_FIELDS or any(name == d[0] for d in declared):
                raise ConfigError(f"model {model!r} declares config field {name!r}, which exists already")
            declared.append((name, type(default).__name__, _opt(default, f"{model}: {help_text}")))
    return declared


# The one typed configuration: the fields above and those the registered models declare.
TrainConfig = dataclasses.make_dataclass("TrainConfig", _declared_fields(), bases=(_Config,))
TrainConfig.__module__, TrainConfig.__qualname__ = __name__, "TrainConfig"
TrainConfig.__doc__ = _Config.__doc__


def _field_type(f: dataclasses.Field) -> type:
    return {"str": str, "int": int, "float": float, "bool": bool, "str | None": str, "int | None": int,
            "float | None": float}[str(f.type)]


def _coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind = _field_type(f)
    if value is None and "None" in str(f.type):
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {f.name} must be {kind.__name__}, got {value!r}")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``.toml`` or ``.json`` config file into a dict (validated later by ``from_dict``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        elif path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib

            values = tomllib.loads(path.read_text())
        else:
            raise ConfigError(f"config file {path}: unknown type {path.suffix!r} (use .toml or .json)")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a table/object of keys")
    return values


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field; defaults are ``None`` so that unset flags don't override
    the config file."""
    parser.add_argument("--config", metavar="FILE", help="config file (.toml or .json); flags override it")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its checkpoint.pt with its config.json, appending "
                             "to its metrics.jsonl; only how long and how carefully it runs may change: --epochs, "
                             "--eval-every, --checkpoint-every, --task-timeout-s, --watchdog-*, --functions, "
                             "--relaunch-*, --fallback-after and the emulator's physics")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if "model_default" in f.metadata:
            by_model = ", ".join(f"{model} {model_default(f.name, model)}" for model in MODELS)
            help_text = f.metadata["help"] + f" (default: the model's: {by_model})"
        else:
            help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        kind = _field_type(f)
        if f.name == "preempt":  # repeatable; joined by overrides_from_args
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text,
                                metavar="PART@EPOCH")
        elif kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text,
                                choices=f.metadata.get("choices"),
                                metavar=f.name.upper() if not f.metadata.get("choices") else None)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given as flags (type-checked, not yet validated as a whole)."""
    known = {f.name: f for f in fields(TrainConfig)}
    given = {name: getattr(args, name) for name in known if getattr(args, name, None) is not None}
    if isinstance(given.get("preempt"), list):
        given["preempt"] = ",".join(given["preempt"])
    return {name: _coerce(known[name], value, "command line") for name, value in given.items()}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    flags = overrides_from_args(args)
    values.update(flags)
    where = (f"{args.config} with command-line flags" if args.config and flags else args.config) or "command line"
    return TrainConfig.from_dict(values, where=where)
