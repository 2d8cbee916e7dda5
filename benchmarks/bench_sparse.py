"""Sparse input features: epoch time with dense and with sparse (CSR) features, against PyG.

The graph (seeded): 20,000 vertices and 300,000 directed edges from the synthetic generator's
degree-corrected block model (10 classes), with 4,096 features at 1% density: each vertex gets
``Binomial(4096, 0.01)`` distinct random columns with ``U(0, 1)`` values, row-normalized as in
the Planetoid recipe. The model: GCN, 2 layers, hidden 16, dropout 0.5 on the features and the
hidden layer, Adam lr 0.01, weight decay on layer 0 (``TrainConfig`` defaults).

Each system's ``train step`` (forward with dropout, loss, backward, Adam step) is timed per
epoch, with the same torch thread count for all; the systems alternate epoch by epoch so that
load from other jobs falls on all alike, and the first ``--warmup`` epochs are not counted.

* ``reference dense`` / ``reference sparse``: ``ReferenceTrainer.step`` with
  ``sparse_features=off`` / ``on`` (layer 0 as torch's dense matmul, or as CSR x dense with the
  dropout mask drawn at the non-zeros only).
* ``pyg dense X``: PyG's ``GCNConv(cached=True, bias=False)`` on ``edge_index`` with dense
  features and ``F.dropout``, as PyG users run it; our initial weights, checked by comparing
  eval-mode logits before timing.
* ``pyg sparse X``: the same model fed a torch sparse COO ``X`` whose values get the dropout
  (``F.dropout`` does not take sparse tensors); ``GCNConv``'s linear layer then multiplies it
  sparse and torch's sparse backward gives ``dW`` (``--skip-pyg-sparse`` leaves it out).
* ``cpu fn dense`` / ``cpu fn sparse``: the ``cpu`` backend's layer-0 function work alone,
  ``gcn.compute`` of ``AV`` (dropout, ``H W``) and ``AV_BWD`` (dropout again, ``dW = H^T dP``)
  on all 20,000 rows, numpy: what the graph servers or Lambda functions spend on ``X`` per epoch.

The goal (issue 8): the sparse reference at most 0.5x PyG's epoch.

    python benchmarks/bench_sparse.py
    python benchmarks/bench_sparse.py --epochs 10 --threads 1

Prints a table and writes ``benchmarks/results/sparse.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from common import machine_info, positive_int, write_json
from dorylus.config import TrainConfig
from dorylus.data.graph import GraphDataset
from dorylus.data.synthetic import SyntheticSpec, generate
from dorylus.models import gcn
from dorylus.models.sparse import SparseRows
from dorylus.models.spec import ModelSpec
from dorylus.coordinator.training import PreparedGraph, ReferenceTrainer, prepare_graph

RESULTS = Path(__file__).resolve().parent / "results"
PARITY_TOLERANCE = 1e-4  # max |logit difference| at init: float32 sums in another order

try:
    import torch_geometric
    from torch_geometric.nn import GCNConv

    PYG_VERSION: str | None = torch_geometric.__version__
except ImportError:
    PYG_VERSION = None


def make_graph(num_nodes: int, num_edges: int, num_features: int, density: float, seed: int) -> GraphDataset:
    """The benchmark graph (see the module docstring); the CSR features are drawn directly, so no
    ``N x F`` float64 or mask array is ever built."""
    structure = generate(SyntheticSpec(name="sparse-bench", num_nodes=num_nodes, num_edges=num_edges,
                                       num_features=1, num_classes=10), seed=seed)
    rng = np.random.default_rng([seed, 1])
    counts = rng.binomial(num_features, density, num_nodes)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    columns = np.concatenate([np.sort(rng.choice(num_features, c, replace=False)) for c in counts]).astype(np.int32)
    values = rng.uniform(0.0, 1.0, int(indptr[-1])).astype(np.float32) + np.float32(1e-3)  # never 0
    features = SparseRows(values, columns, indptr, (num_nodes, num_features)).toarray()
    return dataclasses.replace(structure, name=f"sparse-{num_nodes // 1000}k-{num_features}f", features=features)


class PygGCN(torch.nn.Module):
    """The spec's GCN with ``GCNConv`` layers holding our initial weights: ``dropout -> conv -> relu``."""

    def __init__(self, spec: ModelSpec, initial: list[dict[str, np.ndarray]], sparse_x: bool):
        super().__init__()
        self.spec, self.sparse_x = spec, sparse_x
        self.convs = torch.nn.ModuleList(GCNConv(l.in_dim, l.out_dim, cached=True) for l in spec.layers)
        with torch.no_grad():
            for conv, params in zip(self.convs, initial):
                conv.lin.weight.copy_(torch.from_numpy(params["weight"]).t())  # Linear keeps W as [out, in]
                conv.bias.copy_(torch.from_numpy(params["bias"]))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for layer, conv in zip(self.spec.layers, self.convs):
            if x.is_sparse:  # F.dropout refuses sparse tensors: drop the stored values
                x = torch.sparse_coo_tensor(x.indices(), F.dropout(x.values(), layer.dropout, self.training),
                                            x.shape, is_coalesced=True, check_invariants=False)
            else:
                x = F.dropout(x, layer.dropout, training=self.training)
            x = conv(x, edge_index)
            if layer.activation == "relu":
                x = torch.relu(x)
        return x


