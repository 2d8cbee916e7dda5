"""The run directory: ``config.json``, ``metrics.jsonl`` (one object per epoch), ``summary.json``
and ``checkpoint.pt``. Whole files are written to a temporary name and renamed into place, so a
crash never leaves a half-written config, summary or checkpoint."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from dorylus.errors import ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def default_run_dir(dataset: str, backend: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{Path(dataset).stem}-{backend}"


class RunDir:
    """A fresh run directory. Refuses one that already holds files, so no earlier run is lost."""

    def __init__(self, path: str | Path, config: dict[str, Any]):
        self.path = Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise ConfigError(f"run directory {self.path} already exists and is not empty; choose another --run-dir")
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = config
        atomic_write_text(self.path / "config.json", json.dumps(config, indent=2) + "\n")
        self._metrics: IO[str] = open(self.path / "metrics.jsonl", "a")

    def log_epoch(self, metrics: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps({"config": self.config, **summary}, indent=2) + "\n")

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        import torch

        path = self.path / "checkpoint.pt"
        tmp = path.with_name(".checkpoint.pt.tmp")
        torch.save({"config": self.config, **state}, tmp)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        self._metrics.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(Path(path) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


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
