"""Epoch time, staleness and accuracy of the scheduler modes on the same job.

Goal (issue 21): **under --aws-like, async S=1 at least 1.3x faster per epoch than sync, and with
--stale-correction its final test accuracy within 1 point of sync's** (on a 2-part graph of at
least 30K vertices). The verdict is printed and stored; it does not change the exit status.

Every mode trains the same ``TrainConfig`` (default: 2-layer GCN, hidden 16, the Planetoid
recipe; backend ``lambda`` through the local emulator (``--backend``: a backend with graph servers
on CPU cores), ``--aws-like`` physics on
unless ``--no-aws-like``: Lambda's figures and EC2's network and compute jitter between graph
servers) through ``dorylus.coordinator.training.run_training``, each in a fresh run directory under a temp
dir. Each dataset (``--dataset``, repeatable; default ``synthetic-1m``, 64K vertices, and Cora) is
partitioned once (METIS, ``--parts`` graph servers) into one partition store before any mode runs,
outside every timing, and every mode trains on that store (``TrainConfig.partitions``). Modes
(``--modes``), each a mode of ``graphserver.modes.MODES``: its name (``sync``, ``pipe``) or, for
a mode with bounded staleness, ``<mode>S`` for ``--mode <mode> --staleness S`` (``async1``) and
``<mode>Sc`` for the same with ``--stale-correction`` (S >= 1: ``async1c``); default every mode,
a bounded one at S = 0, 1 and 2 and with the correction at 1 and 2
(``sync,pipe,async0,async1,async1c,async2,async2c``). Sync is the baseline and always runs first
(it is added when missing).

Evaluation runs every epoch (``eval_every = 1``): ``epoch_s`` is the coordinator's wall time of
one step, training pass **and** the evaluation forward pass, in every mode alike. Per mode:

* ``s/epoch``: median and mean ``epoch_s`` over the epochs after the first ``--warmup`` (default
  1); ``speedup`` = sync's mean / this mode's mean (async's epochs end in pairs when one pass
  overlaps the next epoch's, short and long in turn: their median says little);
* ``stale mean`` / ``stale max``: mean over all epochs of the per-epoch ``staleness_mean``, and
  the largest ``staleness_max`` (epochs between a ghost row read and the epoch reading it);
  ``lag max``: the largest ``weight_lag_max`` (weight versions behind the newest at a pull);
* ``final test``: test accuracy after the last epoch; ``last-K``: its mean over the last
  ``--final-window`` epochs (default 10), which an epoch's noise moves less;
* ``t->target``: wall seconds (``epoch_s`` summed from epoch 1, warm-up included) until the
  first epoch whose ``test_acc`` >= ``--target-fraction`` (0.95) x sync's final test accuracy,
  with that epoch; "not reached" otherwise.

    python benchmarks/bench_modes.py                      # both datasets, every mode, 30 epochs
    python benchmarks/bench_modes.py --dataset synthetic-1m --epochs 10 --modes sync,async1,async1c
    python benchmarks/bench_modes.py --dataset ../shared/data/cora.npz --epochs 100 --no-aws-like
    python benchmarks/bench_modes.py --dataset synthetic-1m --modes sync,async1c --epochs 300 --seed 0 --seed 1

With several ``--seed`` options (each a partition, initialisation and dropout of its own) every seed
runs every mode and prints its table; the goal is then judged on the means over the seeds
(speedup, and the difference from sync's final test accuracy, seed by seed), and each seed's
difference is printed beside it, so that one seed's luck does not decide a one-point goal.

Prints a table per dataset and writes ``benchmarks/results/modes-<dataset>.json`` (``--output``,
with one dataset only), with the per-epoch losses, accuracies, times and staleness of every mode.
Runs on a shared machine are noisy: the load average before and after is printed and stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dorylus.config import TrainConfig
from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.partition import assign_parts, open_store, write_store
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from graphserver.backends import BACKENDS, backend_class
from graphserver.modes import MODES, mode_class
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "sync"  # every mode's speed and accuracy are compared with it (issue 21's goal)
GOAL_MODE = "async"  # the goal's mode: at S = 1, and with --stale-correction
STALENESS_VARIANTS = ("0", "1", "1c", "2", "2c")  # the default runs of a mode with bounded staleness
DEFAULT_MODES = ",".join(v for name in MODES for v in (
    [f"{name}{s}" for s in STALENESS_VARIANTS] if mode_class(name).bounded_staleness else [name]))
# where the tensor work may run: a backend with graph servers on CPU cores (aws-like physics is theirs)
BENCH_BACKENDS = tuple(n for n in BACKENDS if backend_class(n).graph_servers and backend_class(n).device == "cpu")
if BASELINE not in MODES or not mode_class(GOAL_MODE).bounded_staleness:  # mode_class: a registered mode
    raise ImportError(f"bench_modes: the baseline {BASELINE!r} or the goal's mode {GOAL_MODE!r} left the registry")
DEFAULT_DATASETS = ["synthetic-1m", str(Path(__file__).resolve().parents[2] / "shared" / "data" / "cora.npz")]
GOAL_SPEEDUP = 1.3      # async S=1 vs sync, per epoch
GOAL_ACC_POINTS = 0.01  # |final test acc - sync's| at most one point: async S=1 with correction


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def parse_mode(name: str) -> tuple[str, int, bool]:
    """``sync`` -> (sync, 0, False), ``async3`` -> (async, 3, False), ``async1c`` -> (async, 1, True):
    the mode (one of :data:`graphserver.modes.MODES`), its staleness bound and stale correction. A
    mode with bounded staleness takes its bound after its name; any other mode is its name alone."""
    if name in MODES and not mode_class(name).bounded_staleness:
        return name, 0, False
    match = re.fullmatch(r"(.*?)(\d+)(c?)", name)
    if match and match.group(1) in MODES and mode_class(match.group(1)).bounded_staleness \
            and not (match.group(3) and int(match.group(2)) == 0):
        return match.group(1), int(match.group(2)), bool(match.group(3))
    raise argparse.ArgumentTypeError(f"unknown mode {name!r}: use {mode_forms()}")


def mode_forms() -> str:
    """The ``--modes`` forms: each mode's name, or ``<mode>S`` / ``<mode>Sc`` for a bounded one."""
    return ", ".join(f"{m}S (S = staleness bound, e.g. {m}0), {m}Sc (with --stale-correction, S >= 1, e.g. {m}1c)"
                     if mode_class(m).bounded_staleness else m for m in MODES)