class PygTrainer:
    def __init__(self, config: TrainConfig, graph: PreparedGraph, spec: ModelSpec, dense_x: np.ndarray,
                 sparse_x: bool):
        adj = graph.adjacency
        rows, cols = adj.rows(), adj.indices
        off_diagonal = rows != cols  # GCNConv adds the self loops itself
        self.edge_index = torch.from_numpy(np.stack([cols[off_diagonal], rows[off_diagonal]]))
        x = torch.from_numpy(dense_x)
        self.features = x.to_sparse_coo().coalesce() if sparse_x else x
        data = graph.dataset
        self.labels, self.train_mask = torch.from_numpy(data.labels), torch.from_numpy(data.train_mask)
        torch.manual_seed(config.seed)
        self.model = PygGCN(spec, spec.init_params(config.seed), sparse_x)
        groups = [{"params": conv.parameters(), "weight_decay": layer.weight_decay}
                  for layer, conv in zip(spec.layers, self.model.convs)]
        self.optimizer = torch.optim.Adam(groups, lr=config.lr)

    def step(self, epoch: int) -> None:
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


class FunctionWork:
    """Layer 0's function work of one epoch on every row: ``AV`` then ``AV_BWD`` (``gcn.compute``)."""

    def __init__(self, spec: ModelSpec, x, seed: int):
        layer = spec.layers[0]
        assert gcn.projects_first(layer), "layer 0 must project first (4,096 -> 16)"
        self.x, self.ids = x, np.arange(x.shape[0], dtype=np.int64)
        self.params = spec.init_params(seed)[0]
        self.grad = np.random.default_rng(seed).standard_normal((x.shape[0], layer.out_dim)).astype(np.float32)
        self.args = {"dropout": layer.dropout, "act_in": None, "project_first": True, "seed": seed,
                     "training": True, "train_count": 1}

    def step(self, epoch: int) -> None:
        args = {**self.args, "epoch": epoch}
        gcn.compute("AV", 0, [self.x, self.ids], self.params, args)
        gcn.compute("AV_BWD", 0, [self.grad, self.grad, self.x, self.ids], self.params, args)  # dP, dY


