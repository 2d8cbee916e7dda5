"""Throughput of the graph server's Gather kernels on one partition of a real graph.

The graph is partitioned with METIS (``assign_parts`` + ``write_store`` into a temp dir, then
``open_store`` / ``load_part``) and part ``--part`` becomes a ``graphserver.state.PartitionState``
(its ``ModelSpec`` from ``TrainConfig``). Its kernels, for each width ``d`` in ``--widths``:

* forward  ``Z = A_local · H``,   ``A_local`` CSR ``[n_owned, n_local]``, ``H`` ``[n_local, d]``
  (``graphserver.state.spmm(state.adj, H)``, what ``PartitionState.gather`` runs);
* backward ``A_local^T · G``, the precomputed transpose ``[n_local, n_owned]``, ``G`` ``[n_owned, d]``
  (``spmm(state.adj_t, G)``, what ``PartitionState.gather_backward`` runs);

against, on the same matrix: ``torch.sparse.mm`` with the same CSR tensor (no numpy round trip),
``torch.sparse.mm`` with it as a coalesced COO tensor, and ``scipy.sparse.csr_matrix @ dense``
(scipy's kernel is single-threaded). Every kernel's result is checked against a float64 scipy
product before timing (max abs error <= 1e-5 * max |result|).

Timing: ``--warmup`` untimed calls, then ``--repeats`` rounds in which every kernel is called
once in turn (so that load from other jobs falls on all alike); ms per call is the median over
rounds. Each call allocates its output, as the graph server's does.

Throughput counts dense float32 data only: ``GB/s = (nnz * d * 4 + n_rows * d * 4) / seconds /
1e9``, one row of the dense input read per stored entry plus the output written; the CSR
structure itself (``indices`` int64 + ``values`` float32 per entry) is not counted. Ratio =
kernel ms / ``torch.sparse.mm`` CSR ms (> 1: slower).

    python benchmarks/bench_gather.py
    python benchmarks/bench_gather.py --widths 16,64,128,602 --threads 1
    python benchmarks/bench_gather.py --dataset ../shared/data/cora.npz --parts 4 --part 3

Prints a table and writes ``benchmarks/results/gather.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import scipy
import scipy.sparse
import torch

from dorylus.config import TrainConfig
from dorylus.data.loaders import load_dataset
from dorylus.errors import DorylusError
from dorylus.models import gcn
from dorylus.models.spec import ModelSpec
from dorylus.partition import assign_parts, open_store, write_store
from graphserver.state import PartitionState, spmm
from common import machine_info, positive_int, write_json

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "torch.sparse.mm CSR"
RELATIVE_TOLERANCE = 1e-5  # float32 sums of a few hundred terms, in different orders


def kernels(csr: torch.Tensor) -> dict[str, Callable[[np.ndarray], Any]]:
    """The kernels compared for one sparse matrix; each takes a float32 numpy ``[cols, d]``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        coo = csr.to_sparse_coo().coalesce()
    host = scipy.sparse.csr_matrix((csr.values().numpy(), csr.col_indices().numpy(), csr.crow_indices().numpy()),
                                   shape=tuple(csr.shape))
    return {
        "PartitionState spmm": lambda dense: spmm(csr, dense),
        BASELINE: lambda dense: torch.sparse.mm(csr, torch.from_numpy(dense)),
        "torch.sparse.mm COO": lambda dense: torch.sparse.mm(coo, torch.from_numpy(dense)),
        "scipy csr @ dense": lambda dense: host @ dense,
    }


def as_numpy(result: Any) -> np.ndarray:
    return result.numpy() if isinstance(result, torch.Tensor) else np.asarray(result)


def bench_direction(direction: str, csr: torch.Tensor, width: int, warmup: int, repeats: int,
                    rng: np.random.Generator) -> list[dict[str, Any]]:
    """Check, then time every kernel on ``csr @ dense`` with a random ``dense [cols, width]``."""
    n_rows, n_cols = csr.shape
    dense = rng.standard_normal((n_cols, width), dtype=np.float32)
    fns = kernels(csr)
    oracle = scipy.sparse.csr_matrix(
        (csr.values().numpy().astype(np.float64), csr.col_indices().numpy(), csr.crow_indices().numpy()),
        shape=(n_rows, n_cols)) @ dense.astype(np.float64)
    scale = max(float(np.abs(oracle).max()), 1e-30)
    errors = {}
    for name, fn in fns.items():
        errors[name] = float(np.abs(as_numpy(fn(dense)) - oracle).max())
        if errors[name] > RELATIVE_TOLERANCE * scale:
            raise SystemExit(f"bench_gather: {name} ({direction}, d={width}) differs from the float64 product by "
                             f"{errors[name]:.3e} (max |result| {scale:.3e})")
    for _ in range(warmup):
        for fn in fns.values():
            fn(dense)
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(dense)
            seconds[name].append(time.perf_counter() - start)
    nnz = int(csr.values().numel())
    dense_bytes = (nnz * width + n_rows * width) * 4
    baseline = statistics.median(seconds[BASELINE])
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        rows.append({"direction": direction, "width": width, "kernel": name, "n_rows": n_rows, "n_cols": n_cols,
                     "nnz": nnz, "ms_median": 1e3 * median, "ms_min": 1e3 * min(times),
                     "gb_per_s": dense_bytes / median / 1e9, "ratio_vs_csr": median / baseline,
                     "max_abs_error_vs_float64": errors[name], "ms_per_call": [1e3 * t for t in times]})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'direction':<9} {'d':>4} {'kernel':<22} {'rows':>7} {'cols':>7} {'nnz':>9} "
              f"{'ms median':>9} {'ms min':>8} {'GB/s':>6} {'vs CSR':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['direction']:<9} {r['width']:>4} {r['kernel']:<22} {r['n_rows']:>7} {r['n_cols']:>7} "
              f"{r['nnz']:>9} {r['ms_median']:9.3f} {r['ms_min']:8.3f} {r['gb_per_s']:6.2f} {r['ratio_vs_csr']:6.2f}x")


