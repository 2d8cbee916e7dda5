"""Epoch time, dollars and value of the backends on the same job (default: those on CPU cores).

Every backend (``--backends``: any of ``graphserver.backends.BACKENDS``; default: the one
without graph servers, the reference, then every one whose tensor work runs on CPU cores) trains
the same ``TrainConfig`` (default: 2-layer GCN, hidden 16, the Planetoid
recipe) on the same dataset through ``dorylus.coordinator.training.run_training``, each in a fresh run
directory under a temp dir; the distributed backends partition the dataset (METIS, ``--parts``
graph servers, ``--intervals`` each) before their first epoch, outside the timed
epochs. The numbers come from each run's ``metrics.jsonl``; the first ``--warmup`` epochs are
dropped.

What an epoch is. ``epoch_s`` is the coordinator's wall time of one ``step``: forward with
dropout, loss, backward, optimizer step, **and** the evaluation forward pass without dropout
(``eval_every = 1``), in every backend alike. ``cost_usd`` is the epoch's function bill
(billed GB-s and requests) plus ``--parts`` graph servers and one parameter server for the
epoch's wall time; the reference is priced as one graph-server instance. ``value`` is
``1 / (mean epoch_s * mean cost_usd)`` (``dorylus.cost.value``; higher is better).
``task_s`` is the per-epoch sum over phases of the slowest graph server's time per task kind.
``bytes`` is what the graph servers count, summed over them: tensors to and from functions,
ghost rows sent to peers, and tensors sent to the parameter server (the cpu backend's gradient
pushes); the functions' own weight pulls and gradient pushes to the parameter server (lambda
backend) pass no graph server and are not counted.

Exactness. An exact mode (``--mode``; ``exact`` in ``graphserver.modes``, sync for one)
reproduces the reference, so every other backend's final loss must equal the reference's to
``--tolerance`` relative (default 1e-5); the check is printed and stored, and fails the run. In
a mode that is not exact the differences are printed and stored, not judged.

    python benchmarks/bench_backends.py
    python benchmarks/bench_backends.py --dataset synthetic-small --parts 4 --intervals 3 --epochs 20
    python benchmarks/bench_backends.py --dataset ../shared/data/cora.npz --backends reference,cpu

Prints a table and writes ``benchmarks/results/backends-<dataset>.json`` (``--output``).
Runs on a shared machine are noisy: the load average before and after is printed and stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dorylus.config import TrainConfig
from dorylus.cost import value
from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from graphserver.backends import BACKENDS, backend_class
from graphserver.modes import MODES, mode_class
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
# The reference (the backend without graph servers: the losses' yardstick) first, then every
# backend whose tensor work runs on this machine's CPU cores.
DEFAULT_BACKENDS = tuple([n for n in BACKENDS if not backend_class(n).graph_servers]
                         + [n for n in BACKENDS if backend_class(n).graph_servers and backend_class(n).device == "cpu"])
TASKS = ("ga_s", "av_s", "sc_s", "ga_bwd_s", "sc_bwd_s", "av_bwd_s", "wu_s")
TRAFFIC = ("functions", "ghosts", "params")


def mode_help() -> str:
    """``dorylus train --mode``'s help (every mode of the registry, by its description)."""
    return next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == "mode")


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def measure(backend: str, base: TrainConfig, dataset, workdir: Path, warmup: int) -> dict[str, Any]:
    """Train ``base`` with ``backend`` in a fresh run dir; per-epoch figures of the timed epochs."""
    config = TrainConfig.from_dict({**base.to_dict(), "backend": backend, "run_dir": str(workdir / backend)})
    start = time.perf_counter()
    summary = run_training(config, dataset, progress=io.StringIO())
    wall_s = time.perf_counter() - start
    history = read_metrics(config.run_dir)
    timed = history[warmup:]
    epoch_s = [m["epoch_s"] for m in timed]
    cost = [m["cost_usd"] for m in timed]
    tasks = {k: mean([m.get("task_s", {}).get(k, 0.0) for m in timed]) for k in TASKS} if "task_s" in timed[0] else None
    traffic = {k: mean([m.get("bytes", {}).get(k, 0) for m in timed]) for k in TRAFFIC} if "bytes" in timed[0] else None
    return {
        "backend": backend,
        "epoch_s_median": statistics.median(epoch_s),
        "epoch_s_mean": mean(epoch_s),
        "cost_usd_mean": mean(cost),
        "invocations_per_epoch": mean([m.get("invocations", 0) for m in timed]),
        "billed_gb_s_per_epoch": mean([m.get("billed_gb_s", 0.0) for m in timed]),
        "value": value(mean(epoch_s), mean(cost)),
        "task_s_mean": tasks,
        "bytes_per_epoch": traffic,
        "bytes_per_epoch_total": sum(traffic.values()) if traffic else None,
        "final_loss": history[-1]["loss"],
        "final_test_acc": summary["final_test_acc"],
        # Everything run_training did besides the epochs: partitioning, starting the roles, checkpoint.
        "overhead_s": wall_s - sum(m["epoch_s"] for m in history),
        "losses": [m["loss"] for m in history],
        "epoch_s": [m["epoch_s"] for m in history],
    }


