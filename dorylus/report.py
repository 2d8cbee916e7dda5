"""``dorylus report``: plots and a summary of one or more run directories.

For runs ``R_1 .. R_k`` it writes ``report/`` (inside the first run directory unless told
otherwise) with PNG plots (matplotlib, Agg backend) and an ``index.md`` that embeds them:

==================  =======================================================================
file                shows
==================  =======================================================================
``loss.png``        training loss against epoch, wall time (cumulative ``epoch_s``) and
                    dollars (cumulative ``cost_usd``), one line per run
``accuracy.png``    validation and test accuracy against the same three axes
``task_time.png``   seconds per epoch by task kind (``task_s``), stacked, one panel per run
``cost.png``        dollars per epoch by component (functions, graph servers, parameter
                    server), one bar per run
``value.png``       seconds per epoch, dollars per epoch and value side by side across runs
==================  =======================================================================

Every figure comes from ``metrics.jsonl`` alone, so a report can be drawn for a run that is
still going or was interrupted: per-epoch figures are means over the epochs logged,
``epoch_s`` = mean seconds, ``cost_usd`` = mean dollars, ``value = 1 / (epoch_s * cost_usd)``,
as in ``summary.json``. A bad input (no such directory, not a run directory, a corrupt line of
``metrics.jsonl``) is one error naming the file and line, and nothing is written: the report
is drawn in a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from dorylus import atomic
from dorylus.cost import COMPONENTS
from dorylus.errors import ConfigError
from graphserver.backends import BACKENDS, backend_class

PLOTS = ("loss.png", "accuracy.png", "task_time.png", "cost.png", "value.png")
REQUIRED = ("epoch", "loss", "epoch_s")  # every metrics line has them
COMPONENT_LABELS = {"functions": "functions", "graph_servers": "graph servers", "param_server": "parameter server"}


class ReportError(ConfigError):
    """A run directory or its metrics cannot be read: exit status 2."""


@dataclass
class Run:
    """A run directory as the report reads it."""

    path: Path
    name: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def backend(self) -> str:
        return str(self.config.get("backend", "?"))

    @property
    def parts(self) -> int | None:
        """Graph servers: None for a backend without them, whatever the config's ``parts`` says;
        as recorded for a backend this version does not register."""
        if self.backend in BACKENDS and not backend_class(self.backend).graph_servers:
            return None
        return self.config.get("parts")

    @property
    def epoch_s(self) -> float:
        return sum(m["epoch_s"] for m in self.metrics) / len(self.metrics)

    @property
    def cost_usd(self) -> float | None:
        if not all(isinstance(m.get("cost_usd"), (int, float)) for m in self.metrics):
            return None
        return sum(m["cost_usd"] for m in self.metrics) / len(self.metrics)

    @property
    def value(self) -> float | None:
        cost = self.cost_usd
        return 1.0 / (self.epoch_s * cost) if cost and self.epoch_s > 0 else None

    @property
    def final_test_acc(self) -> float | None:
        evaluated = [m["test_acc"] for m in self.metrics if isinstance(m.get("test_acc"), (int, float))]
        return evaluated[-1] if evaluated else None

    def cost_by_component(self) -> dict[str, float] | None:
        """Mean dollars per epoch by component, or None when the metrics predate the breakdown."""
        if not all(isinstance(m.get("cost_by_component_usd"), dict) for m in self.metrics):
            return None
        return {k: sum(float(m["cost_by_component_usd"].get(k, 0.0)) for m in self.metrics) / len(self.metrics)
                for k in COMPONENTS}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_run(path: str | Path) -> Run:
    """Read ``config.json`` and ``metrics.jsonl`` of a run directory; ReportError naming the file
    (and line) when either is missing or malformed."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"run directory {path} does not exist")
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory (expected a run directory)")
    config_path, metrics_path = path / "config.json", path / "metrics.jsonl"
    if not config_path.is_file() or not metrics_path.is_file():
        missing = config_path.name if not config_path.is_file() else metrics_path.name
        raise ReportError(f"{path} is not a run directory (no {missing})")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{config_path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ReportError(f"{config_path}: expected a JSON object")
    metrics = []
    try:
        lines = metrics_path.read_text().splitlines()
    except UnicodeDecodeError as exc:
        raise ReportError(f"{metrics_path}: not UTF-8 text: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            m = json.loads(line)
        except ValueError as exc:
            raise ReportError(f"{metrics_path} line {number}: not valid JSON: {exc}") from None
        if not isinstance(m, dict):
            raise ReportError(f"{metrics_path} line {number}: expected a JSON object, got {type(m).__name__}")
        bad = [k for k in REQUIRED if not _number(m.get(k))]
        if bad:
            raise ReportError(f"{metrics_path} line {number}: {', '.join(bad)} missing or not a finite number")
        if m["epoch_s"] < 0:
            raise ReportError(f"{metrics_path} line {number}: epoch_s is negative ({m['epoch_s']})")
        metrics.append(m)
    if not metrics:
        raise ReportError(f"{metrics_path}: no epochs logged yet")
    return Run(path=path, name=path.resolve().name, config=config, metrics=metrics)


# --------------------------------------------------------------------------- plots


def _figure(panels: int, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.6 * panels, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _axes_of(run: Run) -> list[tuple[str, list[float] | None]]:
    """The three x axes: epoch, wall time, dollars (None when the run has no dollars)."""
    epochs = [m["epoch"] for m in run.metrics]
    seconds = _cumulative([m["epoch_s"] for m in run.metrics])
    dollars = _cumulative([m["cost_usd"] for m in run.metrics]) if run.cost_usd is not None else None
    return [("epoch", epochs), ("wall time (s)", seconds), ("cost (USD)", dollars)]


def plot_curves(runs: list[Run], path: Path, keys: list[tuple[str, str]], ylabel: str) -> None:
    """``keys`` (metric, label) of every run against epoch, wall time and dollars."""
    figure, axes = _figure(3)
    for run in runs:
        for panel, (xlabel, xs) in zip(axes, _axes_of(run)):
            panel.set_xlabel(xlabel)
            if xs is None:
                continue
            for key, label in keys:
                points = [(x, m[key]) for x, m in zip(xs, run.metrics) if _number(m.get(key))]
                if points:
                    panel.plot(*zip(*points), marker="." if len(points) < 30 else None,
                               label=f"{run.name} {label}".strip())
    for panel in axes:
        panel.set_ylabel(ylabel)
        panel.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.savefig(path)


def plot_task_time(runs: list[Run], path: Path) -> list[str]:
    """Stacked seconds per task kind per epoch, one panel per run; returns notes on runs without
    ``task_s`` (the reference backend)."""
    import matplotlib

    with_tasks = [r for r in runs if any(isinstance(m.get("task_s"), dict) for m in r.metrics)]
    notes = [f"{r.name}: no per-task times (backend {r.backend})" for r in runs if r not in with_tasks]
    figure, axes = _figure(max(1, len(with_tasks)))
    for panel, run in zip(axes, with_tasks):
        kinds = sorted({k for m in run.metrics for k in (m.get("task_s") or {})})
        epochs = [m["epoch"] for m in run.metrics]
        bottom = [0.0] * len(epochs)
        colors = matplotlib.colormaps["tab20"]
        for i, kind in enumerate(kinds):
            heights = [float((m.get("task_s") or {}).get(kind, 0.0)) for m in run.metrics]
            panel.bar(epochs, heights, bottom=bottom, label=kind.removesuffix("_s"), width=0.8, color=colors(i % 20))
            bottom = [b + h for b, h in zip(bottom, heights)]
        panel.plot(epochs, [m["epoch_s"] for m in run.metrics], color="black", marker=".", label="epoch_s")
        panel.set_title(f"{run.name} ({run.backend})", fontsize=9)
        panel.set_xlabel("epoch")
        panel.set_ylabel("seconds (slowest server, summed over intervals)")
        panel.legend(fontsize=6, ncol=2)
    if not with_tasks:
        axes[0].text(0.5, 0.5, "no run has per-task times", ha="center", va="center")
        axes[0].set_axis_off()
    figure.savefig(path)
    return notes


def plot_cost(runs: list[Run], path: Path) -> list[str]:
    """Mean dollars per epoch by component, one stacked bar per run."""
    names, parts, notes = [], [], []
    for run in runs:
        components = run.cost_by_component()
        if components is None:
            notes.append(f"{run.name}: no cost by component in its metrics")
            continue
        names.append(run.name)
        parts.append(components)
    figure, (panel,) = _figure(1, height=4.0)
    bottom = [0.0] * len(names)
    for component in COMPONENTS:
        heights = [p[component] for p in parts]
        panel.bar(names, heights, bottom=bottom, label=COMPONENT_LABELS[component])
        bottom = [b + h for b, h in zip(bottom, heights)]
    panel.set_ylabel("USD per epoch (mean)")
    panel.legend(fontsize=8)
    panel.tick_params(axis="x", labelrotation=20, labelsize=7)
    if not names:
        panel.text(0.5, 0.5, "no run has cost by component", ha="center", va="center", transform=panel.transAxes)
    figure.savefig(path)
    return notes


def plot_value(runs: list[Run], path: Path) -> None:
    """Seconds per epoch, dollars per epoch and value, one bar per run in each panel."""
    figure, axes = _figure(3)
    names = [r.name for r in runs]
    for panel, (label, values) in zip(axes, (
            ("seconds per epoch", [r.epoch_s for r in runs]),
            ("USD per epoch", [r.cost_usd or 0.0 for r in runs]),
            ("value = 1 / (s x USD) per epoch", [r.value or 0.0 for r in runs]))):
        bars = panel.bar(names, values, color=[f"C{i}" for i in range(len(runs))])
        panel.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=7)
        panel.set_title(label, fontsize=9)
        panel.tick_params(axis="x", labelrotation=20, labelsize=7)
    figure.savefig(path)


# --------------------------------------------------------------------------- index


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_rows(runs: list[Run]) -> list[dict[str, str]]:
    """The summary table: run, backend, parts, epochs, s/epoch, $/epoch, value, final test acc."""
    return [{"run": r.name, "backend": r.backend, "parts": "-" if r.parts is None else str(r.parts),
             "epochs": str(len(r.metrics)), "s/epoch": _fmt(r.epoch_s, ".4f"), "$/epoch": _fmt(r.cost_usd, ".4e"),
             "value": _fmt(r.value, ".5g"), "final test acc": _fmt(r.final_test_acc, ".4f")} for r in runs]


def _table(rows: list[dict[str, str]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines)


def index_markdown(runs: list[Run], notes: list[str]) -> str:
    best = max((r for r in runs if r.value is not None), key=lambda r: r.value, default=None)
    lines = [f"# Dorylus report: {', '.join(r.name for r in runs)}", "",
             "Per-epoch figures are means over the epochs logged in each run's `metrics.jsonl`; "
             "value = 1 / (s/epoch x $/epoch), higher is better.", "", _table(summary_rows(runs)), ""]
    if best is not None and len(runs) > 1:
        lines += ["Value relative to the best run (" + best.name + "): "
                  + ", ".join(f"{r.name} {r.value / best.value:.3g}x" for r in runs if r.value is not None), ""]
    captions = {
        "loss.png": "Training loss against epoch, wall time and dollars.",
        "accuracy.png": "Validation and test accuracy against epoch, wall time and dollars.",
        "task_time.png": "Seconds per epoch by task kind (`task_s`), stacked; the line is the epoch's wall time.",
        "cost.png": "Dollars per epoch by component: functions, graph servers, parameter server.",
        "value.png": "Seconds per epoch, dollars per epoch and value across runs.",
    }
    for name in PLOTS:
        lines += [f"## {name}", "", captions[name], "", f"![{name}]({name})", ""]
    if notes:
        lines += ["## Notes", ""] + [f"* {n}" for n in notes] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the report


def write_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 progress: IO[str] | None = None) -> Path:
    """Draw the report of ``run_dirs`` into ``out`` (default ``<first run>/report``), replacing an
    earlier report there; returns ``out``. Every input is read and checked before anything is
    written, and the files are drawn in a temporary directory renamed into place."""
    if not run_dirs:
        raise ReportError("report: name at least one run directory")
    say: Callable[[str], None] = (lambda message: print(f"report: {message}", file=progress or sys.stderr,
                                                         flush=True))
    runs = [load_run(path) for path in run_dirs]  # every input checked before anything is said or written
    for run in runs:
        say(f"read {run.path} ({len(run.metrics)} epochs, backend {run.backend})")
    seen: dict[str, int] = {}
    for run in runs:  # two runs of the same name get distinct labels
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name} ({seen[run.name]})"
    out = Path(out) if out is not None else runs[0].path / "report"
    if out.exists() and not out.is_dir():
        raise ReportError(f"report: {out} exists and is not a directory")
    if not out.parent.is_dir():
        raise ReportError(f"report: {out.parent} does not exist or is not a directory")
    import matplotlib

    matplotlib.use("Agg")
    with atomic.building_dir(out) as tmp:
        notes: list[str] = []
        steps = [
            ("loss.png", lambda p: plot_curves(runs, p, [("loss", "")], "training loss")),
            ("accuracy.png", lambda p: plot_curves(runs, p, [("val_acc", "val"), ("test_acc", "test")], "accuracy")),
            ("task_time.png", lambda p: notes.extend(plot_task_time(runs, p))),
            ("cost.png", lambda p: notes.extend(plot_cost(runs, p))),
            ("value.png", lambda p: plot_value(runs, p)),
        ]
        for i, (name, draw) in enumerate(steps, 1):
            say(f"plotting {name} ({i}/{len(steps)})")
            draw(tmp / name)
        (tmp / "index.md").write_text(index_markdown(runs, notes))
    say(f"wrote {out / 'index.md'} and {len(PLOTS)} plots")
    return out
