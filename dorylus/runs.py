"""The run directory: ``config.json``, ``metrics.jsonl`` (one object per epoch), ``summary.json``
and ``checkpoint.pt``. Whole files are written to a temporary name and renamed into place, so a
crash never leaves a half-written config, metrics file, summary or checkpoint."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from dorylus import atomic
from dorylus.errors import ConfigError


def default_run_dir(dataset: str, backend: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{Path(dataset).stem}-{backend}"


# 2: named parameters (``layers.<l>.<name>``, biases included) and optimizer state named after them.
# 1 (before): one weight matrix per layer, no biases; refused on resume (see load_checkpoint).
CHECKPOINT_FORMAT = 2


def check_creatable_dir(path: str | Path, what: str) -> None:
    """Raise ConfigError unless ``path`` is an empty directory or can be created: names the
    ancestor that is a regular file, or the directory that already holds files."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{what} {path} exists and is not a directory")
        if path.is_dir():
            if any(path.iterdir()):
                raise ConfigError(f"{what} {path} already exists and is not empty")
            _check_writable(path, f"{what} {path} is not writable")
            return
        for ancestor in path.parents:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ConfigError(f"{what} {path} cannot be created: {ancestor} is a file, not a directory")
                _check_writable(ancestor, f"{what} {path} cannot be created: {ancestor} is not writable")
                return
    except OSError as exc:  # e.g. a directory we may not list: one line, not a traceback
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None