def time_systems(systems: dict[str, Callable[[int], Any]], warmup: int, epochs: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for epoch in range(1, warmup + epochs + 1):
        for name, step in systems.items():
            start = time.perf_counter()
            step(epoch)
            if epoch > warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=positive_int, default=20_000, help="vertices (default: 20000)")
    parser.add_argument("--edges", type=positive_int, default=300_000, help="directed edges, even (default: 300000)")
    parser.add_argument("--features", type=positive_int, default=4096, help="feature columns (default: 4096)")
    parser.add_argument("--density", type=float, default=0.01, help="non-zero fraction of the features (default: 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="graph and model seed (default: 0)")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch threads for every system (default: all usable cores)")
    parser.add_argument("--epochs", type=positive_int, default=5, help="timed epochs (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs first (default: 1)")
    parser.add_argument("--skip-pyg-sparse", action="store_true", help="leave out PyG with a sparse X")
    parser.add_argument("--output", type=Path, default=RESULTS / "sparse.json", help="JSON result path")
    args = parser.parse_args(argv)
    if not 0.0 < args.density <= 1.0:
        parser.error(f"--density must be in (0, 1], got {args.density}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"sparse features benchmark: torch {torch.__version__}, PyG {PYG_VERSION}, {args.threads} threads, "
          f"load average {load_before[0]:.2f}", flush=True)
    start = time.perf_counter()
    dataset = make_graph(args.nodes, args.edges, args.features, args.density, args.seed)
    print(f"  {dataset.name}: generated in {time.perf_counter() - start:.1f} s", flush=True)
    config = TrainConfig(dataset=dataset.name, epochs=args.warmup + args.epochs + 1,
                         eval_every=args.warmup + args.epochs + 1, seed=args.seed)
    prepared = {mode: prepare_graph(dataset, dataclasses.replace(config, sparse_features=mode))
                for mode in ("off", "on")}
    sparse_x, dense_x = prepared["on"].features, prepared["off"].features
    assert isinstance(sparse_x, SparseRows) and isinstance(dense_x, np.ndarray)
    np.testing.assert_array_equal(sparse_x.toarray(), dense_x)  # same row-normalized values
    references = {mode: ReferenceTrainer(config, graph) for mode, graph in prepared.items()}
    spec = references["on"].spec
    systems: dict[str, Callable[[int], Any]] = {"reference dense": references["off"].step,
                                                "reference sparse": references["on"].step}
    parity = None
    if PYG_VERSION is not None:
        pyg = PygTrainer(config, prepared["off"], spec, dense_x, sparse_x=False)
        with torch.no_grad():
            ours = references["on"].model(references["on"].graph, references["on"].features, 0, training=False)
        parity = float((ours - pyg.logits()).abs().max())
        if parity > PARITY_TOLERANCE:
            print(f"WARNING: PyG and reference logits differ by {parity:.2e} at init: not the same model")
        systems["pyg dense X"] = pyg.step
        if not args.skip_pyg_sparse:
            systems["pyg sparse X"] = PygTrainer(config, prepared["off"], spec, dense_x, sparse_x=True).step
    else:
        print("torch_geometric is not importable: PyG rows are skipped")
    systems["cpu fn dense"] = FunctionWork(spec, dense_x, args.seed).step
    systems["cpu fn sparse"] = FunctionWork(spec, sparse_x, args.seed).step
    print(f"  timing {', '.join(systems)} ({args.warmup} warm-up + {args.epochs} epochs)...", flush=True)
    seconds = time_systems(systems, args.warmup, args.epochs)
    load_after = os.getloadavg()

    medians = {name: statistics.median(s) for name, s in seconds.items()}
    pyg_median = medians.get("pyg dense X")
    rows = [{"system": name, "ms_median": 1e3 * medians[name], "ms_per_epoch": [1e3 * s for s in seconds[name]],
             "ratio_vs_pyg": medians[name] / pyg_median if pyg_median else None} for name in systems]
    print(f"\n{dataset.name}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, {dataset.num_features:,} "
          f"features at density {sparse_x.density:.4f} ({sparse_x.nnz:,} non-zeros); GCN 2 layers hidden 16, "
          f"dropout 0.5; train step median over {args.epochs} epochs; ratio = system / PyG (dense X)")
    print(f"{'system':<18} {'ms/epoch':>10} {'x PyG':>7}")
    for row in rows:
        ratio = f"{row['ratio_vs_pyg']:.2f}" if row["ratio_vs_pyg"] is not None else "-"
        print(f"{row['system']:<18} {row['ms_median']:>10.1f} {ratio:>7}")
    if parity is not None:
        print(f"max |reference - PyG| eval logits at init = {parity:.1e}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus)")
    goal = medians["reference sparse"] / pyg_median if pyg_median else None
    if goal is not None:
        print(f"goal (sparse reference <= 0.5x PyG): {goal:.2f}x, {'met' if goal <= 0.5 else 'NOT met'}")

    result = {"benchmark": "sparse", "graph": {"name": dataset.name, "nodes": dataset.num_nodes,
                                               "edges": dataset.num_edges, "features": dataset.num_features,
                                               "density": sparse_x.density, "nnz": sparse_x.nnz, "seed": args.seed},
              "model": {"arch": "gcn", "layers": 2, "hidden": 16, "dropout": 0.5},
              "timed": "train step per epoch (forward with dropout, loss, backward, Adam); cpu fn rows: layer 0's "
                       "AV + AV_BWD gcn.compute on every row", "warmup": args.warmup, "epochs": args.epochs,
              "threads": args.threads, "pyg": PYG_VERSION, "parity_max_abs_logit_diff": parity,
              "goal_ratio_sparse_reference_vs_pyg": goal, "rows": rows,
              "machine": machine_info(load_before, load_after)}
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
