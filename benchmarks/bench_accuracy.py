"""Test accuracy of every model on the papers' recipes, and against an MLP that ignores the graph.

Recipes (200-epoch budget, Adam, row-normalized features): every registered model
(:data:`dorylus.models.MODELS`) at its own defaults, which are its paper's recipe (each model
module's ``DEFAULTS``; docs/models.md#recipes lists them), so a new model is measured with no
edit here; and

* ``mlp``: two linear layers (hidden 64, ReLU, dropout 0.5), Adam at lr 0.01 with weight decay
  5e-4: what the features alone give.

Reported: final test accuracy (after 200 epochs) and test accuracy at the best validation
epoch, per seed, with the mean. Cora runs seeds 0..4; synthetic-small seed 0 (``--seeds``).
``--backend`` trains through the engine (``lambda`` or ``cpu``, ``--parts`` graph servers,
``--mode``) instead of the single-process reference.

    python benchmarks/bench_accuracy.py
    python benchmarks/bench_accuracy.py --datasets cora --models gat --backend lambda --parts 2

Prints a table and writes ``benchmarks/results/accuracy.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common import machine_info, positive_int, write_json
from dorylus.config import TrainConfig
from dorylus.data.loaders import load_dataset
from dorylus.models import MODELS, get_model
from dorylus.models.reference import accuracy
from dorylus.models.sparse import to_dense
from dorylus.coordinator.training import prepare_graph, run_training
from graphserver.modes import MODES

RESULTS = Path(__file__).resolve().parent / "results"
CORA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cora.npz"
MLP_RECIPE = dict(hidden=64, dropout=0.5, lr=0.01)
EPOCHS = 200


def train_mlp(dataset, seed: int) -> dict[str, float]:
    """Features only: ``Linear -> ReLU -> dropout -> Linear`` with input dropout, Adam, 200 epochs."""
    recipe = MLP_RECIPE
    graph = prepare_graph(dataset, TrainConfig())
    torch.manual_seed(seed)
    x = torch.from_numpy(to_dense(graph.features))
    labels = torch.from_numpy(dataset.labels)
    masks = {name: torch.from_numpy(getattr(dataset, f"{name}_mask")) for name in ("train", "val", "test")}
    model = torch.nn.Sequential(torch.nn.Dropout(recipe["dropout"]), torch.nn.Linear(x.shape[1], recipe["hidden"]),
                                torch.nn.ReLU(), torch.nn.Dropout(recipe["dropout"]),
                                torch.nn.Linear(recipe["hidden"], dataset.num_classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe["lr"], weight_decay=5e-4)
    best_val, test_at_best = -1.0, 0.0
    for _ in range(EPOCHS):
        model.train()
        loss = F.cross_entropy(model(x)[masks["train"]], labels[masks["train"]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(x)
        val = accuracy(logits, labels, masks["val"])
        if val > best_val:
            best_val, test_at_best = val, accuracy(logits, labels, masks["test"])
    return {"final_test_acc": accuracy(logits, labels, masks["test"]), "test_acc_at_best_val": test_at_best}


def train_model(dataset, spec: str, model: str, seed: int, args) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-accuracy-") as tmp:
        config = TrainConfig(dataset=spec, epochs=EPOCHS, seed=seed, backend=args.backend, run_dir=str(Path(tmp) / "r"),
                             **({"parts": args.parts, "mode": args.mode} if args.backend != "reference" else {}),
                             model=model)
        summary = run_training(config, dataset, progress=io.StringIO())
    return {k: summary[k] for k in ("final_test_acc", "test_acc_at_best_val")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="cora,synthetic-small", help="comma-separated (default: cora,synthetic-small)")
    every = ",".join([*MODELS, "mlp"])
    parser.add_argument("--models", default=every, help=f"comma-separated (default: {every})")
    parser.add_argument("--seeds", default=None, help="comma-separated (default: 0..4 on cora, 0 elsewhere)")
    parser.add_argument("--backend", default="reference", choices=("reference", "cpu", "lambda"))
    parser.add_argument("--parts", type=positive_int, default=2, help="graph servers for cpu/lambda (default: 2)")
    parser.add_argument("--mode", default="sync", choices=tuple(MODES))
    parser.add_argument("--output", type=Path, default=RESULTS / "accuracy.json", help="JSON result path")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if unknown := [m for m in models if m not in MODELS and m != "mlp"]:
        parser.error(f"unknown model(s): {', '.join(unknown)}")
    load_before = os.getloadavg()
    rows = []
    for name in (d for d in args.datasets.split(",") if d):
        spec = str(CORA) if name == "cora" else name
        if name == "cora" and not CORA.is_file():
            print(f"skipping cora: {CORA} not found")
            continue
        dataset = load_dataset(spec)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (list(range(5)) if name == "cora" else [0])
        for model in models:
            runs = []
            for seed in seeds:
                print(f"  {name} {model} seed {seed}...", flush=True)
                runs.append(train_mlp(dataset, seed) if model == "mlp" else train_model(dataset, spec, model, seed, args))
            rows.append({"dataset": name, "model": model, "backend": "torch" if model == "mlp" else args.backend,
                         "seeds": seeds, "runs": runs,
                         **{f"mean_{k}": statistics.fmean(r[k] for r in runs)
                            for k in ("final_test_acc", "test_acc_at_best_val")}})
    print(f"\n{EPOCHS}-epoch recipes; test accuracy, mean over seeds (final | at best validation epoch)")
    print(f"{'dataset':<16} {'model':<5} {'backend':<9} {'seeds':>5} {'final':>7} {'best-val':>9}  per seed (final)")
    for row in rows:
        per_seed = " ".join(f"{r['final_test_acc']:.3f}" for r in row["runs"])
        print(f"{row['dataset']:<16} {row['model']:<5} {row['backend']:<9} {len(row['seeds']):>5} "
              f"{row['mean_final_test_acc']:>7.4f} {row['mean_test_acc_at_best_val']:>9.4f}  {per_seed}")
    recipes = {m: MLP_RECIPE if m == "mlp" else dict(getattr(get_model(m), "DEFAULTS", {})) for m in models}
    result = {"benchmark": "accuracy", "epochs": EPOCHS, "recipes": recipes, "backend": args.backend,
              "parts": args.parts, "mode": args.mode, "rows": rows, "machine": machine_info(load_before, os.getloadavg())}
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