def mode_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"--modes takes a comma-separated list, got {text!r}")
    for name in names:
        parse_mode(name)
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--modes lists a mode twice: {text!r}")
    if BASELINE in names:
        names.remove(BASELINE)
    return [BASELINE] + names  # the baseline first


def time_to_target(history: list[dict[str, Any]], target: float) -> tuple[float | None, int | None]:
    """Wall seconds summed over epochs 1..k, for the first epoch k with ``test_acc >= target``."""
    elapsed = 0.0
    for m in history:
        elapsed += m["epoch_s"]
        if m.get("test_acc") is not None and m["test_acc"] >= target:
            return elapsed, m["epoch"]
    return None, None


def measure(name: str, base: TrainConfig, dataset, workdir: Path, warmup: int, final_window: int) -> dict[str, Any]:
    """Train ``base`` in mode ``name`` in a fresh run dir on the shared store."""
    mode, staleness, correction = parse_mode(name)
    config = TrainConfig.from_dict({**base.to_dict(), "mode": mode, "staleness": staleness,
                                    "stale_correction": correction, "run_dir": str(workdir / name)})
    start = time.perf_counter()
    summary = run_training(config, dataset, progress=io.StringIO())
    wall_s = time.perf_counter() - start
    history = read_metrics(config.run_dir)
    timed = history[warmup:] or history
    epoch_s = [m["epoch_s"] for m in timed]
    return {
        "mode": name, "scheduler": mode, "staleness_bound": staleness, "stale_correction": correction,
        "epoch_s_median": statistics.median(epoch_s),
        "epoch_s_mean": mean(epoch_s),
        "staleness_mean": mean([m.get("staleness_mean", 0.0) for m in history]),
        "staleness_max": max(m.get("staleness_max", 0) for m in history),
        "weight_lag_max": max(m.get("weight_lag_max", 0) for m in history),
        "relaunches": sum(m.get("relaunches", 0) for m in history),
        "failed_calls": sum(m.get("failed_calls", 0) for m in history),
        "cost_usd_mean": mean([m["cost_usd"] for m in timed]),
        "final_loss": history[-1]["loss"],
        "final_test_acc": summary["final_test_acc"],
        "last_test_acc_mean": mean([m["test_acc"] for m in history[-final_window:] if m.get("test_acc") is not None]),
        "best_val_acc": summary["best_val_acc"],
        "test_acc_at_best_val": summary["test_acc_at_best_val"],
        "gradients": summary.get("gradients"),
        "total_epoch_s": sum(m["epoch_s"] for m in history),
        # Everything run_training did besides the epochs: starting the roles, checkpoints.
        "overhead_s": wall_s - sum(m["epoch_s"] for m in history),
        "epochs": [{k: m.get(k) for k in ("epoch", "loss", "train_acc", "val_acc", "test_acc", "epoch_s",
                                          "staleness_max", "staleness_mean", "weight_lag_max", "relaunches",
                                          "failed_calls", "concurrency", "cost_usd")} for m in history],
    }


