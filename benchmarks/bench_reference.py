"""Epoch time and accuracy of the single-process reference trainer, against PyTorch Geometric.

Timing. Both systems train the same model on the same graph with the same torch thread count:
a GCN (default 2 layers, hidden 16) ``H' = act(A_hat · dropout(H) · W)`` with no bias,
dropout 0.5, Adam lr 0.01, weight decay on the first layer only, row-normalized features.
PyG runs ``GCNConv(cached=True, normalize=True, bias=False)`` on our symmetrized edge set (the
off-diagonal entries of our ``A_hat``); its ``gcn_norm`` with self loops is then our ``A_hat``,
which the script checks by copying our initial weights into PyG and comparing eval-mode logits.

Per epoch it times two things, for each system:

* ``train step``: forward with dropout, loss, backward, Adam step. For the reference this is
  ``ReferenceTrainer.step`` with evaluation switched off (``eval_every`` beyond the last epoch).
* ``step+eval``: the train step plus one evaluation pass (forward without dropout, train/val/test
  accuracy; ``ReferenceTrainer.evaluate``), as ``dorylus train`` does every epoch by default.

The two systems alternate epoch by epoch, so that load from other jobs on a shared machine falls
on both alike. The first ``--warmup`` epochs are not counted; median and mean are over the next
``--epochs``. The ratio is reference time / PyG time (> 1: the reference is slower).

Accuracy. The Planetoid recipe (``TrainConfig`` defaults: 200 epochs, eval every epoch) on Cora
for seeds 0..4, and on synthetic-small for seed 0; final test accuracy per seed, mean and sample
std.
PyG trains the same recipe from the same initial weights (its dropout draws differ) as a check.

    python benchmarks/bench_reference.py
    python benchmarks/bench_reference.py --datasets cora,/path/graph.npz --threads 1 --epochs 100
    python benchmarks/bench_reference.py --datasets synthetic-small --skip-accuracy

Prints the tables and writes ``benchmarks/results/reference.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dorylus.config import TrainConfig
from dorylus.data.graph import GraphDataset
from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.models.reference import accuracy
from dorylus.models.sparse import to_dense
from dorylus.models.spec import ModelSpec
from dorylus.coordinator.training import PreparedGraph, ReferenceTrainer, prepare_graph, summarize
from common import positive_int, write_json

CORA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cora.npz"  # ../shared/data beside the checkout
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_DATASETS = "cora,synthetic-small,synthetic-1m"
PARITY_TOLERANCE = 1e-4  # max |logit difference| at init; float32 sums in a different order

try:
    from torch_geometric.nn import GCNConv
    import torch_geometric

    PYG_VERSION: str | None = torch_geometric.__version__
except ImportError:
    GCNConv = None
    PYG_VERSION = None


def resolve_spec(spec: str) -> str | None:
    """A dataset spec as ``load_dataset`` takes it; ``None`` (with a message) to skip it."""
    if spec != "cora":
        return spec
    if CORA.is_file():
        return str(CORA)
    print(f"skipping cora: {CORA} not found")
    return None


def display_name(spec: str) -> str:
    """Short name for tables: a preset's name, or a path's file name without extension."""
    return Path(spec).stem


def describe(spec: str, dataset: GraphDataset) -> dict[str, Any]:
    """What was measured; a preset's generator parameters too, since presets get retuned."""
    from dorylus.data import synthetic

    info = {"spec": spec, "name": dataset.name, "num_nodes": dataset.num_nodes, "num_edges": dataset.num_edges,
            "num_features": dataset.num_features, "num_classes": dataset.num_classes, "directed": dataset.directed,
            "train_vertices": int(dataset.train_mask.sum())}
    if spec in synthetic.PRESETS:
        info["preset"] = dataclasses.asdict(synthetic.PRESETS[spec])
    return info


