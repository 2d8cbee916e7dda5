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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dorylus.errors import ConfigError


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # data
    dataset: str = _opt("synthetic-small", "dataset: a preset name (synthetic-small, synthetic-1m, "
                        "synthetic-reddit) or a path (.npz, edge list, OGB directory)")
    row_normalize_features: bool = _opt(True, "divide each feature row by its sum (the Planetoid recipe)")
    # model
    model: str = _opt("gcn", "model architecture", ("gcn",))
    layers: int = _opt(2, "number of graph convolution layers")
    hidden: int = _opt(16, "hidden width of every layer but the last")
    dropout: float = _opt(0.5, "dropout on the input of every layer after the first")
    input_dropout: float = _opt(0.5, "dropout on the input features (layer 0)")
    # optimizer
    optimizer: str = _opt("adam", "optimizer", ("adam", "sgd"))
    lr: float = _opt(0.01, "learning rate")
    weight_decay: float = _opt(5e-4, "L2 weight decay (added to the gradient, as torch.optim.Adam does)")
    weight_decay_scope: str = _opt("first", "layers that get weight decay: 'first' (Kipf & Welling) or 'all'",
                                   ("first", "all"))
    # run
    backend: str = _opt("lambda", "where the tensor work runs: 'lambda' = functions through the Lambda Invoke API "
                        "(local emulator), 'cpu' = in the graph servers, 'reference' = single-process PyTorch",
                        ("lambda", "cpu", "reference"))
    mode: str = _opt("sync", "'sync': barrier after every Scatter (exact, equals the reference)", ("sync",))
    partitions: str | None = _opt(None, "partition store directory to train on (default: partition --dataset "
                                  "into the run directory)")
    parts: int = _opt(2, "number of graph servers (partitions) when partitioning at start")
    partition_method: str = _opt("metis", "partitioner used at start", ("metis", "random", "contiguous"))
    functions: int = _opt(2, "intervals per graph server: one function call per interval and task")
    function_handler: str = _opt("lambdas.handler:handler", "the function the local Lambda emulator runs (module:callable)")
    lambda_memory_mb: int = _opt(1024, "function memory size (billing, and the emulator's setting)")
    lambda_start_latency_ms: float = _opt(0.0, "emulated start latency added to each function call")
    graph_server_instance: str = _opt("c5.2xlarge", "EC2 instance type a graph server is priced at")
    param_server_instance: str = _opt("c5.xlarge", "EC2 instance type the parameter server is priced at")
    task_timeout_s: float = _opt(600.0, "give up on a training phase that takes longer than this")
    epochs: int = _opt(200, "number of training epochs")
    seed: int = _opt(0, "seed of weight init and dropout masks")
    eval_every: int = _opt(1, "evaluate train/val/test accuracy (dropout off) every N epochs")
    run_dir: str | None = _opt(None, "run directory (default: runs/<time>-<dataset>-<backend>); must not exist or be empty")

    def __post_init__(self) -> None:
        self.validate()

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
            (math.isfinite(self.lr) and self.lr > 0, "lr must be a positive number"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.eval_every >= 1, "eval_every must be >= 1"),
            (self.parts >= 1, "parts must be >= 1"),
            (self.functions >= 1, "functions must be >= 1"),
            (self.lambda_memory_mb >= 128, "lambda_memory_mb must be >= 128"),
            (self.lambda_start_latency_ms >= 0, "lambda_start_latency_ms must be >= 0"),
            (self.task_timeout_s > 0, "task_timeout_s must be > 0"),
        ]
        from dorylus.cost import DEFAULT_PRICES

        for name in ("graph_server_instance", "param_server_instance"):
            if getattr(self, name) not in DEFAULT_PRICES.ec2_hour_usd:
                checks.append((False, f"{name}={getattr(self, name)!r} is not in the price table; known: "
                                      + ", ".join(sorted(DEFAULT_PRICES.ec2_hour_usd))))
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"invalid config: {message}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "config") -> "TrainConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
        typed = {name: _coerce(known[name], value, where) for name, value in values.items()}
        return cls(**typed)


def _field_type(f: dataclasses.Field) -> type:
    return {"str": str, "int": int, "float": float, "bool": bool, "str | None": str}[str(f.type)]


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
            import tomllib

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
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        kind = _field_type(f)
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text,
                                choices=f.metadata.get("choices"),
                                metavar=f.name.upper() if not f.metadata.get("choices") else None)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    where = args.config or "command line"
    values.update({f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None})
    return TrainConfig.from_dict(values, where=where)
