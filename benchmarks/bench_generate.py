"""Wall time and peak memory of generating a synthetic preset (one process, one core).

Peak memory is the process' resident high-water mark (``VmHWM`` from ``/proc/self/status``;
``ru_maxrss`` where that is unavailable), read right after generation, so it includes the
interpreter and numpy (reported separately as the baseline). Graph statistics (edge homophily,
degrees) are computed afterwards and do not count toward the peak.

    python benchmarks/bench_generate.py                      # synthetic-reddit
    python benchmarks/bench_generate.py synthetic-small --seed 1

Prints a table and writes ``benchmarks/results/generate-<preset>.json``.
"""

from __future__ import annotations

import os

# Single-threaded by construction; pin any BLAS pool so the measurement is of one core.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from dorylus import atomic  # noqa: E402
from dorylus.data.synthetic import PRESETS, generate_preset, preset_names  # noqa: E402
from common import status_kb

RESULTS = Path(__file__).resolve().parent / "results"


def peak_gb() -> float:
    kb = status_kb("VmHWM")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 2**20


def graph_stats(ds) -> dict:
    """Edge homophily over undirected pairs (the first half of the edge list) and degrees."""
    half = ds.num_edges // 2
    same = 0
    for lo in range(0, half, 1 << 24):  # chunked to keep the label gathers small
        hi = min(lo + (1 << 24), half)
        same += int(np.count_nonzero(ds.labels[ds.src[lo:hi]] == ds.labels[ds.dst[lo:hi]]))
    degree = np.bincount(ds.src, minlength=ds.num_nodes)
    return {
        "edge_homophily": same / max(half, 1),
        "degree_median": float(np.median(degree)),
        "degree_mean": float(degree.mean()),
        "degree_max": int(degree.max()),
        "isolated_vertices": int(np.count_nonzero(degree == 0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="synthetic-reddit", choices=preset_names(),
                        help="synthetic preset to generate (default: synthetic-reddit)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    parser.add_argument("--quiet", action="store_true", help="do not print generation progress")
    args = parser.parse_args()

    baseline = peak_gb()
    start = time.perf_counter()
    progress = None if args.quiet else (
        lambda msg: print(f"  [{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)
    )
    ds = generate_preset(args.preset, seed=args.seed, progress=progress)
    seconds = time.perf_counter() - start
    peak = peak_gb()

    spec = PRESETS[args.preset]
    result = {
        "benchmark": "generate",
        "preset": args.preset,
        "seed": args.seed,
        "nodes": ds.num_nodes,
        "edges": ds.num_edges,
        "features": ds.num_features,
        "classes": ds.num_classes,
        "seconds": round(seconds, 2),
        "peak_rss_gb": round(peak, 3),
        "baseline_rss_gb": round(baseline, 3),
        "output_gb": round((ds.src.nbytes + ds.dst.nbytes + ds.features.nbytes + ds.labels.nbytes) / 2**30, 3),
        "spec_homophily": spec.homophily,
        **graph_stats(ds),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    header = ("preset", "nodes", "edges", "features", "seconds", "peak GB")
    row = (args.preset, f"{ds.num_nodes:,}", f"{ds.num_edges:,}", str(ds.num_features), f"{seconds:.1f}", f"{peak:.2f}")
    widths = [max(len(h), len(v)) for h, v in zip(header, row)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    print(f"edge homophily {result['edge_homophily']:.3f} (spec {spec.homophily}), degree median "
          f"{result['degree_median']:.0f} / mean {result['degree_mean']:.1f} / max {result['degree_max']}, "
          f"baseline RSS {baseline:.2f} GB, output {result['output_gb']:.2f} GB")

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"generate-{args.preset}.json"
    atomic.write_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