def add_targets(rows: list[dict[str, Any]], fraction: float) -> float:
    """Speedup vs sync and time to ``fraction`` x sync's final test accuracy, in place."""
    sync = rows[0]
    target = fraction * sync["final_test_acc"]
    for r in rows:
        r["speedup_vs_sync"] = sync["epoch_s_mean"] / r["epoch_s_mean"]
        r["test_acc_diff_vs_sync"] = r["final_test_acc"] - sync["final_test_acc"]
        r["last_test_acc_diff_vs_sync"] = r["last_test_acc_mean"] - sync["last_test_acc_mean"]
        r["time_to_target_s"], r["time_to_target_epoch"] = time_to_target(r["epochs"], target)
    return target


def goal_check(rows_by_seed: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Async S=1's speedup (the corrected run's if it ran, else the plain one's) and the corrected
    run's final test accuracy against sync's, each a mean over the seeds (with every seed's)."""
    speedups, diffs, mode = [], [], None
    for rows in rows_by_seed.values():
        corrected = next((r for r in rows if r["mode"] == f"{GOAL_MODE}1c"), None)
        row = corrected or next((r for r in rows if r["mode"] == f"{GOAL_MODE}1"), None)
        if row is None:
            return None
        mode = row["mode"]
        speedups.append(row["speedup_vs_sync"])
        if corrected:
            diffs.append(corrected["test_acc_diff_vs_sync"])
    speedup = mean(speedups)
    diff = mean(diffs) if diffs else None
    speed_ok = speedup >= GOAL_SPEEDUP
    acc_ok = abs(diff) <= GOAL_ACC_POINTS if diff is not None else None
    return {"goal": f"async S=1 at least {GOAL_SPEEDUP}x faster per epoch than sync; with --stale-correction its "
                    f"final test accuracy within 1 point of sync's", "mode": mode, "seeds": list(rows_by_seed),
            "speedup": speedup, "speedup_per_seed": speedups, "speedup_needed": GOAL_SPEEDUP,
            "test_acc_diff": diff, "test_acc_diff_per_seed": diffs,
            "test_acc_diff_spread": statistics.stdev(diffs) if len(diffs) > 1 else None,
            "test_acc_diff_allowed": GOAL_ACC_POINTS, "speed_ok": speed_ok, "accuracy_ok": acc_ok,
            "met": speed_ok and bool(acc_ok)}


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'mode':<8} {'s/epoch med':>11} {'mean':>6} {'speedup':>7} {'stale mean':>10} {'stale max':>9} {'lag max':>7} "
              f"{'relaunch':>8} {'final test':>10} {'d vs sync':>9} {'last-K':>7} {'d vs sync':>9} {'t->target s':>11} "
              f"{'@epoch':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        reached = r["time_to_target_s"] is not None
        ttt = f"{r['time_to_target_s']:11.2f}" if reached else f"{'not reached':>11}"
        at = f"{r['time_to_target_epoch']:6d}" if reached else f"{'-':>6}"
        print(f"{r['mode']:<8} {r['epoch_s_median']:11.3f} {r['epoch_s_mean']:6.3f} {r['speedup_vs_sync']:6.2f}x {r['staleness_mean']:10.3f} "
              f"{r['staleness_max']:9d} {r['weight_lag_max']:7d} {r['relaunches']:8d} {r['final_test_acc']:10.4f} "
              f"{r['test_acc_diff_vs_sync'] * 100:+8.2f}p {r['last_test_acc_mean']:7.4f} "
              f"{r['last_test_acc_diff_vs_sync'] * 100:+8.2f}p {ttt} {at}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", action="append", default=None,
                        help="dataset spec: a preset or a path; repeat for more (default: synthetic-1m and "
                             "../shared/data/cora.npz)")
    parser.add_argument("--modes", type=mode_list, default=mode_list(DEFAULT_MODES),
                        help=f"comma-separated modes: {mode_forms()}; {BASELINE} always runs first as the "
                             f"baseline (default: {DEFAULT_MODES})")
    parser.add_argument("--backend", choices=BENCH_BACKENDS, default="lambda",
                        help="where the tensor work runs (default: lambda, through the local emulator)")
    parser.add_argument("--parts", type=positive_int, default=2, help="graph servers / partitions (default: 2)")
    parser.add_argument("--intervals", type=positive_int, default=TrainConfig.intervals,
                        help=f"intervals per graph server (default: {TrainConfig.intervals})")
    parser.add_argument("--functions", type=positive_int, default=None,
                        help="concurrent calls per graph server (default: autotuned)")
    parser.add_argument("--aws-like", action=argparse.BooleanOptionalAction, default=True,
                        help="AWS Lambda's measured latencies, bandwidth and CPU share, and EC2's network and "
                             "compute jitter between graph servers (default: on)")
    parser.add_argument("--stale-gamma", type=float, default=TrainConfig.stale_gamma,
                        help=f"decay of the asyncSc modes' smoothing (default: {TrainConfig.stale_gamma})")
    parser.add_argument("--epochs", type=positive_int, default=30, help="epochs per mode, warm-up included (default: 30)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="first epochs left out of the epoch-time statistics (default: 1)")
    parser.add_argument("--target-fraction", type=float, default=0.95,
                        help="time-to-accuracy target as a fraction of sync's final test accuracy (default: 0.95)")
    parser.add_argument("--layers", type=positive_int, default=TrainConfig.layers, help="GCN layers (default: 2)")
    parser.add_argument("--hidden", type=positive_int, default=TrainConfig.hidden, help="hidden width (default: 16)")
    parser.add_argument("--seed", type=int, action="append", default=None,
                        help="partitioner, weight init and dropout seed; repeat for more, each running every mode "
                             "(default: 0)")
    parser.add_argument("--final-window", type=positive_int, default=10,
                        help="epochs at the end whose mean test accuracy is the last-K column (default: 10)")
    parser.add_argument("--workdir", default=None, help="parent of the temp store and run dirs (default: system temp dir)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result path, with one --dataset (default: benchmarks/results/modes-<dataset>.json)")
    args = parser.parse_args(argv)
    args.dataset = args.dataset or DEFAULT_DATASETS
    args.seed = args.seed or [0]
    if len(set(args.seed)) != len(args.seed):
        parser.error(f"--seed repeats a seed: {args.seed}")
    if args.final_window > args.epochs:
        parser.error(f"--final-window {args.final_window} exceeds --epochs {args.epochs}")
    if not 0 <= args.warmup < args.epochs:
        parser.error(f"--warmup must be in [0, --epochs), got {args.warmup} with --epochs {args.epochs}")
    if not 0 < args.target_fraction <= 1:
        parser.error(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    if not 0 <= args.stale_gamma < 1:
        parser.error(f"--stale-gamma must be in [0, 1), got {args.stale_gamma}")
    if args.output is not None and len(args.dataset) > 1:
        parser.error("--output takes one --dataset")
    return [bench_dataset(spec, args) for spec in args.dataset]


def bench_dataset(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    name = Path(spec).stem
    output = args.output or RESULTS / f"modes-{name}.json"
    load_before = os.getloadavg()
    print(f"modes benchmark: {spec}, backend {args.backend}{' (aws-like)' if args.aws_like else ''}, {args.parts} "
          f"parts x {args.intervals} intervals, modes {','.join(args.modes)}, {args.epochs} epochs each, seeds "
          f"{','.join(map(str, args.seed))}; torch {torch.__version__}, {os.cpu_count()} cpus, load average "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    dataset = load_dataset(spec)
    print(f"  {dataset.name}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, "
          f"{dataset.num_features} features, {dataset.num_classes} classes", flush=True)
    runs = [bench_seed(spec, dataset, seed, args) for seed in args.seed]
    goal = goal_check({run["seed"]: run["modes"] for run in runs})
    load_after = os.getloadavg()
    base = runs[0]["base"]

    print(f"{dataset.name}, {args.parts} parts x {args.intervals} intervals, backend {args.backend}"
          f"{' (aws-like)' if args.aws_like else ''}, {base.layers}-layer GCN hidden {base.hidden}; "
          f"{args.epochs} epochs per mode, s/epoch = median after {args.warmup} warm-up epoch(s).")
    print("Every epoch includes the evaluation forward pass (eval_every=1). speedup = sync mean s/epoch / mode's; "
          "stale mean/max and lag max over all epochs; c = --stale-correction;")
    print(f"t->target = seconds summed over epochs until test acc >= {args.target_fraction:g} x sync final; "
          f"d vs sync = final test acc minus sync's, in points; last-K = mean test acc of the last "
          f"{args.final_window} epochs.")
    for run in runs:
        print(f"\nseed {run['seed']} (target test acc {run['target_test_acc']:.4f}):")
        print_table(run["modes"])
    print()
    if goal is not None:
        accuracy = ("not measured (no async1c)" if goal["accuracy_ok"] is None else
                    f"{goal['test_acc_diff'] * 100:+.2f} points (per seed "
                    f"{', '.join(f'{d * 100:+.2f}' for d in goal['test_acc_diff_per_seed'])}; within "
                    f"{GOAL_ACC_POINTS * 100:g}) {'OK' if goal['accuracy_ok'] else 'NOT MET'}")
        over = f" (mean of {len(args.seed)} seeds)" if len(args.seed) > 1 else ""
        print(f"goal{over}: {goal['goal']}: {goal['mode']} speedup {goal['speedup']:.2f}x (need {GOAL_SPEEDUP}x) "
              f"{'OK' if goal['speed_ok'] else 'NOT MET'}, accuracy {accuracy}: {'MET' if goal['met'] else 'NOT MET'}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus, shared: "
          f"timings are noisy)")

    result = {
        "benchmark": "modes", "dataset": spec, "dataset_name": dataset.name,
        "num_nodes": dataset.num_nodes, "num_edges": dataset.num_edges, "num_features": dataset.num_features,
        "num_classes": dataset.num_classes, "epochs": args.epochs, "warmup_epochs": args.warmup,
        "final_window": args.final_window,
        "timed": "epoch_s = wall time of one training step including the evaluation forward pass (eval_every=1); "
                 "s/epoch statistics over the epochs after the warm-up; staleness, lag, time to target over all",
        "target_fraction": args.target_fraction,
        "graph_server_physics": dataclasses.asdict(base.graph_server_physics()),
        "config": {**base.to_dict(), "mode": None, "staleness": None, "stale_correction": None, "partitions": None,
                   "run_dir": None, "seed": None},
        "seeds": [{k: v for k, v in run.items() if k != "base"} for run in runs], "goal": goal,
        "machine": machine_info(load_before, load_after),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(result, output)
    print(f"wrote {output}\n", flush=True)
    return result


def bench_seed(spec: str, dataset, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every mode of ``args`` with ``seed``, on one METIS partition store made with that seed."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-modes-", dir=args.workdir) as workdir:
        store_path = Path(workdir) / "store"
        start = time.perf_counter()
        parts = assign_parts(dataset.num_nodes, dataset.src, dataset.dst, args.parts, "metis", seed=seed)
        write_store(dataset, parts, store_path, method="metis", seed=seed)
        store_fingerprint = open_store(store_path, verify=True).fingerprint()
        partition_s = time.perf_counter() - start
        print(f"  seed {seed}: partitioned once (METIS, {args.parts} parts) in {partition_s:.1f} s; every mode "
              "trains on this store", flush=True)
        base = TrainConfig(dataset=spec, backend=args.backend, partitions=str(store_path), parts=args.parts,
                           partition_method="metis", intervals=args.intervals, functions=args.functions,
                           aws_like=args.aws_like, stale_gamma=args.stale_gamma, layers=args.layers,
                           hidden=args.hidden, seed=seed, epochs=args.epochs, eval_every=1,
                           checkpoint_every=args.epochs)
        for mode in args.modes:
            row = measure(mode, base, dataset, Path(workdir), args.warmup, args.final_window)
            rows.append(row)
            print(f"  seed {seed} {mode}: {row['epoch_s_median']:.3f} s/epoch (median), final test acc "
                  f"{row['final_test_acc']:.4f}, {row['total_epoch_s']:.1f} s in epochs + {row['overhead_s']:.1f} s "
                  f"outside", flush=True)
    target = add_targets(rows, args.target_fraction)
    return {"seed": seed, "base": base, "target_test_acc": target, "modes": rows,
            "partition": {"method": "metis", "parts": args.parts, "seed": seed, "seconds": partition_s,
                          "store_sha256": store_fingerprint, "note": "partitioned once, outside every timing; every "
                                                                    "mode trains on the same store"}}


if __name__ == "__main__":  # required: the emulator's workers are started with 'spawn' and re-import main
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_modes: {e}")