def std(values: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


# --------------------------------------------------------------------------------------------
# PyG model


class PygGCN(torch.nn.Module):
    """The model of ``spec`` with ``GCNConv`` layers (bias after aggregation, as ours):
    ``dropout -> conv -> relu`` per layer."""

    def __init__(self, spec: ModelSpec, initial: list[dict[str, np.ndarray]]):
        super().__init__()
        self.spec = spec
        self.convs = torch.nn.ModuleList(
            GCNConv(layer.in_dim, layer.out_dim, cached=True, normalize=True) for layer in spec.layers
        )
        with torch.no_grad():
            for conv, params in zip(self.convs, initial):
                conv.lin.weight.copy_(torch.from_numpy(params["weight"]).t())  # Linear keeps W as [out, in]
                conv.bias.copy_(torch.from_numpy(params["bias"]))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for layer, conv in zip(self.spec.layers, self.convs):
            x = F.dropout(x, layer.dropout, training=self.training)
            x = conv(x, edge_index)
            if layer.activation == "relu":
                x = torch.relu(x)
        return x


class PygTrainer:
    """Same interface as ``ReferenceTrainer`` (``step`` without eval, ``evaluate``), for PyG."""

    def __init__(self, config: TrainConfig, graph: PreparedGraph):
        data = graph.dataset
        self.spec = ModelSpec.from_config(config, data.num_features, data.num_classes)
        adj = graph.adjacency
        rows, cols = adj.rows(), adj.indices
        off_diagonal = rows != cols  # GCNConv adds the self loops itself
        # Row v of A_hat lists the sources u of u -> v; PyG's edge_index is [source; target].
        self.edge_index = torch.from_numpy(np.stack([cols[off_diagonal], rows[off_diagonal]]))
        self.features = torch.from_numpy(to_dense(graph.features))  # PyG users keep features dense
        self.labels = torch.from_numpy(data.labels)
        self.masks = {name: torch.from_numpy(getattr(data, f"{name}_mask")) for name in ("train", "val", "test")}
        torch.manual_seed(config.seed)
        self.model = PygGCN(self.spec, self.spec.init_params(config.seed))
        groups = [{"params": conv.parameters(), "weight_decay": layer.weight_decay}
                  for layer, conv in zip(self.spec.layers, self.model.convs)]
        self.optimizer = torch.optim.Adam(groups, lr=config.lr)

    def step(self) -> float:
        self.model.train()
        logits = self.model(self.features, self.edge_index)
        mask = self.masks["train"]
        loss = F.cross_entropy(logits[mask], self.labels[mask])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        self.model.eval()
        return self.model(self.features, self.edge_index)

    def evaluate(self) -> dict[str, float]:
        logits = self.logits()
        return {f"{name}_acc": accuracy(logits, self.labels, mask) for name, mask in self.masks.items()}


# --------------------------------------------------------------------------------------------
# timing


def time_epochs(dataset: GraphDataset, config: TrainConfig, warmup: int, epochs: int) -> dict[str, Any]:
    """Per-epoch seconds of ``train step`` and ``step+eval`` for the reference and for PyG."""
    graph = prepare_graph(dataset, config)
    # Evaluation is timed separately: step() must never evaluate by itself.
    no_eval = dataclasses.replace(config, epochs=warmup + epochs + 1, eval_every=warmup + epochs + 1)
    systems: dict[str, Any] = {"reference": ReferenceTrainer(no_eval, graph)}
    parity = None
    if GCNConv is not None:
        systems["pyg"] = PygTrainer(no_eval, graph)
        ours = systems["reference"].model(systems["reference"].graph, systems["reference"].features, 0, training=False)
        parity = float((ours.detach() - systems["pyg"].logits()).abs().max())
        if parity > PARITY_TOLERANCE:
            print(f"WARNING: PyG and reference logits differ by {parity:.2e} at init: not the same model")
    seconds = {name: {"train": [], "eval": []} for name in systems}
    for epoch in range(1, warmup + epochs + 1):
        for name, trainer in systems.items():
            start = time.perf_counter()
            trainer.step(epoch) if name == "reference" else trainer.step()
            mid = time.perf_counter()
            trainer.evaluate(epoch) if name == "reference" else trainer.evaluate()
            end = time.perf_counter()
            if epoch > warmup:
                seconds[name]["train"].append(mid - start)
                seconds[name]["eval"].append(end - mid)
    return {"num_edges_symmetrized": graph.adjacency.nnz - dataset.num_nodes,
            "parity_max_abs_logit_diff": parity, "seconds": seconds}


def timing_rows(name: str, dataset: GraphDataset, timed: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    rows = []
    for system, per_epoch in timed["seconds"].items():
        for what, seconds in (("train step", per_epoch["train"]),
                              ("step+eval", [t + e for t, e in zip(per_epoch["train"], per_epoch["eval"])])):
            ms = [1e3 * s for s in seconds]
            rows.append({"dataset": name, "nodes": dataset.num_nodes, "edges": timed["num_edges_symmetrized"],
                         "system": system, "timed": what, "threads": threads,
                         "ms_median": statistics.median(ms), "ms_mean": statistics.fmean(ms), "ms_per_epoch": ms})
    pyg = {r["timed"]: r["ms_median"] for r in rows if r["system"] == "pyg"}
    for row in rows:
        row["ratio_vs_pyg"] = row["ms_median"] / pyg[row["timed"]] if pyg else None
    return rows


# --------------------------------------------------------------------------------------------
# accuracy


def train_accuracy(dataset: GraphDataset, config: TrainConfig) -> dict[str, Any]:
    """The full recipe for one seed: reference summary, and PyG's final accuracies."""
    graph = prepare_graph(dataset, config)
    reference = ReferenceTrainer(config, graph)
    history = [reference.step(epoch) for epoch in range(1, config.epochs + 1)]
    result: dict[str, Any] = {"seed": config.seed, "reference": summarize(history)}
    if GCNConv is not None:
        pyg = PygTrainer(config, graph)
        for _ in range(config.epochs):
            pyg.step()
        result["pyg"] = pyg.evaluate()
    return result


def accuracy_section(datasets: dict[str, tuple[str, list[int]]], threads: int,
                     cache: dict[str, GraphDataset]) -> list[dict[str, Any]]:
    sections = []
    for name, (spec, seeds) in datasets.items():
        if spec not in cache:
            cache[spec] = load_dataset(spec)
        dataset = cache[spec]
        config = TrainConfig(dataset=spec)
        runs = [train_accuracy(dataset, dataclasses.replace(config, seed=seed)) for seed in seeds]
        ours = [r["reference"]["final_test_acc"] for r in runs]
        theirs = [r["pyg"]["test_acc"] for r in runs if "pyg" in r]
        sections.append({
            "dataset": name, "data": describe(spec, dataset), "threads": threads, "config": config.to_dict(),
            "seeds": seeds, "runs": runs,
            "reference_final_test_acc": ours, "reference_mean": statistics.fmean(ours),
            "reference_std": std(ours),
            "pyg_final_test_acc": theirs or None, "pyg_mean": statistics.fmean(theirs) if theirs else None,
            "pyg_std": std(theirs) if theirs else None,
        })
        print(f"  accuracy {name}: done ({len(seeds)} seeds)", flush=True)
    return sections


# --------------------------------------------------------------------------------------------
# report


def print_timing_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'dataset':<16} {'nodes':>8} {'edges':>10} {'system':<24} {'threads':>7} "
              f"{'ms/epoch med':>12} {'ms/epoch mean':>13} {'vs PyG':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['ratio_vs_pyg']:.2f}x" if r["ratio_vs_pyg"] is not None else "-"
        system = f"{r['system']} ({r['timed']})"
        print(f"{r['dataset']:<16} {r['nodes']:>8} {r['edges']:>10} {system:<24} {r['threads']:>7} "
              f"{r['ms_median']:>12.2f} {r['ms_mean']:>13.2f} {ratio:>7}")


def print_accuracy_table(sections: list[dict[str, Any]]) -> None:
    header = f"{'dataset':<16} {'system':<10} {'seeds':<10} {'final test acc per seed':<40} {'mean':>7} {'std':>7}"
    print(header)
    print("-" * len(header))
    for s in sections:
        seeds = ",".join(map(str, s["seeds"]))
        for system in ("reference", "pyg"):
            accs = s[f"{system}_final_test_acc"]
            if accs is None:
                continue
            per_seed = " ".join(f"{a:.4f}" for a in accs)
            print(f"{s['dataset']:<16} {system:<10} {seeds:<10} {per_seed:<40} "
                  f"{s[f'{system}_mean']:>7.4f} {s[f'{system}_std']:>7.4f}")


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds is empty")
    return seeds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=DEFAULT_DATASETS,
                        help=f"comma-separated dataset specs: 'cora' ({CORA}), a preset, or a path "
                             f"(default: {DEFAULT_DATASETS})")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch threads for both systems (default: all usable cores)")
    parser.add_argument("--hidden", type=positive_int, default=TrainConfig.hidden, help="hidden width (default: 16)")
    parser.add_argument("--epochs", type=positive_int, default=50, help="timed epochs per dataset (default: 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed epochs first (default: 5)")
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="accuracy seeds, comma-separated (default: 0,1,2,3,4 on cora, 0 on synthetic-small)")
    parser.add_argument("--skip-accuracy", action="store_true", help="only time epochs")
    parser.add_argument("--output", type=Path, default=RESULTS / "reference.json", help="JSON result path")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if GCNConv is None:
        print("torch_geometric is not importable: PyG rows are skipped")
    print(f"reference benchmark: torch {torch.__version__}, PyG {PYG_VERSION}, {args.threads} threads, "
          f"{os.cpu_count()} cpus, load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}",
          flush=True)

    cache: dict[str, GraphDataset] = {}
    timing: list[dict[str, Any]] = []
    timing_config = TrainConfig(hidden=args.hidden)
    for raw in (s.strip() for s in args.datasets.split(",") if s.strip()):
        spec = resolve_spec(raw)
        if spec is None:
            continue
        start = time.perf_counter()
        dataset = cache[spec] = load_dataset(spec)
        print(f"  {display_name(spec)}: loaded in {time.perf_counter() - start:.1f} s, timing...", flush=True)
        config = dataclasses.replace(timing_config, dataset=spec)
        timed = time_epochs(dataset, config, args.warmup, args.epochs)
        rows = timing_rows(display_name(spec), dataset, timed, args.threads)
        timing.append({"dataset": display_name(spec), "data": describe(spec, dataset), "config": config.to_dict(),
                       "parity_max_abs_logit_diff": timed["parity_max_abs_logit_diff"], "rows": rows})

    accuracy_results: list[dict[str, Any]] = []
    if not args.skip_accuracy:
        wanted: dict[str, tuple[str, list[int]]] = {}
        if (cora := resolve_spec("cora")) is not None:
            wanted["cora"] = (cora, args.seeds or [0, 1, 2, 3, 4])
        wanted["synthetic-small"] = ("synthetic-small", args.seeds or [0])
        accuracy_results = accuracy_section(wanted, args.threads, cache)

    load_after = os.getloadavg()
    print()
    print(f"Epoch time ({args.warmup} warm-up + {args.epochs} timed epochs, systems alternating; "
          f"ratio = reference / PyG median)")
    print_timing_table([row for t in timing for row in t["rows"]])
    for t in timing:
        if t["parity_max_abs_logit_diff"] is not None:
            print(f"  {t['dataset']}: max |reference - PyG| eval logits at init = {t['parity_max_abs_logit_diff']:.1e}")
    if accuracy_results:
        print()
        print("Accuracy (Planetoid recipe: TrainConfig defaults, 200 epochs; final test accuracy; "
              "std over seeds, n - 1)")
        print_accuracy_table(accuracy_results)
    print()
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus)")

    result = {
        "benchmark": "reference",
        "timed": "per epoch: 'train step' = ReferenceTrainer.step without evaluation (forward with dropout, "
                 "loss, backward, Adam); 'step+eval' adds ReferenceTrainer.evaluate; PyG the same with GCNConv",
        "warmup_epochs": args.warmup, "timed_epochs": args.epochs, "threads": args.threads,
        "timing_config": timing_config.to_dict(), "timing": timing, "accuracy": accuracy_results,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "usable_cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_geometric": PYG_VERSION, "numpy": np.__version__,
                    "load_average_before": load_before, "load_average_after": load_after},
    }
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_reference: {e}")
