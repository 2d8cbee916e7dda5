"""Dense input features: Dorylus's backends beside DGL's and PyG's full-graph GCN, in one run.

Issue 19 measured that the ``lambda``/``cpu`` ratio on ``synthetic-1m`` (features 7.5% non-zero)
does not carry to dense features, and compared the ``cpu`` backend with DGL ``GraphConv`` on one
graph server. This benchmark builds that job: a graph with ``--nodes`` vertices and ``--edges``
directed edges (the ``synthetic`` generator's structure: communities, power-law degrees) whose
features are *dense* (every entry non-zero: class centroid plus uniform noise), and times, side
by side on the same machine and threads:

* ``dorylus cpu`` with 1 part (one graph server using every core) and with ``--parts`` parts,
* ``dorylus lambda`` with ``--parts`` parts (the local emulator),
* the single-process ``reference``,
* DGL ``GraphConv`` and PyG ``GCNConv`` (2-layer GCN, same hidden width, dropout and Adam), when
  installed (DGL 2.1.0: ``pip install --no-deps dgl==2.1.0 torchdata==0.7.1`` plus pandas, scipy,
  networkx, requests, tqdm, psutil, pydantic, pyyaml; its own requirements pull CUDA).

An epoch is one training step (forward with dropout, loss, backward, optimizer step), without the
evaluation pass (``eval_every`` = the number of epochs, so only the last epoch evaluates and it
is dropped from the statistics). The first ``--warmup`` epochs are dropped as well. Figures are
medians over the timed epochs; the ratios the issue asks about are printed under the table.

    python benchmarks/bench_dense.py
    python benchmarks/bench_dense.py --nodes 50000 --edges 1000000 --features 128 --epochs 10

``--rounds R`` runs the systems in turn R times: each median is over every round, and each
ratio is also given per round, whose two systems ran within a minute of each other (this
benchmark's machine drifts by a third within minutes).

Prints a table and writes ``benchmarks/results/dense-<nodes>-<edges>.json`` (``--output``). For
Dorylus's distributed systems the table also gives per timed epoch (medians) the stage calls the
graph servers made (``calls``), how many of them were function invocations (``invocations``,
what Lambda bills; a stage with element-wise work only runs on the graph server) and the tensor
megabytes to and from functions: counts that the shared machine's load does not blur.
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
from typing import Any, Callable

import numpy as np
import torch

from dorylus.config import TrainConfig
from dorylus.data.graph import GraphDataset
from dorylus.data.synthetic import SyntheticSpec, generate
from dorylus.errors import DorylusError
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("reference", "cpu-1", "cpu", "lambda", "dgl", "pyg")


def dense_graph(nodes: int, edges: int, features: int, classes: int, seed: int) -> GraphDataset:
    """The synthetic generator's graph with dense ``float32 [N, F]`` features: each row is its
    class's centroid plus uniform noise on ``[0, 1)``, so no entry is zero (nor negative: the
    Planetoid recipe divides each row by its sum) and the features carry the label weakly
    enough to leave the graph something to add."""
    spec = SyntheticSpec(name=f"dense-{nodes}-{edges}", num_nodes=nodes, num_edges=edges, num_features=1,
                         num_classes=classes)
    graph = generate(spec, seed=seed)
    rng = np.random.default_rng(seed)
    centroids = rng.random((classes, features), dtype=np.float32) * np.float32(0.3)
    dense = rng.random((nodes, features), dtype=np.float32)
    dense += centroids[graph.labels]
    return dataclasses.replace(graph, features=dense)


def dorylus_epochs(backend: str, parts: int | None, dataset: GraphDataset, config: TrainConfig,
                   workdir: Path) -> list[dict[str, Any]]:
    """The metrics of each training-only epoch (``epoch_s``, ``calls``, ``invocations``, ``bytes``)."""
    run_dir = workdir / f"{backend}-{parts}"
    run = dataclasses.replace(config, backend=backend, parts=parts, run_dir=str(run_dir))
    run_training(run, dataset, progress=io.StringIO())
    return [m for m in read_metrics(run_dir) if m.get("val_acc") is None]


def library_epochs(kind: str, dataset: GraphDataset, config: TrainConfig) -> list[float]:
    """Per-epoch seconds of a 2-layer GCN of DGL (``GraphConv``, ``norm='both'``) or PyG
    (``GCNConv``) on the whole graph with self loops, Adam with weight decay on layer 0."""
    torch.manual_seed(config.seed)
    x = torch.from_numpy(dataset.features)
    y = torch.from_numpy(dataset.labels)
    train = torch.from_numpy(dataset.train_mask)
    src, dst = torch.from_numpy(dataset.src), torch.from_numpy(dataset.dst)
    if not dataset.directed:
        src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    widths = (dataset.num_features, config.hidden, dataset.num_classes)
    if kind == "dgl":
        import dgl
        from dgl.nn import GraphConv

        graph = dgl.add_self_loop(dgl.remove_self_loop(dgl.graph((src, dst), num_nodes=dataset.num_nodes)))
        layers = torch.nn.ModuleList(GraphConv(a, b, norm="both") for a, b in zip(widths, widths[1:]))
        conv: Callable = lambda layer, h: layer(graph, h)
    else:
        from torch_geometric.nn import GCNConv

        edge_index = torch.stack([src, dst])
        layers = torch.nn.ModuleList(GCNConv(a, b, cached=True) for a, b in zip(widths, widths[1:]))
        conv = lambda layer, h: layer(h, edge_index)
    optimizer = torch.optim.Adam([{"params": layers[0].parameters(), "weight_decay": config.weight_decay},
                                  {"params": layers[1].parameters(), "weight_decay": 0.0}], lr=config.lr)
    times = []
    for _ in range(config.epochs):
        start = time.perf_counter()
        h = torch.nn.functional.dropout(x, config.dropout, training=True)
        h = torch.relu(conv(layers[0], h))
        h = torch.nn.functional.dropout(h, config.dropout, training=True)
        loss = torch.nn.functional.cross_entropy(conv(layers[1], h)[train], y[train])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def available(kind: str) -> bool:
    try:
        __import__({"dgl": "dgl.nn", "pyg": "torch_geometric.nn"}[kind])
        return True
    except Exception:  # DGL built for another torch fails in many ways at import
        return False


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=positive_int, default=50_000, help="vertices (default: 50,000)")
    parser.add_argument("--edges", type=positive_int, default=1_000_000,
                        help="directed edges, even: both ways of each undirected edge (default: 1,000,000)")
    parser.add_argument("--features", type=positive_int, default=128, help="dense feature width (default: 128)")
    parser.add_argument("--classes", type=positive_int, default=16, help="classes (default: 16)")
    parser.add_argument("--parts", type=positive_int, default=2, help="graph servers of cpu and lambda (default: 2)")
    parser.add_argument("--intervals", type=positive_int, default=2, help="intervals per graph server (default: 2)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="timed epochs (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="epochs run first and dropped (default: 2)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; dgl and pyg when installed)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="run the systems in turn this many times; each system's median is over every "
                             "round's timed epochs, and each ratio is also given per round (systems side by "
                             "side within a minute), against a machine whose speed drifts (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="graph and model seed (default: 0)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result path (default: benchmarks/results/dense-<nodes>-<edges>.json)")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems takes a subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    if args.warmup < 0 or args.edges % 2:
        parser.error("--warmup must be >= 0 and --edges even")
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    print(f"dense benchmark: {args.nodes:,} vertices, {args.edges:,} edges, {args.features} dense features; "
          f"{args.warmup} warm-up + {args.epochs} timed epochs; torch {torch.__version__}, {threads} threads, "
          f"load average {load_before[0]:.2f}", flush=True)
    dataset = dense_graph(args.nodes, args.edges, args.features, args.classes, args.seed)
    epochs = args.warmup + args.epochs
    config = TrainConfig(dataset=dataset.name, intervals=args.intervals, epochs=epochs + 1, eval_every=epochs + 1,
                         seed=args.seed, sparse_features="off")
    timed: dict[str, list[list[float]]] = {}  # system -> each round's timed epochs
    counts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dense-") as workdir:
        for round_ in range(args.rounds):
            for system in systems:
                if system in ("dgl", "pyg"):
                    if not available(system):
                        if round_ == 0:
                            print(f"  {system}: not installed, skipped", flush=True)
                        continue
                    times = library_epochs(system, dataset, dataclasses.replace(config, epochs=epochs))
                else:
                    backend, parts = {"reference": ("reference", None), "cpu-1": ("cpu", 1)}.get(system, (system, args.parts))
                    metrics = dorylus_epochs(backend, parts, dataset, config, Path(workdir) / f"round-{round_}")
                    times = [m["epoch_s"] for m in metrics]
                    counted = metrics[args.warmup:args.warmup + args.epochs]
                    if system != "reference":
                        # Counts, robust where timings are not: stage calls the graph servers made, calls
                        # that were function invocations (billed), tensor bytes to and from functions.
                        counts[system] = {k: statistics.median(m.get(k, 0) for m in counted)
                                          for k in ("calls", "invocations")}
                        counts[system]["function_mb"] = statistics.median(
                            m.get("bytes", {}).get("functions", 0) for m in counted) / 1e6
                timed.setdefault(system, []).append(times[args.warmup:args.warmup + args.epochs])
                print(f"  {system}: {statistics.median(timed[system][-1]):.3f} s/epoch (median"
                      + (f", round {round_ + 1})" if args.rounds > 1 else ")"), flush=True)
    rows = [{"system": system, "epoch_s_median": statistics.median(t for r in rounds for t in r),
             "epoch_s": rounds if args.rounds > 1 else rounds[0], **counts.get(system, {})}
            for system, rounds in timed.items()]
    load_after = os.getloadavg()
    by = {r["system"]: r["epoch_s_median"] for r in rows}
    ratios, per_round = {}, {}
    for name, (a, b) in {"lambda_over_cpu": ("lambda", "cpu"), "cpu1_over_dgl": ("cpu-1", "dgl"),
                         "cpu1_over_pyg": ("cpu-1", "pyg")}.items():
        if a in by and b in by:
            ratios[name] = by[a] / by[b]
            per_round[name] = [statistics.median(x) / statistics.median(y) for x, y in zip(timed[a], timed[b])]

    print()
    print(f"{'system':<10} {'s/epoch (median)':>16} {'calls':>6} {'invocations':>11} {'function MB':>11}  (per epoch)")
    for r in rows:
        counts = (f" {r['calls']:6g} {r['invocations']:11g} {r['function_mb']:11.1f}" if "calls" in r else "")
        print(f"{r['system']:<10} {r['epoch_s_median']:16.3f}{counts}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}" + (f" (per round: {', '.join(f'{r:.2f}' for r in per_round[name])})"
                                        if args.rounds > 1 else ""))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cpus)")
    result = {"benchmark": "dense", "nodes": args.nodes, "edges": args.edges, "features": args.features,
              "classes": args.classes, "parts": args.parts, "intervals": args.intervals,
              "warmup_epochs": args.warmup, "timed_epochs": args.epochs, "rounds": args.rounds,
              "ratios_per_round": per_round,
              "timed": "one training step (no evaluation pass); median over the timed epochs",
              "systems": rows, "ratios": ratios, "machine": machine_info(load_before, load_after),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    output = args.output or RESULTS / f"dense-{args.nodes}-{args.edges}.json"
    write_json(result, output)
    print(f"wrote {output}")
    return result


if __name__ == "__main__":  # required: the emulator's workers are started with 'spawn' and re-import main
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_dense: {e}")
