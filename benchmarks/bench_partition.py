"""Time and peak memory of partitioning a dataset and writing/opening its partition store.

Stages: load the dataset, ``assign_parts``, ``write_store``, ``open_store`` with checksum
verification plus loading (and range-checking) every part, and ``partition_stats`` from the
store. Peak memory per stage is the process' resident high-water mark (``VmHWM``, reset before
each stage through ``/proc/self/clear_refs``; ``ru_maxrss``, a lifetime peak, where that is
unavailable).

    python benchmarks/bench_partition.py                       # synthetic-reddit, 4 METIS parts
    python benchmarks/bench_partition.py cora --parts 2 --method random
    python benchmarks/bench_partition.py /path/to/graph.npz --parts 8
    python benchmarks/bench_partition.py synthetic-1m --parts 4 --compare metis,fennel,ldg,random

``--compare`` skips the store and reports, for each method on the same loaded graph, the
assignment time, edge cut (fraction of listed edges crossing parts) and replication factor
(``(N + ghosts) / N``: parts holding a copy of a vertex, on average), with the streaming methods
fed ``--chunk-edges`` edges at a time as ``dorylus partition`` feeds them from disk.

Prints a table and writes ``benchmarks/results/partition-<dataset>-<parts>.json``. The store
is written under ``--workdir`` (default: the system temp dir) and deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from dorylus.data.graph import GraphDataset
from dorylus.partition import METHODS, assign_parts, format_stats, open_store, partition_stats, write_store
from common import status_kb

CORA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cora.npz"  # ../shared/data beside the checkout
RESULTS = Path(__file__).resolve().parent / "results"


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_mb() -> float:
    kb = status_kb("VmRSS")
    return kb / 1024 if kb is not None else float("nan")


def _peak_mb(per_stage: bool) -> float:
    kb = status_kb("VmHWM") if per_stage else None
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def load(spec: str) -> GraphDataset:
    """A dataset spec: ``cora``, a ``.npz`` path, or anything ``dorylus.data.loaders`` reads."""
    if spec == "cora":
        spec = str(CORA)
    try:
        from dorylus.data.loaders import load_dataset
    except ImportError:  # loaders not available: read a Dorylus .npz archive directly
        data = np.load(spec, allow_pickle=False)
        labels = data["labels"]
        return GraphDataset(
            name=Path(spec).stem, src=data["src"], dst=data["dst"], features=data["features"], labels=labels,
            train_mask=data["train_mask"], val_mask=data["val_mask"], test_mask=data["test_mask"],
            num_classes=int(data["num_classes"]) if "num_classes" in data.files else int(labels.max()) + 1,
            directed=bool(data["directed"]) if "directed" in data.files else False,
        ).validate(spec)
    return load_dataset(spec)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", nargs="?", default="synthetic-reddit",
                        help="preset name, 'cora', or a dataset path (default: synthetic-reddit)")
    parser.add_argument("--parts", type=int, default=4, help="number of parts (default: 4)")
    parser.add_argument("--method", choices=METHODS, default="metis", help="partitioner (default: metis)")
    parser.add_argument("--seed", type=int, default=0, help="partitioner seed (default: 0)")
    parser.add_argument("--workdir", default=None, help="where the store is written (default: system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written store and print its path")
    parser.add_argument("--compare", default=None, metavar="METHODS",
                        help="comma-separated methods to compare by edge cut and replication factor (no store)")
    parser.add_argument("--chunk-edges", type=int, default=1 << 23,
                        help="--compare: edges per chunk fed to ldg/fennel (default 8388608)")
    parser.add_argument("--passes", type=int, default=3, help="--compare: ldg/fennel passes (default 3)")
    args = parser.parse_args(argv)
    if args.compare is not None:
        return compare(args)

    per_stage = _reset_peak()
    stages: list[dict] = []

    def stage(name: str, fn):
        per_stage_now = _reset_peak()
        rss_before = _rss_mb()
        start = time.perf_counter()
        result = fn()
        stages.append({"stage": name, "seconds": time.perf_counter() - start, "rss_before_mb": rss_before,
                       "peak_rss_mb": _peak_mb(per_stage_now)})
        print(f"  {name}: {stages[-1]['seconds']:.2f} s, peak RSS {stages[-1]['peak_rss_mb']:.0f} MB", flush=True)
        return result

    print(f"partition benchmark: {args.dataset}, {args.parts} parts, {args.method}", flush=True)
    dataset = stage("load dataset", lambda: load(args.dataset))
    parts = stage("assign_parts", lambda: assign_parts(dataset.num_nodes, dataset.src, dataset.dst,
                                                       args.parts, args.method, seed=args.seed))
    workdir = Path(tempfile.mkdtemp(prefix="bench-partition-", dir=args.workdir))
    try:
        out = workdir / "store"
        stage("write_store", lambda: write_store(dataset, parts, out, method=args.method, seed=args.seed))
        store_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())

        def open_and_load():
            store = open_store(out, verify=True)
            for i in range(store.num_parts):
                store.load_part(i, mmap=True)
            return store

        store = stage("open_store+verify+load", open_and_load)
        stats = stage("partition_stats", lambda: partition_stats(store))
    finally:
        if args.keep:
            print(f"store kept at {workdir / 'store'}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    name = Path(args.dataset).stem if args.dataset.endswith(".npz") else args.dataset
    result = {
        "benchmark": "partition", "dataset": args.dataset, "num_nodes": dataset.num_nodes,
        "num_edges": dataset.num_edges, "num_features": dataset.num_features, "parts": args.parts,
        "method": args.method, "seed": args.seed, "store_mb": store_bytes / 2**20, "stages": stages,
        "peak_memory_is_per_stage": per_stage, "partition": stats["global"],
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    print()
    print(f"{args.dataset}: N={dataset.num_nodes:,} E={dataset.num_edges:,} F={dataset.num_features}, "
          f"{args.parts} parts by {args.method}; store {result['store_mb']:.1f} MB")
    width = max(len(s["stage"]) for s in stages)
    print(f"{'stage'.ljust(width)}  {'seconds':>8}  {'peak RSS MB':>11}")
    for s in stages:
        print(f"{s['stage'].ljust(width)}  {s['seconds']:8.2f}  {s['peak_rss_mb']:11.0f}")
    print()
    print(format_stats(stats))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"partition-{name}-{args.parts}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return result


def compare(args: argparse.Namespace) -> dict:
    """Edge cut and replication factor of several methods on one graph (see the module doc)."""
    from dorylus.partition.streaming import STREAMING_METHODS, array_chunks, cut_stats, stream_assign

    methods = [m.strip() for m in args.compare.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SystemExit(f"--compare: unknown method {', '.join(bad) or '(none)'}; known: {', '.join(METHODS)}")
    dataset = load(args.dataset)
    chunks = array_chunks(dataset.src, dataset.dst, args.chunk_edges)
    symmetric_edges = dataset.num_edges // 2 if not dataset.directed else dataset.num_edges
    rows = []
    for method in methods:
        start = time.perf_counter()
        if method in STREAMING_METHODS:
            parts = stream_assign(dataset.num_nodes, chunks, args.parts, method, seed=args.seed, passes=args.passes,
                                  num_edges=max(1, symmetric_edges))
        else:
            parts = assign_parts(dataset.num_nodes, dataset.src, dataset.dst, args.parts, method, seed=args.seed)
        seconds = time.perf_counter() - start
        stats = cut_stats(dataset.num_nodes, chunks, parts, args.parts, directed=dataset.directed)
        rows.append({"method": method, "seconds": round(seconds, 2), **stats.to_dict()})
        print(f"  {method}: {seconds:.1f} s, cut {stats.edge_cut:.4f}, replication {stats.replication_factor:.3f}",
              flush=True)
    print()
    print(f"{args.dataset}: N={dataset.num_nodes:,} E={dataset.num_edges:,}, {args.parts} parts; streaming: "
          f"{args.passes} passes, chunks of {args.chunk_edges:,} edges")
    print(f"{'method':>10}  {'seconds':>8}  {'edge cut':>8}  {'replication':>11}  {'balance':>7}  {'edge balance':>12}")
    for r in rows:
        print(f"{r['method']:>10}  {r['seconds']:8.2f}  {r['edge_cut']:8.4f}  {r['replication_factor']:11.3f}  "
              f"{r['balance']:7.3f}  {r['edge_balance']:12.3f}")
    name = Path(args.dataset).stem if args.dataset.endswith(".npz") else Path(args.dataset).name
    result = {"benchmark": "partition-compare", "dataset": args.dataset, "num_nodes": dataset.num_nodes,
              "num_edges": dataset.num_edges, "parts": args.parts, "passes": args.passes,
              "chunk_edges": args.chunk_edges, "rows": rows,
              "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"partition-compare-{name}-{args.parts}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
