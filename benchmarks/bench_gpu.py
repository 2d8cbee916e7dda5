"""The gpu backend against PyTorch Geometric on the same device: epoch time and peak memory.

A check and three measurements of a 2-layer GCN (``--hidden``, dropout 0.5, Adam) on one dataset:

* ``sync equals the reference``: the first ``--reference-epochs`` epochs of the ``gpu 1 part``
  run (sync, TF32 off) against the single-process reference trainer on the CPU (the oracle):
  the loss of every epoch to 1e-5 relative, as tests/distributed/test_sync_exactness.py asks;
  printed and recorded with the largest relative difference (``--reference-epochs 0`` skips it);

* ``gpu 1 part``: ``dorylus train --backend gpu --parts 1 --intervals 1 --mode sync`` on
  ``--device``: one graph server holds the whole graph on the device and runs Gather, Scatter and
  the vertex functions there (the parameter server and the coordinator are processes beside it).
* ``PyG GCNConv``: ``GCNConv(cached=True)`` on a torch sparse CSR ``adj_t``, dense features, in
  this process on the same device (the fastest PyG setup the issue measured).
* ``gpu N parts``: ``--parts N`` (default 4) graph servers sharing the one device, each under
  the default memory budget (1/N of the device less a CUDA context each).

The graph servers are processes of their own; PyG runs in this process, last, so that its CUDA
context and cached blocks are not held on the device while the graph servers run.

What an epoch is. For both: forward with dropout, loss, backward, optimizer step; no evaluation
pass (the distributed runs evaluate only in their last epoch, which is not timed). Dorylus's
``epoch_s`` is the coordinator's wall time per epoch (it includes the weight pull and push through
the parameter server); PyG's is the step's wall time with the device synchronized. The first
``--warmup`` epochs are dropped; the median of the rest is reported.

Peak memory. CUDA only: PyG's is ``torch.cuda.max_memory_allocated`` in this process; the graph
servers print theirs (allocated and reserved by torch's caching allocator) into their logs when
they stop. On ``--device cpu`` no memory is reported. Without torch_geometric the PyG row is
left out (said so), the rest still runs.

    python benchmarks/bench_gpu.py                                   # synthetic-reddit on cuda
    python benchmarks/bench_gpu.py --device cpu --dataset synthetic-small --epochs 5 --warmup 1

Without CUDA, ``--device cuda`` prints why and exits 0 (nothing measured, nothing written).
Prints a table and writes ``benchmarks/results/gpu-<dataset>-<device type>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dorylus.config import TrainConfig
from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.normalize import gcn_normalize, row_normalize
from dorylus.runs import read_metrics
from dorylus.coordinator.training import run_training
from graphserver.backends.gpu_device import set_tf32
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
PEAK = re.compile(r"gpu backend: peak memory allocated (\d+) bytes, reserved (\d+) bytes")


def time_dorylus(dataset, base: TrainConfig, parts: int, workdir: Path, warmup: int) -> dict[str, Any]:
    run_dir = workdir / f"gpu-{parts}"
    start = time.monotonic()
    config = TrainConfig(**{**base.to_dict(), "parts": parts, "run_dir": str(run_dir)})
    run_training(config, dataset, progress=io.StringIO())
    total_s = time.monotonic() - start
    epochs = [m["epoch_s"] for m in read_metrics(run_dir)][warmup:-1]  # the last epoch also evaluates
    peaks = [PEAK.search((run_dir / "logs" / f"graphserver-{i}.log").read_text()) for i in range(parts)]
    return {"what": f"gpu {parts} part{'s' if parts > 1 else ''}", "parts": parts, "run_dir": str(run_dir),
            "epoch_s_median": statistics.median(epochs), "epoch_s": epochs,
            "overhead_s": total_s - sum(m["epoch_s"] for m in read_metrics(run_dir)),
            "peak_allocated_bytes": [int(p.group(1)) for p in peaks if p] or None,
            "peak_reserved_bytes": [int(p.group(2)) for p in peaks if p] or None}


def check_reference(dataset, base: TrainConfig, gpu_run: Path, workdir: Path, epochs: int) -> dict[str, Any]:
    """The first ``epochs`` epochs of the gpu run's loss against the single-process reference
    (same config and seed, on the CPU): equal when every epoch is within 1e-5 relative."""
    run_dir = workdir / "reference"
    config = TrainConfig(**{**base.to_dict(), "backend": "reference", "device": "cpu", "parts": 1, "epochs": epochs,
                            "eval_every": epochs, "run_dir": str(run_dir)})
    run_training(config, dataset, progress=io.StringIO())
    reference = read_metrics(run_dir)
    got = read_metrics(gpu_run)[:epochs]
    worst = max(abs(g["loss"] - r["loss"]) / abs(r["loss"]) for g, r in zip(got, reference))
    equal = len(got) == len(reference) == epochs and all(g["epoch"] == r["epoch"] for g, r in zip(got, reference)) \
        and worst <= 1e-5
    return {"epochs": epochs, "equal": bool(equal), "max_rel_loss_diff": worst,
            "loss_reference": [r["loss"] for r in reference], "loss_gpu": [g["loss"] for g in got]}


def time_pyg(dataset, config: TrainConfig, device: torch.device, warmup: int, epochs: int) -> dict[str, Any]:
    try:
        from torch_geometric.nn import GCNConv
        from torch_geometric.utils import to_torch_csr_tensor
    except ImportError as exc:
        print(f"  PyG GCNConv: skipped, torch_geometric is not installed ({exc})", flush=True)
        return None

    if device.type == "cuda":
        torch.cuda.set_device(device)  # only now: this process's context is not held while the servers run
    adj = gcn_normalize(dataset.src, dataset.dst, dataset.num_nodes, symmetrize=not dataset.directed)
    rows, cols = adj.rows(), adj.indices
    off_diagonal = rows != cols  # GCNConv adds the self loops itself
    index = torch.from_numpy(np.stack([rows[off_diagonal], cols[off_diagonal]]))
    with warnings.catch_warnings():  # torch's notes that CSR is beta and unchecked: known, and beside the point
        warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
        adj_t = to_torch_csr_tensor(index, size=(dataset.num_nodes, dataset.num_nodes)).to(device)
    features = dataset.features.toarray() if hasattr(dataset.features, "toarray") else dataset.features
    x = torch.from_numpy(np.ascontiguousarray(row_normalize(np.asarray(features, np.float32)))).to(device)
    labels = torch.from_numpy(dataset.labels).to(device)
    train_mask = torch.from_numpy(dataset.train_mask).to(device)
    convs = torch.nn.ModuleList([GCNConv(dataset.num_features, config.hidden, cached=True),
                                 GCNConv(config.hidden, dataset.num_classes, cached=True)]).to(device)
    optimizer = torch.optim.Adam([{"params": convs[0].parameters(), "weight_decay": config.weight_decay},
                                  {"params": convs[1].parameters(), "weight_decay": 0.0}], lr=config.lr)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(warmup + epochs):
        synchronize()
        start = time.perf_counter()
        h = torch.relu(convs[0](F.dropout(x, config.input_dropout, training=True), adj_t))
        logits = convs[1](F.dropout(h, config.dropout, training=True), adj_t)
        loss = F.cross_entropy(logits[train_mask], labels[train_mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"what": "PyG GCNConv(cached) on CSR adj_t", "parts": 1, "epoch_s_median": statistics.median(times[warmup:]),
            "epoch_s": times[warmup:], "overhead_s": None, "peak_allocated_bytes": None if peak is None else [peak],
            "peak_reserved_bytes": None}


def _gib(values: list[int] | None) -> str:
    return "-" if not values else " / ".join(f"{v / 2**30:.2f}" for v in values)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-reddit", help="dataset spec (default: synthetic-reddit)")
    parser.add_argument("--device", default="cuda", help="torch device: cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--hidden", type=positive_int, default=128, help="hidden width (default: 128)")
    parser.add_argument("--shared-parts", type=positive_int, default=4,
                        help="graph servers sharing the device in the last measurement (default: 4)")
    parser.add_argument("--epochs", type=positive_int, default=20, help="timed epochs (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="epochs run first and dropped (default: 3)")
    parser.add_argument("--allow-tf32", action="store_true",
                        help="let both sides use TF32 (default: off; the reference check then fails by design)")
    parser.add_argument("--reference-epochs", type=int, default=5,
                        help="epochs of the 1-part run checked against the single-process reference on the CPU "
                             "(default: 5; 0 skips the check)")
    parser.add_argument("--workdir", default=None, help="parent of the temp run dirs (default: system temp dir)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result path (default: benchmarks/results/gpu-<dataset>-<device type>.json)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.reference_epochs <= args.warmup + args.epochs:
        parser.error(f"--reference-epochs must be in [0, warmup + epochs = {args.warmup + args.epochs}], "
                     f"got {args.reference_epochs}")
    base = TrainConfig(dataset=args.dataset, backend="gpu", device=args.device, allow_tf32=args.allow_tf32,
                       intervals=1, mode="sync", hidden=args.hidden, epochs=args.warmup + args.epochs + 1,
                       eval_every=args.warmup + args.epochs + 1)
    try:
        base.check_machine()
    except DorylusError as exc:
        print(f"bench_gpu: skipped, nothing measured: {exc}")
        return None
    device = torch.device(args.device)
    set_tf32(args.allow_tf32)  # torch's fp32_precision API, as the graph servers set it
    name = Path(args.dataset).stem
    output = args.output or RESULTS / f"gpu-{name}-{device.type}.json"
    load_before = os.getloadavg()
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "torch CPU device"
    print(f"gpu benchmark: {args.dataset} on {args.device} ({gpu_name}), 2-layer GCN hidden {args.hidden}, "
          f"{args.warmup} warm-up + {args.epochs} timed epochs, TF32 {'on' if args.allow_tf32 else 'off'}; "
          f"torch {torch.__version__}", flush=True)
    dataset = load_dataset(args.dataset)
    print(f"  {dataset.name}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, "
          f"{dataset.num_features} features, {dataset.num_classes} classes", flush=True)

    rows, reference = [], None
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.workdir) as workdir:
        one = time_dorylus(dataset, base, 1, Path(workdir), args.warmup)
        print(f"  {one['what']}: {one['epoch_s_median'] * 1000:.1f} ms/epoch (median)", flush=True)
        if args.reference_epochs:
            reference = check_reference(dataset, base, Path(one["run_dir"]), Path(workdir), args.reference_epochs)
            print(f"  sync {'equals' if reference['equal'] else 'DIFFERS FROM'} the reference over "
                  f"{reference['epochs']} epochs (largest relative loss difference "
                  f"{reference['max_rel_loss_diff']:.2e})", flush=True)
        shared = time_dorylus(dataset, base, args.shared_parts, Path(workdir), args.warmup)
        print(f"  {shared['what']}: {shared['epoch_s_median'] * 1000:.1f} ms/epoch (median)", flush=True)
        # PyG last, in this process: its context and cached blocks never sit beside the graph servers
        pyg = time_pyg(dataset, base, device, args.warmup, args.epochs)
        if pyg is not None:
            print(f"  {pyg['what']}: {pyg['epoch_s_median'] * 1000:.1f} ms/epoch (median)", flush=True)
        rows = [row for row in (one, pyg, shared) if row is not None]
    load_after = os.getloadavg()
    pyg_s = pyg["epoch_s_median"] if pyg is not None else None

    print()
    print(f"{dataset.name} on {args.device} ({gpu_name}); median of {args.epochs} epochs after {args.warmup} warm-up; "
          "no evaluation pass in the timed epochs.")
    print(f"{'what':<36} {'ms/epoch':>10} {'vs PyG':>8} {'peak allocated GiB':>22} {'peak reserved GiB':>22}")
    for row in rows:
        ratio = f"{row['epoch_s_median'] / pyg_s:>7.2f}x" if pyg_s else f"{'-':>8}"
        print(f"{row['what']:<36} {row['epoch_s_median'] * 1000:>10.1f} {ratio} "
              f"{_gib(row['peak_allocated_bytes']):>22} {_gib(row['peak_reserved_bytes']):>22}")
    if reference is not None:
        print(f"sync vs the single-process reference, {reference['epochs']} epochs: "
              f"{'equal' if reference['equal'] else 'NOT equal'} (largest relative loss difference "
              f"{reference['max_rel_loss_diff']:.2e}, bound 1e-5)")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cpus)")

    result = {
        "benchmark": "gpu", "dataset": args.dataset, "dataset_name": dataset.name, "num_nodes": dataset.num_nodes,
        "num_edges": dataset.num_edges, "num_features": dataset.num_features, "num_classes": dataset.num_classes,
        "device": args.device, "device_name": gpu_name, "allow_tf32": args.allow_tf32,
        "warmup_epochs": args.warmup, "timed_epochs": args.epochs,
        "timed": "training step (dropout forward, loss, backward, Adam) per epoch, no evaluation pass; Dorylus: "
                 "coordinator wall time per epoch; PyG: synchronized wall time of the step",
        "config": base.to_dict(), "rows": rows, "reference_check": reference,
        "machine": machine_info(load_before, load_after),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(result, output)
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_gpu: {e}")
