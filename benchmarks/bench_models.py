"""Epoch time per model (GCN, GAT, GraphSAGE): the single-process reference against PyTorch
Geometric's GCNConv / GATConv / SAGEConv, and the distributed ``cpu`` and ``lambda`` backends.

Models (no bias anywhere; PyG gets our initial weights, and the script checks that both give the
same eval-mode logits before timing):

* ``gcn``: 2 layers, hidden 16, dropout 0.5 (Kipf & Welling); PyG ``GCNConv(cached=True)``.
* ``gat``: 2 layers, 8 heads x 8 hidden (concatenated, ELU), 1 output head, dropout 0.6 on inputs
  and attention (Velickovic et al.); PyG ``GATConv`` (its attention dropout is ``dropout=``).
* ``sage``: 2 layers, hidden 16, mean aggregator with root weight, dropout 0.5; PyG
  ``SAGEConv(aggr="mean")``.

``train step`` is one forward with dropout, the loss, backward and an Adam step, with the same
torch thread count for both systems; they alternate epoch by epoch so that load from other jobs
falls on both alike. The ratio is reference / PyG (median; > 1: the reference is slower). The
goal (issue 8): at most 1.0x for every model.

With ``--backends cpu,lambda`` it also trains each model through ``dorylus train``'s engine
(``--parts`` graph servers x ``--intervals``, sync mode, evaluation off) and reports the median
training epoch, for the same model and graph.

    python benchmarks/bench_models.py                       # synthetic-1m, reference vs PyG
    python benchmarks/bench_models.py --backends cpu,lambda --engine-epochs 5
    python benchmarks/bench_models.py --dataset synthetic-small --models gat --epochs 10

Prints a table and writes ``benchmarks/results/models.json`` (``--output``).
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
import torch.nn.functional as F

from common import machine_info, positive_int, write_json
from dorylus.config import TrainConfig
from dorylus.data.loaders import load_dataset
from dorylus.models.sparse import to_dense
from dorylus.models.spec import ModelSpec
from dorylus.runs import read_metrics
from dorylus.coordinator.training import PreparedGraph, ReferenceTrainer, prepare_graph, run_training

RESULTS = Path(__file__).resolve().parent / "results"
PARITY_TOLERANCE = 1e-4  # max |logit difference| at init: float32 sums in another order
RECIPES = {
    "gcn": dict(model="gcn", hidden=16, dropout=0.5, input_dropout=0.5),
    "gat": dict(model="gat", hidden=8, heads=8, out_heads=1, dropout=0.6, input_dropout=0.6, attention_dropout=0.6,
                lr=0.005, weight_decay_scope="all"),
    "sage": dict(model="sage", hidden=16, dropout=0.5, input_dropout=0.5, weight_decay_scope="all"),
}

try:
    import torch_geometric
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    PYG_VERSION: str | None = torch_geometric.__version__
except ImportError:
    PYG_VERSION = None


class PygModel(torch.nn.Module):
    """``spec``'s layers as PyG convolutions (their default ``bias=True``) holding our initial
    parameters: ``dropout -> conv -> act``."""

    def __init__(self, spec: ModelSpec, initial: list[dict[str, np.ndarray]]):
        super().__init__()
        self.spec = spec
        self.convs = torch.nn.ModuleList()
        for layer, ours in zip(spec.layers, initial):
            w = {name: torch.from_numpy(value) for name, value in ours.items()}
            if spec.arch == "gcn":
                conv = GCNConv(layer.in_dim, layer.out_dim, cached=True)
                params = {conv.lin.weight: w["weight"].t(), conv.bias: w["bias"]}
            elif spec.arch == "sage":
                conv = SAGEConv(layer.in_dim, layer.out_dim, aggr="mean")
                params = {conv.lin_r.weight: w["weight_self"].t(), conv.lin_l.weight: w["weight_neigh"].t(),
                          conv.lin_l.bias: w["bias"]}
            else:
                conv = GATConv(layer.in_dim, layer.out_dim, heads=layer.heads, concat=layer.concat,
                               dropout=layer.attention_dropout)
                params = {conv.lin.weight: w["weight"].t(), conv.att_dst: w["att_dst"].view(1, layer.heads, -1),
                          conv.att_src: w["att_src"].view(1, layer.heads, -1), conv.bias: w["bias"]}
            with torch.no_grad():
                for param, value in params.items():
                    param.copy_(value)
            self.convs.append(conv)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for layer, conv in zip(self.spec.layers, self.convs):
            x = conv(F.dropout(x, layer.dropout, training=self.training), edge_index)
            if layer.activation is not None:
                x = {"relu": torch.relu, "elu": F.elu}[layer.activation](x)
        return x


class PygTrainer:
    def __init__(self, config: TrainConfig, graph: PreparedGraph, spec: ModelSpec):
        adj = graph.adjacency
        rows, cols = adj.rows(), adj.indices
        off_diagonal = rows != cols  # GCNConv and GATConv add self loops; SAGEConv's mean has none
        self.edge_index = torch.from_numpy(np.stack([cols[off_diagonal], rows[off_diagonal]]))
        self.features = torch.from_numpy(to_dense(graph.features))  # dense, as PyG users feed GCNConv
        data = graph.dataset
        self.labels, self.train_mask = torch.from_numpy(data.labels), torch.from_numpy(data.train_mask)
        self.model = PygModel(spec, spec.init_params(config.seed))
        groups = [{"params": conv.parameters(), "weight_decay": layer.weight_decay}
                  for layer, conv in zip(spec.layers, self.model.convs)]
        self.optimizer = torch.optim.Adam(groups, lr=config.lr)

    def step(self) -> None:
        self.model.train()
        logits = self.model(self.features, self.edge_index)
        loss = F.cross_entropy(logits[self.train_mask], self.labels[self.train_mask])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        self.model.eval()
        return self.model(self.features, self.edge_index)


def time_reference(dataset, config: TrainConfig, warmup: int, epochs: int) -> dict[str, Any]:
    graph = prepare_graph(dataset, config)
    no_eval = dataclasses.replace(config, epochs=warmup + epochs + 1, eval_every=warmup + epochs + 1)
    reference = ReferenceTrainer(no_eval, graph)
    systems: dict[str, Any] = {"reference": lambda epoch: reference.step(epoch)}
    parity = None
    if PYG_VERSION is not None:
        pyg = PygTrainer(no_eval, graph, reference.spec)
        with torch.no_grad():
            ours = reference.model(reference.graph, reference.features, 0, training=False)
        parity = float((ours - pyg.logits()).abs().max())
        if parity > PARITY_TOLERANCE:
            print(f"WARNING: {config.model}: PyG and reference logits differ by {parity:.2e}: not the same model")
        systems["pyg"] = lambda epoch: pyg.step()
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for epoch in range(1, warmup + epochs + 1):
        for name, step in systems.items():
            start = time.perf_counter()
            step(epoch)
            if epoch > warmup:
                seconds[name].append(time.perf_counter() - start)
    return {"parity_max_abs_logit_diff": parity, "seconds": seconds}


def time_engine(dataset, config: TrainConfig, backend: str, parts: int, intervals: int, epochs: int) -> list[float]:
    """Median-able training epoch seconds of ``dorylus train`` (evaluation off; first epoch dropped)."""
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        run = dataclasses.replace(config, backend=backend, parts=parts, intervals=intervals, epochs=epochs + 1,
                                  eval_every=epochs + 1, run_dir=str(Path(tmp) / "run"))
        run_training(run, dataset, progress=io.StringIO())
        metrics = read_metrics(Path(tmp) / "run")
    return [m["epoch_s"] for m in metrics[1:-1]] or [metrics[-1]["epoch_s"]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-1m", help="preset or path (default: synthetic-1m)")
    parser.add_argument("--models", default=",".join(RECIPES),
                        help=f"comma-separated, of the models with a PyG twin here (default: {','.join(RECIPES)})")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch threads for both systems (default: all usable cores)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="timed reference/PyG epochs (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed epochs first (default: 2)")
    parser.add_argument("--backends", default="", help="also time the engine: comma-separated cpu,lambda")
    parser.add_argument("--parts", type=positive_int, default=2, help="engine graph servers (default: 2)")
    parser.add_argument("--intervals", type=positive_int, default=2, help="engine intervals (default: 2)")
    parser.add_argument("--engine-epochs", type=positive_int, default=4, help="timed engine epochs (default: 4)")
    parser.add_argument("--output", type=Path, default=RESULTS / "models.json", help="JSON result path")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [m for m in models if m not in RECIPES] + [b for b in backends if b not in ("cpu", "lambda")]
    if unknown:
        parser.error(f"unknown model(s) or backend(s): {', '.join(unknown)}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"models benchmark on {args.dataset}: torch {torch.__version__}, PyG {PYG_VERSION}, {args.threads} threads, "
          f"load average {load_before[0]:.2f}", flush=True)
    dataset = load_dataset(args.dataset)
    rows: list[dict[str, Any]] = []
    for model in models:
        config = TrainConfig(dataset=args.dataset, **RECIPES[model])
        print(f"  {model}: reference vs PyG...", flush=True)
        timed = time_reference(dataset, config, args.warmup, args.epochs)
        medians = {name: statistics.median(s) for name, s in timed["seconds"].items()}
        for name, seconds in timed["seconds"].items():
            rows.append({"model": model, "system": name, "ms_median": 1e3 * medians[name],
                         "ms_per_epoch": [1e3 * s for s in seconds],
                         "ratio_vs_pyg": medians[name] / medians["pyg"] if "pyg" in medians else None,
                         "parity_max_abs_logit_diff": timed["parity_max_abs_logit_diff"]})
        for backend in backends:
            print(f"  {model}: {backend} backend, {args.parts} parts x {args.intervals} intervals...", flush=True)
            seconds = time_engine(dataset, config, backend, args.parts, args.intervals, args.engine_epochs)
            median = statistics.median(seconds)
            rows.append({"model": model, "system": f"{backend} {args.parts}x{args.intervals}",
                         "ms_median": 1e3 * median, "ms_per_epoch": [1e3 * s for s in seconds],
                         "ratio_vs_pyg": median / medians["pyg"] if "pyg" in medians else None})
    load_after = os.getloadavg()

    print(f"\n{dataset.name}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, {dataset.num_features} "
          f"features; training epoch (train step), median; ratio = system / PyG")
    print(f"{'model':<6} {'system':<14} {'ms/epoch':>10} {'x PyG':>7}")
    for row in rows:
        ratio = f"{row['ratio_vs_pyg']:.2f}" if row["ratio_vs_pyg"] is not None else "-"
        print(f"{row['model']:<6} {row['system']:<14} {row['ms_median']:>10.1f} {ratio:>7}")
    result = {"benchmark": "models", "dataset": args.dataset, "recipes": {m: RECIPES[m] for m in models},
              "threads": args.threads, "pyg": PYG_VERSION, "warmup": args.warmup, "epochs": args.epochs,
              "engine": {"backends": backends, "parts": args.parts, "intervals": args.intervals,
                         "epochs": args.engine_epochs},
              "rows": rows, "machine": machine_info(load_before, load_after)}
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