def width_list(text: str) -> list[int]:
    try:
        widths = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--widths takes comma-separated positive integers, got {text!r}")
    return widths


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-1m", help="dataset spec: a preset or a path (default: synthetic-1m)")
    parser.add_argument("--parts", type=positive_int, default=2, help="METIS parts (default: 2)")
    parser.add_argument("--part", type=int, default=0, help="the part whose kernels are timed (default: 0)")
    parser.add_argument("--widths", type=width_list, default=[16, 64, 128],
                        help="dense widths d, comma-separated (default: 16,64,128)")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: all usable cores)")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed rounds (default: 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="partitioner and random dense data seed (default: 0)")
    parser.add_argument("--output", type=Path, default=RESULTS / "gather.json", help="JSON result path")
    args = parser.parse_args(argv)
    if not 0 <= args.part < args.parts:
        parser.error(f"--part must be in [0, {args.parts}), got {args.part}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"gather benchmark: {args.dataset}, part {args.part} of {args.parts} (METIS), widths {args.widths}, "
          f"{args.threads} torch threads; torch {torch.__version__}, scipy {scipy.__version__}, {os.cpu_count()} cpus, "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    dataset = load_dataset(args.dataset)
    config = TrainConfig(dataset=args.dataset, parts=args.parts, seed=args.seed)
    parts = assign_parts(dataset.num_nodes, dataset.src, dataset.dst, args.parts, "metis", seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-gather-") as workdir:
        write_store(dataset, parts, Path(workdir) / "store", method="metis", seed=args.seed)
        store = open_store(Path(workdir) / "store", verify=True)
        part = store.load_part(args.part, mmap=False)
        spec = ModelSpec.from_config(config, store.meta.num_features, store.meta.num_classes)
        state = PartitionState(part, gcn.build_plan(spec), row_normalize_features=True,
                               num_intervals=config.intervals)
    print(f"  part {args.part}: {part.n_owned:,} owned + {part.n_ghost:,} ghost rows, {part.nnz:,} A_hat entries",
          flush=True)

    rng = np.random.default_rng(args.seed)
    rows = []
    for width in args.widths:
        rows += bench_direction("forward", state.adj, width, args.warmup, args.repeats, rng)
        rows += bench_direction("backward", state.adj_t, width, args.warmup, args.repeats, rng)
        print(f"  d={width}: done", flush=True)
    load_after = os.getloadavg()

    print()
    print(f"{dataset.name}, part {args.part} of {args.parts}; forward = A_local [n_owned, n_local] @ H, "
          f"backward = A_local^T [n_local, n_owned] @ G; median of {args.repeats} rounds after {args.warmup} warm-up.")
    print("GB/s = (nnz*d*4 bytes read + rows*d*4 bytes written) / time (dense float32 data only); "
          "vs CSR = ms / torch.sparse.mm CSR ms.")
    print(f"torch threads {args.threads}; scipy is single-threaded.")
    print_table(rows)
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cpus, shared: "
          f"timings are noisy)")

    result = {
        "benchmark": "gather", "dataset": args.dataset, "dataset_name": dataset.name, "parts": args.parts,
        "part": args.part, "method": "metis", "seed": args.seed, "n_owned": part.n_owned, "n_ghost": part.n_ghost,
        "nnz": part.nnz, "widths": args.widths, "threads": args.threads, "warmup": args.warmup,
        "repeats": args.repeats,
        "gb_per_s_formula": "(nnz * d * 4 + n_rows * d * 4) / median_seconds / 1e9 (dense float32 read per stored "
                            "entry + output written; CSR structure not counted)",
        "config": config.to_dict(), "rows": rows,
        "machine": {**machine_info(load_before, load_after), "scipy": scipy.__version__},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(result, args.output)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    try:
        main()
    except DorylusError as e:
        sys.exit(f"bench_gather: {e}")
