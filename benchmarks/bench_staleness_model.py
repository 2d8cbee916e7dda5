"""What ghost staleness alone costs in accuracy: a single-process model of ``async`` on 2 parts.

``bench_modes.py`` measures the real system, where which rows are stale depends on timing, so
two runs of one configuration differ. This model replays the rule of ``async --staleness 1``
(DESIGN §3, docs/modes.md) for the 2-layer GCN of :mod:`dorylus.models.gcn` on one process,
with the staleness chosen per epoch by a seeded pattern:

* every epoch computes with the newest weights (``async`` trains on version ``e - 1``, as sync);
* the part that *leads* in an epoch reads the other part's ghost rows of the previous epoch
  (``--stale-correction``: their running average with ``gamma``) and applies the other part's
  ghost gradients of the previous epoch (the newest it has); the other part reads this
  epoch's rows and gets this epoch's gradients, as a follower does;
* patterns: ``none`` (sync), ``random:Q`` (part 0 leads with probability Q, part 1 with Q),
  ``fixed`` (part 0 always leads), ``both`` (both read the previous epoch's rows and apply the
  previous epoch's gradients: PipeGCN's schedule).

Layer 0 projects first (its ghost rows are ``dropout(X) W_0``), layer 1 gathers first when
``hidden <= classes`` (its ghost rows are ``dropout(relu(Y_0))``), as the GCN plan does. What
the model leaves out: keyed dropout masks (torch's dropout here), intervals, the bias of no
layer's exchange. Evaluation is exact (every row of the epoch's weights), as ``async``'s is.

    python benchmarks/bench_staleness_model.py --patterns none,random:0.3,random:0.5,fixed --seeds 0,1,2

Prints per pattern the final test accuracy and the mean over the last ``--last`` epochs, each
seed's difference from ``none`` with the same seed, and writes
``benchmarks/results/staleness-model-<dataset>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
CURVE_EVERY = 50  # epochs between the test accuracies kept as each run's curve


class TwoPartGraph:
    """``A_hat`` of ``dataset`` split into the entries within a part and, per receiving part
    ``r``, the entries whose row is in ``r`` and whose column is in the other part."""

    def __init__(self, dataset, parts: np.ndarray):
        from dorylus.normalize import gcn_normalize

        adj = gcn_normalize(dataset.src, dataset.dst, dataset.num_nodes, symmetrize=not dataset.directed)
        rows, cols = adj.rows(), adj.indices.astype(np.int64)
        values = adj.norm[rows] * adj.norm[cols]
        n = dataset.num_nodes
        remote = parts[rows] != parts[cols]

        def csr(mask):
            index = np.stack([rows[mask], cols[mask]])
            return torch.sparse_coo_tensor(index, values[mask], (n, n)).coalesce().to_sparse_csr()

        self.local = csr(~remote)
        self.remote = [csr(remote & (parts[rows] == r)) for r in (0, 1)]
        self.owned = [torch.from_numpy(parts == s).unsqueeze(1).float() for s in (0, 1)]
        self.cut = float(remote.mean())

    def full(self, h: torch.Tensor) -> torch.Tensor:
        return self.local @ h + self.remote[0] @ h + self.remote[1] @ h


def leaders(pattern: str, epochs: int, seed: int) -> list[tuple[bool, bool]]:
    """Per epoch, whether part 0 and part 1 lead (read the previous epoch's rows)."""
    rng = random.Random(seed)
    if pattern == "none":
        return [(False, False)] * epochs
    if pattern == "fixed":
        return [(True, False)] * epochs
    if pattern == "both":
        return [(True, True)] * epochs
    if pattern.startswith("random:"):
        q = float(pattern.split(":", 1)[1])
        if not 0.0 <= q <= 0.5:
            raise ValueError(f"random:Q needs Q in [0, 0.5], got {q}")
        out = []
        for _ in range(epochs):
            u = rng.random()
            out.append((u < q, q <= u < 2 * q))
        return out
    raise ValueError(f"unknown pattern {pattern!r}: none, fixed, both or random:Q")


def train(graph: TwoPartGraph, dataset, features: torch.Tensor, pattern: str, gamma: float | None, epochs: int,
          last: int, seed: int, lr: float = 0.01, hidden: int = 16) -> dict[str, Any]:
    """Train the model GCN under ``pattern``; the test accuracy of each of the last ``last`` epochs."""
    torch.manual_seed(seed)
    classes = dataset.num_classes
    y = torch.from_numpy(dataset.labels)
    train_rows, test_rows = torch.from_numpy(dataset.train_mask), torch.from_numpy(dataset.test_mask)
    gather_first = hidden <= classes  # layer 1: gcn.projects_first is in > out

    def glorot(a, b):
        return ((torch.rand(a, b) * 2 - 1) * (6 / (a + b)) ** 0.5).requires_grad_()

    w0, w1 = glorot(features.shape[1], hidden), glorot(hidden, classes)
    b0, b1 = torch.zeros(hidden, requires_grad=True), torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([{"params": [w0], "weight_decay": 5e-4},
                                  {"params": [w1, b0, b1], "weight_decay": 0.0}], lr=lr)
    previous: dict[int, torch.Tensor] = {}  # layer -> last epoch's exchanged rows (every part's)
    smoothed: dict[tuple[int, int], torch.Tensor] = {}
    gradients: dict[tuple[int, int], torch.Tensor] = {}  # (layer, sender) -> last epoch's, to it
    accuracies, curve = [], []
    for epoch, lead in enumerate(leaders(pattern, epochs, seed + 1000)):
        h = F.dropout(features, 0.5, True)
        exchanged, received = [], []
        for layer in (0, 1):
            rows = h if (layer == 1 and gather_first) else h @ (w0 if layer == 0 else w1)
            z = graph.local @ rows
            for r in (0, 1):
                if lead[r] and layer in previous:
                    value = previous[layer]
                    if gamma is not None:
                        held = smoothed.get((layer, r))
                        value = value if held is None else gamma * held + (1 - gamma) * value
                        smoothed[(layer, r)] = value
                else:
                    value = rows.detach()
                ghost = value.clone().requires_grad_()  # its gradient is a contribution to part 1 - r
                received.append((layer, r, ghost))
                z = z + graph.remote[r] @ ghost
            exchanged.append(rows)
            if layer == 0:
                h = F.dropout(F.relu(z + b0), 0.5, True)
            else:
                logits = (z @ w1 if gather_first else z) + b1
        loss = F.cross_entropy(logits[train_rows], y[train_rows])
        optimizer.zero_grad()
        loss.backward(retain_graph=True)
        fresh = {(layer, 1 - r): ghost.grad.detach() for layer, r, ghost in received}
        # A sender that leads applies the newest contribution it has: the previous epoch's.
        extra = sum(((gradients.get((layer, s)) if lead[s] else fresh[(layer, s)]) * graph.owned[s] * rows).sum()
                    for layer, rows in enumerate(exchanged) for s in (0, 1)
                    if not lead[s] or (layer, s) in gradients)
        if torch.is_tensor(extra):
            extra.backward()
        optimizer.step()
        gradients = fresh
        previous = {layer: rows.detach() for layer, rows in enumerate(exchanged)}
        if epoch >= epochs - last or (epoch + 1) % CURVE_EVERY == 0:
            with torch.no_grad():
                h = F.relu(graph.full(features @ w0) + b0)
                out = (graph.full(h) @ w1 if gather_first else graph.full(h @ w1)) + b1
                accuracy = float((out[test_rows].argmax(1) == y[test_rows]).float().mean())
            if epoch >= epochs - last:
                accuracies.append(accuracy)
            if (epoch + 1) % CURVE_EVERY == 0:
                curve.append((epoch + 1, accuracy))
    return {"final_loss": float(loss.detach()), "final_test_acc": accuracies[-1],
            "last_mean_test_acc": statistics.mean(accuracies), "test_acc_curve": curve}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-1m", help="dataset name or path (default: synthetic-1m)")
    parser.add_argument("--patterns", default="none,random:0.3,random:0.5,fixed,both",
                        help="comma-separated: none, fixed, both, random:Q (default: %(default)s)")
    parser.add_argument("--stale-gamma", type=float, default=None,
                        help="also run every stale pattern with the correction at this gamma (default: without only)")
    parser.add_argument("--seeds", default="0", help="comma-separated model seeds (default: 0)")
    parser.add_argument("--epochs", type=positive_int, default=300, help="epochs (default: 300)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default: 0.01)")
    parser.add_argument("--last", type=positive_int, default=20, help="epochs averaged at the end (default: 20)")
    parser.add_argument("--output", type=Path, default=None, help="JSON result path")
    args = parser.parse_args(argv)
    from dorylus.data.loaders import load_dataset
    from dorylus.errors import DorylusError
    from dorylus.normalize import row_normalize
    from dorylus.partition import assign_parts

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
        for p in patterns:
            leaders(p, 1, 0)
        if args.stale_gamma is not None and not 0.0 < args.stale_gamma < 1.0:
            raise ValueError(f"--stale-gamma must be in (0, 1), got {args.stale_gamma}")
        if not args.lr > 0:
            raise ValueError(f"--lr must be positive, got {args.lr}")
        if args.last > args.epochs:
            raise ValueError(f"--last {args.last} exceeds --epochs {args.epochs}")
        dataset = load_dataset(args.dataset)
    except (ValueError, DorylusError) as exc:
        print(f"bench_staleness_model: {exc}", file=sys.stderr)
        raise SystemExit(2)
    load_before = os.getloadavg()
    features = torch.from_numpy(np.asarray(row_normalize(np.array(dataset.features, dtype=np.float32))))
    graph = TwoPartGraph(dataset, assign_parts(dataset.num_nodes, dataset.src, dataset.dst, 2, "metis"))
    print(f"staleness model: {dataset.name}, 2 METIS parts ({graph.cut:.1%} of A_hat's entries cross), "
          f"{args.epochs} epochs, lr {args.lr}, seeds {seeds}", flush=True)
    runs = [(p, None) for p in patterns]
    if args.stale_gamma is not None:
        runs += [(p, args.stale_gamma) for p in patterns if p != "none"]
    rows = []
    for pattern, gamma in runs:
        results = [train(graph, dataset, features, pattern, gamma, args.epochs, args.last, seed, args.lr)
                   for seed in seeds]
        rows.append({"pattern": pattern, "stale_gamma": gamma, "seeds": seeds, "runs": results})
    baseline = next((r for r in rows if r["pattern"] == "none"), None)
    print(f"{'pattern':<14} {'gamma':>5} {'final test':>10} {'last-' + str(args.last) + ' mean':>13} "
          f"{'vs none, per seed (last mean, points)':>40}")
    for row in rows:
        final = statistics.mean(r["final_test_acc"] for r in row["runs"])
        mean = statistics.mean(r["last_mean_test_acc"] for r in row["runs"])
        diffs = ([100 * (r["last_mean_test_acc"] - b["last_mean_test_acc"]) for r, b in zip(row["runs"], baseline["runs"])]
                 if baseline else [])
        row["last_mean_diff_points"] = diffs
        print(f"{row['pattern']:<14} {row['stale_gamma'] or '-':>5} {final:>10.4f} {mean:>13.4f} "
              f"{' '.join(f'{d:+.2f}' for d in diffs):>40}")
    result = {"benchmark": "staleness-model", "dataset": dataset.name, "epochs": args.epochs, "lr": args.lr,
              "last": args.last,
              "cut_fraction": graph.cut, "rows": rows, "machine": machine_info(load_before, os.getloadavg())}
    write_json(result, args.output or RESULTS / f"staleness-model-{dataset.name}.json")
    return result


if __name__ == "__main__":
    main()