def loss_checks(rows: list[dict[str, Any]], tolerance: float, exact: bool = True) -> list[dict[str, Any]]:
    """Relative difference of each distributed backend's losses from the reference's (the backend
    without graph servers); ``ok`` is None where the mode is not ``exact`` (nothing to judge)."""
    reference = next((r for r in rows if not backend_class(r["backend"]).graph_servers), None)
    if reference is None:
        return []
    checks = []
    for row in rows:
        if row is reference:
            continue
        ref, got = np.array(reference["losses"]), np.array(row["losses"])
        relative = np.abs(got - ref) / np.abs(ref)
        checks.append({"backend": row["backend"], "final_loss": row["final_loss"],
                       "reference_final_loss": reference["final_loss"],
                       "final_rel_diff": float(relative[-1]), "max_rel_diff_any_epoch": float(relative.max()),
                       "tolerance": tolerance, "ok": bool(relative[-1] <= tolerance) if exact else None})
    return checks


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'backend':<10} {'s/epoch med':>11} {'s/epoch mean':>12} {'$/epoch':>10} {'calls/ep':>8} "
              f"{'GB-s/ep':>8} {'value 1/(s*$)':>13} {'MB/epoch':>9} {'final loss':>11} {'test acc':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        mb = f"{r['bytes_per_epoch_total'] / 2**20:9.1f}" if r["bytes_per_epoch_total"] is not None else f"{'-':>9}"
        print(f"{r['backend']:<10} {r['epoch_s_median']:11.3f} {r['epoch_s_mean']:12.3f} {r['cost_usd_mean']:10.2e} "
              f"{r['invocations_per_epoch']:8.0f} {r['billed_gb_s_per_epoch']:8.3f} {r['value']:13.4g} {mb} "
              f"{r['final_loss']:11.6f} {r['final_test_acc']:8.4f}")


def print_tasks(rows: list[dict[str, Any]]) -> None:
    distributed = [r for r in rows if r["task_s_mean"] is not None]
    if not distributed:
        return
    labels = {"functions": "MB gs<->fn", "ghosts": "MB ghosts", "params": "MB gs->ps"}
    header = f"{'backend':<10} " + " ".join(f"{k:>9}" for k in TASKS) + " " + " ".join(
        f"{labels[k]:>10}" for k in TRAFFIC)
    print(header)
    print("-" * len(header))
    for r in distributed:
        print(f"{r['backend']:<10} " + " ".join(f"{r['task_s_mean'][k]:9.4f}" for k in TASKS) + " "
              + " ".join(f"{r['bytes_per_epoch'][k] / 2**20:10.2f}" for k in TRAFFIC))