def _check_writable(directory: Path, message: str) -> None:
    """Raise ConfigError(message) unless a file can be made in ``directory``. Permission bits
    alone do not say (root ignores them, a read-only mount or an ACL overrides them), so a
    temporary directory is made and removed at once."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(message)
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dorylus-probe-", dir=directory))
    except OSError as exc:
        raise ConfigError(f"{message} ({exc.strerror or exc})") from None


class RunDir:
    """A run directory: ``config.json``, ``metrics.jsonl``, ``checkpoint.pt``, ``summary.json``.

    :meth:`create` makes a fresh one (refusing one that holds files, so no earlier run is lost);
    :meth:`reopen` continues one from its checkpoint's epoch.
    """

    def __init__(self, path: Path, config: dict[str, Any]):
        self.path = path
        self.config = config
        atomic.write_json(self.path / "config.json", config)
        self._metrics: IO[str] = open(self.path / "metrics.jsonl", "a")

    @classmethod
    def create(cls, path: str | Path, config: dict[str, Any]) -> "RunDir":
        check_creatable_dir(path, "run directory")
        Path(path).mkdir(parents=True, exist_ok=True)
        return cls(Path(path), config)

    @classmethod
    def reopen(cls, path: str | Path, config: dict[str, Any], last_epoch: int) -> "RunDir":
        """Continue after ``last_epoch``: metrics of later epochs (logged after the checkpoint)
        are dropped, so that resuming never repeats an epoch in ``metrics.jsonl``."""
        path = Path(path)
        kept = [m for m in read_metrics(path) if m["epoch"] <= last_epoch] if (path / "metrics.jsonl").exists() else []
        atomic.write_text(path / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in kept))
        return cls(path, config)

    def log_epoch(self, metrics: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic.write_json(self.path / "summary.json", {"config": self.config, **summary})

    def save_checkpoint(self, checkpoint: "Checkpoint") -> Path:
        import torch

        path = self.path / "checkpoint.pt"
        with atomic.writing(path) as f:
            torch.save({"format": CHECKPOINT_FORMAT, "config": self.config, **checkpoint.to_dict()}, f)
        return path

    def close(self) -> None:
        self._metrics.close()


@dataclass
class Checkpoint:
    """Everything a run needs to continue after ``epoch``.

    Dropout masks are keyed by (seed, epoch, layer, vertex), so the seed in the saved config and
    the epoch are the whole random state. ``identity`` holds the sha256 fingerprints of the
    dataset and the partition store the run trained on; resuming on anything else is refused.
    """

    epoch: int
    params: dict[str, np.ndarray]      # ``layers.<l>.<name>`` -> array (dorylus.models.base.param_key)
    optimizer: dict[str, np.ndarray]   # ``<parameter>.<kind>`` -> array (dorylus.optim)
    identity: dict[str, str | None]

    def to_dict(self) -> dict[str, Any]:
        import torch

        return {"epoch": self.epoch, "params": {k: torch.from_numpy(np.array(v)) for k, v in self.params.items()},
                "optimizer": {k: torch.from_numpy(np.array(v)) for k, v in self.optimizer.items()},
                "identity": dict(self.identity)}


def load_checkpoint(run_dir: str | Path) -> tuple[dict[str, Any], Checkpoint]:
    """The saved config and the :class:`Checkpoint` of ``run_dir``; ConfigError naming the file
    when it is missing or unreadable."""
    import torch

    path = Path(run_dir) / "checkpoint.pt"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: the run never reached a checkpoint, nothing to resume")
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as exc:  # torch.load raises many kinds on a corrupt file
        raise ConfigError(f"{path} is not a readable Dorylus checkpoint ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None
    if isinstance(saved, dict) and saved.get("format") == 1:
        # Format 1 held one matrix per layer (W0, W1, ...: GAT's and SAGE's stacked) and no
        # biases. Its models are not this version's (every layer now has a bias), so no
        # conversion continues that run as it would have gone: refused, with what to do.
        raise ConfigError(f"{path} was written by an older dorylus (checkpoint format 1: one weight matrix per "
                          "layer, no biases); this version's models have named parameters and biases, so that run "
                          "cannot be resumed here. Start a new run, or resume it with the dorylus release that "
                          "wrote it")
    try:
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"format {saved.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        checkpoint = Checkpoint(epoch=int(saved["epoch"]), params={k: v.numpy() for k, v in saved["params"].items()},
                                optimizer={k: v.numpy() for k, v in saved["optimizer"].items()},
                                identity=dict(saved["identity"]))
        return dict(saved["config"]), checkpoint
    except Exception as exc:  # a field missing or of the wrong kind
        raise ConfigError(f"{path} is not a readable Dorylus checkpoint ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The epochs logged in ``path/metrics.jsonl``, in order. Text after the last newline is a
    line still being written (the run is live) or cut off by a kill: it is left out, and a
    resume overwrites it. A complete line that is not a JSON object is a ConfigError naming the
    file and line."""
    file = Path(path) / "metrics.jsonl"
    *complete, _partial = file.read_text().split("\n")
    metrics = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}, line {number}: not a JSON object ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise ConfigError(f"{file}, line {number}: not a JSON object")
        metrics.append(entry)
    return metrics


class EpochProgress:
    """One line per epoch with the headline figures: loss, accuracy, seconds (and dollars) per
    epoch. On a terminal the line is redrawn in place with a bar; otherwise plain lines."""

    def __init__(self, total: int, stream: IO[str] | None = None):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, m: dict[str, Any]) -> None:
        def fmt(key: str, label: str, spec: str = ".4f") -> str:
            value = m.get(key)
            return f"{label} {value:{spec}}" if isinstance(value, (int, float)) else f"{label} -"

        parts = [
            f"epoch {m['epoch']}/{self.total}",
            fmt("loss", "loss"),
            fmt("train_acc", "train"),
            fmt("val_acc", "val"),
            fmt("test_acc", "test"),
            fmt("epoch_s", "s/epoch", ".3f"),
        ]
        if "cost_usd" in m:
            parts.append(fmt("cost_usd", "$/epoch", ".2e"))
        line = " | ".join(parts)
        if self.tty:
            width = 20
            done = int(width * m["epoch"] / self.total)
            self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {line}\033[K")
            if m["epoch"] == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