def backend_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--backends takes a comma-separated subset of {','.join(BACKENDS)}, "
                                         f"got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-1m", help="dataset spec: a preset or a path (default: synthetic-1m)")
    parser.add_argument("--backends", type=backend_list, default=list(DEFAULT_BACKENDS),
                        help=f"comma-separated backends to run, in order, of {','.join(BACKENDS)} (default: "
                             f"{','.join(DEFAULT_BACKENDS)})")
    parser.add_argument("--parts", type=positive_int, default=2, help="graph servers / partitions (default: 2)")
    parser.add_argument("--intervals", type=positive_int, default=2, help="intervals per graph server (default: 2)")
    parser.add_argument("--functions", type=positive_int, default=None,
                        help="concurrent calls per graph server (default: autotuned)")
    parser.add_argument("--mode", choices=tuple(MODES), default=TrainConfig.mode,
                        help=f"{mode_help()} (default: {TrainConfig.mode})")
    parser.add_argument("--epochs", type=positive_int, default=10, help="timed epochs (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="epochs run first and dropped (default: 2)")
    parser.add_argument("--layers", type=positive_int, default=TrainConfig.layers, help="GCN layers (default: 2)")
    parser.add_argument("--hidden", type=positive_int, default=TrainConfig.hidden, help="hidden width (default: 16)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="max relative final-loss difference from the reference (default: 1e-5)")
    parser.add_argument("--workdir", default=None, help="parent of the temp run dirs (default: system temp dir)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result path (default: benchmarks/results/backends-<dataset>.json)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")

    base = TrainConfig(dataset=args.dataset, parts=args.parts, intervals=args.intervals, functions=args.functions,
                       mode=args.mode, layers=args.layers,
                       hidden=args.hidden, epochs=args.warmup + args.epochs, eval_every=1)
    name = Path(args.dataset).stem
    output = args.output or RESULTS / f"backends-{name}.json"
    load_before = os.getloadavg()
    print(f"backends benchmark: {args.dataset}, {args.parts} parts x {args.intervals} intervals, mode {args.mode}, "
          f"{args.warmup} warm-up + {args.epochs} timed epochs; torch {torch.__version__}, {os.cpu_count()} cpus, "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    dataset = load_dataset(args.dataset)
    print(f"  {dataset.name}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, "
          f"{dataset.num_features} features, {dataset.num_classes} classes", flush=True)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-backends-", dir=args.workdir) as workdir:
        for backend in args.backends:
            row = measure(backend, base, dataset, Path(workdir), args.warmup)
            rows.append(row)
            print(f"  {backend}: {row['epoch_s_median']:.3f} s/epoch (median), "
                  f"{row['overhead_s']:.1f} s outside epochs", flush=True)
    checks = loss_checks(rows, args.tolerance, exact=mode_class(args.mode).exact)
    load_after = os.getloadavg()

    print()
    print(f"{dataset.name}, {args.parts} parts x {args.intervals} intervals ({args.mode}), {args.layers}-layer GCN hidden "
          f"{args.hidden}; {args.epochs} timed epochs after {args.warmup} warm-up.")
    print("Every epoch includes the evaluation forward pass (eval_every=1), in every backend.")
    print("$/epoch: functions + graph servers + parameter server for the epoch's wall time "
          "(reference: one graph-server instance); value = 1 / (mean s/epoch * mean $/epoch).")
    print_table(rows)
    print()
    print("Mean seconds per epoch by task (slowest graph server per phase) and MB per epoch counted by the graph "
          "servers (gs<->fn: to/from functions; gs->ps: to the parameter server; function<->ps traffic not counted):")
    print_tasks(rows)
    print()
    for c in checks:
        verdict = f"not judged ({args.mode} is not exact)" if c["ok"] is None else "OK" if c["ok"] else "MISMATCH"
        print(f"loss check {c['backend']} vs reference: final {c['final_loss']:.8f} vs {c['reference_final_loss']:.8f}, "
              f"relative diff {c['final_rel_diff']:.2e} (max over epochs {c['max_rel_diff_any_epoch']:.2e}), "
              f"tolerance {c['tolerance']:.0e}: {verdict}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus, shared: "
          f"timings are noisy)")

    result = {
        "benchmark": "backends", "dataset": args.dataset, "dataset_name": dataset.name,
        "num_nodes": dataset.num_nodes, "num_edges": dataset.num_edges, "num_features": dataset.num_features,
        "num_classes": dataset.num_classes, "warmup_epochs": args.warmup, "timed_epochs": args.epochs,
        "timed": "epoch_s = wall time of one training step including the evaluation forward pass (eval_every=1); "
                 "statistics over the timed epochs only",
        "config": {**base.to_dict(), "backend": None},
        "backends": rows, "loss_checks": checks,
        "machine": machine_info(load_before, load_after),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(result, output)
    print(f"wrote {output}")
    return result


if __name__ == "__main__":  # required: the emulator's workers are started with 'spawn' and re-import main
    try:
        result = main()
    except DorylusError as e:
        sys.exit(f"bench_backends: {e}")
    if any(c["ok"] is False for c in result["loss_checks"]):
        sys.exit(1)
