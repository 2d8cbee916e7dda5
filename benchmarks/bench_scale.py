"""End to end at scale: generate a streamed graph, partition it, train a few epochs; time and
peak memory of every step and every role.

For each size (``10m`` = ``synthetic-10m``, ``60m`` = ``synthetic-products``, ``250m`` =
``synthetic-250m``; the streamed presets of :mod:`dorylus.data.synthetic`):

1. ``dorylus generate PRESET --out DIR`` (skipped when DIR already holds that preset and seed);
2. ``dorylus partition --dataset DIR --parts P --method METHOD`` (``auto`` by default: METIS where
   its estimated memory fits, else Fennel streamed from disk);
3. for each backend, ``dorylus train --partitions STORE --backend B --epochs 3 --eval-every 3``;
4. with ``--whole``, for each backend the whole ``dorylus train --dataset DIR`` command (load,
   partition with ``--method``, train), whose memory is reported as the peak of its processes'
   resident (RSS) and proportional (PSS) sizes taken together at one moment.

Every command runs under ``/usr/bin/time -v`` (its peak RSS is the command's own process; the
roles are children); while training, the benchmark polls ``/proc/<pid>/status`` of every
process below the command every 0.2 s and keeps each one's ``VmHWM`` (its lifetime resident
peak), grouped by role: ``coordinator`` (the ``dorylus train`` process), ``graphserver``
(largest of the P), ``paramserver``, ``lambda-emulator`` (with its worker processes). The
whole command's peak is the sum of the roles' peaks (an upper bound: they need not peak
together). Resident pages include file-backed pages of memory-mapped store files, which the
kernel can reclaim.

Every training command evaluates in its last epoch only. Epoch time (``epoch_s``) is the mean
``epoch_s`` of ``metrics.jsonl`` over the training epochs from the second on (the first carries
warm-up), ``eval_epoch_s`` that of the epochs that also evaluated; bytes per edge is a graph
server's peak RSS over its part's in-edges, and the sum of the roles' peaks over the graph's
directed edges.

    python benchmarks/bench_scale.py --sizes 10m                  # development size
    python benchmarks/bench_scale.py --sizes 10m,60m,250m --backends cpu,lambda

Prints a table and writes ``benchmarks/results/scale.json`` (or ``--json``). Data goes under
``--workdir`` (default ``dorylus-scale`` in the system's temp directory, ``tempfile.gettempdir()``:
``$TMPDIR`` or ``/tmp``), never into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine_info, write_json

SIZES = {"10m": "synthetic-10m", "60m": "synthetic-products", "250m": "synthetic-250m"}
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
TIME = "/usr/bin/time"
WORKDIR = Path(tempfile.gettempdir()) / "dorylus-scale"


def _dorylus() -> list[str]:
    return [sys.executable, "-m", "dorylus.cli"]


def _timed(argv: list[str], log: Path, timeout: float, watch: bool = False) -> dict:
    """Run ``argv`` under ``/usr/bin/time -v``; return seconds, exit code, the command's peak RSS
    (MB), and with ``watch`` the per-role peaks of its process tree."""
    cmd = ([TIME, "-v"] if Path(TIME).exists() else []) + argv
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        peaks: dict[int, tuple[str, float]] = {}
        together: dict[str, float] = {}
        stop = threading.Event()
        poller = (threading.Thread(target=_poll_tree, args=(proc.pid, peaks, stop, together), daemon=True)
                  if watch else None)
        if poller:
            poller.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        stop.set()
        if poller:
            poller.join()
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    result = {"seconds": round(seconds, 2), "exit": code,
              "peak_rss_mb": round(int(found.group(1)) / 1024, 1) if found else None}
    if watch:
        roles: dict[str, float] = {}
        for role, mb in peaks.values():
            roles[role] = max(roles.get(role, 0.0), mb) if role == "graphserver" else roles.get(role, 0.0) + mb
        # (graph servers: the largest one; other roles: summed over their processes)
        result["role_peak_mb"] = {k: round(v, 1) for k, v in sorted(roles.items())}
        result["graphserver_peaks_mb"] = sorted(round(mb, 1) for role, mb in peaks.values() if role == "graphserver")
        result["sum_of_peaks_mb"] = round(sum(mb for _, mb in peaks.values()), 1)
        result.update({k: round(v, 1) for k, v in together.items()})
    return result


def _role(cmdline: list[str]) -> str | None:
    """The role a command line names, or ``None`` (a helper process: it takes its parent's).
    The Lambda emulator's HTTP server runs inside the coordinator; its function workers are
    ``multiprocessing`` spawns (``lambda-workers``, summed)."""
    text = " ".join(cmdline)
    for needle, role in (("graphserver.server", "graphserver"), ("dorylus.paramserver", "paramserver"),
                         ("resource_tracker", "other"), ("multiprocessing", "lambda-workers"),
                         ("dorylus.cli train", "coordinator")):
        if needle in text:
            return role
    return None


def _poll_tree(root: int, peaks: dict, stop: threading.Event, together: dict) -> None:
    """Every 0.2 s, each process below ``root``: its role (by command line, else its nearest
    ancestor's) and the largest ``VmHWM`` seen, into ``peaks[pid] = (role, MB)``; and into
    ``together`` the largest sum of the processes' current RSS seen at once
    (``rss_together_peak_mb``) and, every fifth poll, of their PSS (``pss_together_peak_mb``:
    shared pages such as the libraries' split among the processes that map them)."""
    import psutil

    polls = 0
    try:
        top = psutil.Process(root)
    except psutil.Error:
        return
    roles: dict[int, str] = {}
    while not stop.is_set():
        try:
            procs = top.children(recursive=True)
        except psutil.Error:
            break
        polls += 1
        rss_now = pss_now = 0
        for p in procs:
            try:
                if polls % 5 == 0:
                    pss_now += _rollup_kb(p.pid, "Pss:")
                if p.pid not in roles:
                    role, q = _role(p.cmdline()), p
                    while role is None and q.ppid() not in (0, root):
                        q = psutil.Process(q.ppid())
                        role = roles.get(q.pid) or _role(q.cmdline())
                    if role is None:
                        continue
                    roles[p.pid] = role
                with open(f"/proc/{p.pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM:", "VmRSS:")))
                hwm = int(fields["VmHWM"].split()[0]) if "VmHWM" in fields else None
                rss_now += int(fields["VmRSS"].split()[0]) if "VmRSS" in fields else 0
            except (psutil.Error, OSError):
                continue
            if hwm is not None:
                old = peaks.get(p.pid, (roles[p.pid], 0.0))
                peaks[p.pid] = (roles[p.pid], max(old[1], hwm / 1024))
        together["rss_together_peak_mb"] = max(together.get("rss_together_peak_mb", 0.0), rss_now / 1024)
        if polls % 5 == 0:
            together["pss_together_peak_mb"] = max(together.get("pss_together_peak_mb", 0.0), pss_now / 1024)
        stop.wait(0.2)


def _rollup_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field)), 0)
    except OSError:
        return 0


def _meta(path: Path) -> dict | None:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def run_size(size: str, args: argparse.Namespace) -> dict:
    preset = SIZES[size]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data, store = work / preset, work / f"{preset}-store-{args.parts}"
    row: dict = {"size": size, "preset": preset}
    print(f"== {size} ({preset})", flush=True)

    meta = _meta(data)
    if meta and meta.get("generator", {}).get("seed") == args.seed and meta.get("name") == preset:
        row["generate"] = {"reused": True}
        print("  generate: reusing", data, flush=True)
    else:
        row["generate"] = _timed(_dorylus() + ["generate", preset, "--out", str(data), "--seed", str(args.seed),
                                               "--overwrite"], work / f"{preset}-generate.log", args.timeout)
        print(f"  generate: {row['generate']}", flush=True)
        if row["generate"]["exit"] != 0:
            return row
        meta = _meta(data)
    row.update(num_nodes=meta["num_nodes"], num_edges=meta["num_edges"], num_features=meta["num_features"],
               disk_gb=round(sum(f.stat().st_size for f in data.iterdir()) / 2**30, 2))

    log = work / f"{preset}-partition.log"
    row["partition"] = _timed(_dorylus() + ["partition", "--dataset", str(data), "--parts", str(args.parts),
                                            "--method", args.method, "--out", str(store), "--overwrite",
                                            "--tmp-dir", str(work)], log, args.timeout)
    text = log.read_text(errors="replace")
    chosen = re.search(r"replication factor \(owned \+ ghosts\) / N: ([0-9.]+) \((\w+)\)", text)
    cut = re.search(r"edge cut: ([0-9,]+) of ([0-9,]+) edges", text)
    if chosen:
        row["partition"].update(replication_factor=float(chosen.group(1)), method=chosen.group(2))
    if cut:
        row["partition"]["edge_cut"] = round(int(cut.group(1).replace(",", "")) / int(cut.group(2).replace(",", "")), 4)
    print(f"  partition: {row['partition']}", flush=True)
    if row["partition"]["exit"] != 0:
        return row
    store_meta = _meta(store)
    part_edges = [p["nnz"] - p["num_owned"] for p in store_meta["parts"]]

    row["train"] = {}
    if size not in args.train_sizes:
        row["train_skipped"] = "not in --train-sizes"
        return row
    for backend in args.backends:
        row["train"][backend] = _train(["--partitions", str(store)], work / f"{preset}-run-{backend}",
                                       work / f"{preset}-train-{backend}.log", backend, args, part_edges,
                                       row["num_edges"])
        print(f"  train {backend}: {row['train'][backend]}", flush=True)
    if args.whole:
        row["whole"] = {}
        for backend in args.backends:
            row["whole"][backend] = _train(["--dataset", str(data), "--partition-method", args.method,
                                            "--parts", str(args.parts)],
                                           work / f"{preset}-whole-{backend}", work / f"{preset}-whole-{backend}.log",
                                           backend, args, part_edges, row["num_edges"])
            print(f"  whole train {backend}: {row['whole'][backend]}", flush=True)
    return row


def _train(source: list[str], run: Path, log: Path, backend: str, args: argparse.Namespace, part_edges: list[int],
           num_edges: int) -> dict:
    """``dorylus train`` on ``source`` (``--partitions STORE``, or ``--dataset DIR`` for the whole
    command: load, partition, train) with its time, epochs and memory."""
    shutil.rmtree(run, ignore_errors=True)  # a run directory must be new
    result = _timed(_dorylus() + ["train", *source, "--backend", backend, "--epochs", str(args.epochs),
                                  "--eval-every", str(args.epochs), "--run-dir", str(run), "--seed", str(args.seed)],
                    log, args.timeout, watch=True)
    try:
        epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        epochs = []
    if any("epoch_s" in e for e in epochs):
        result.update(epoch_times(epochs), final_test_acc=epochs[-1].get("test_acc"))
    gs = result.get("graphserver_peaks_mb") or []
    if gs:
        result["graphserver_bytes_per_in_edge"] = round(max(gs) * 2**20 / max(part_edges), 1)
    if result.get("sum_of_peaks_mb"):
        result["bytes_per_edge_all_roles"] = round(result["sum_of_peaks_mb"] * 2**20 / num_edges, 1)
    if result["exit"] != 0:
        result["log_tail"] = log.read_text(errors="replace").splitlines()[-5:]
    return result


def epoch_times(epochs: list[dict]) -> dict:
    """From ``metrics.jsonl``'s records: ``epoch_s``, the mean of the training epochs after the
    first (its warm-up; the first itself when it is the only one), ``eval_epoch_s``, the mean of
    the later epochs that also evaluated (``test_acc`` set), and ``epoch_s_all``; None where
    there is no such epoch."""
    timed = [e for e in epochs if "epoch_s" in e]
    later = timed[1:] or timed

    def mean(times: list[float]) -> float | None:
        return round(sum(times) / len(times), 3) if times else None

    return {"epoch_s": mean([e["epoch_s"] for e in later if e.get("test_acc") is None]),
            "eval_epoch_s": mean([e["epoch_s"] for e in later if e.get("test_acc") is not None]),
            "epoch_s_all": [round(e["epoch_s"], 3) for e in timed]}


def format_whole_table(rows: list[dict]) -> str:
    """The whole ``dorylus train --dataset`` command (load, partition, train) per size and backend."""
    header = ("size", "backend", "command s", "epoch s", "eval epoch s", "RSS together GB", "PSS together GB",
              "coord GB", "GS GB")
    lines = [header]
    for r in rows:
        for backend, t in (r.get("whole") or {}).items():
            roles = t.get("role_peak_mb", {})
            gb = lambda mb: "-" if mb is None else f"{mb / 1024:.2f}"  # noqa: E731
            lines.append((r["size"], backend, f"{t.get('seconds', '-')}" + ("" if t.get("exit", 0) == 0 else f" ({t.get('exit')})"),
                          f"{t.get('epoch_s', '-')}", f"{t.get('eval_epoch_s', '-')}",
                          gb(t.get("rss_together_peak_mb")), gb(t.get("pss_together_peak_mb")),
                          gb(roles.get("coordinator")), gb(roles.get("graphserver"))))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_table(rows: list[dict]) -> str:
    header = ("size", "edges", "gen s", "gen GB", "part method", "part s", "part GB", "cut", "repl",
              "backend", "epoch s", "eval epoch s", "coord GB", "GS GB", "PS GB", "workers GB", "B/in-edge GS",
              "B/edge all")
    lines = [header]
    for r in rows:
        gen = r.get("generate", {})
        part = r.get("partition", {})
        base = (r["size"], f"{r.get('num_edges', 0):,}",
                "reused" if gen.get("reused") else f"{gen.get('seconds', '-')}",
                "-" if gen.get("reused") or gen.get("peak_rss_mb") is None else f"{gen['peak_rss_mb'] / 1024:.2f}",
                str(part.get("method", "-")), f"{part.get('seconds', '-')}" + ("" if part.get("exit", 0) == 0 else f" ({part.get('exit')})"),
                "-" if part.get("peak_rss_mb") is None else f"{part['peak_rss_mb'] / 1024:.2f}",
                f"{part.get('edge_cut', '-')}", f"{part.get('replication_factor', '-')}")
        for backend, t in (r.get("train") or {"-": {}}).items():
            roles = t.get("role_peak_mb", {})

            def gb(role: str) -> str:
                return f"{roles[role] / 1024:.2f}" if role in roles else "-"

            status = "" if t.get("exit", 0) == 0 else f" ({t.get('exit')})"
            lines.append(base + (backend, f"{t.get('epoch_s', '-')}{status}", f"{t.get('eval_epoch_s', '-')}",
                                 gb("coordinator"), gb("graphserver"), gb("paramserver"), gb("lambda-workers"),
                                 f"{t.get('graphserver_bytes_per_in_edge', '-')}", f"{t.get('bytes_per_edge_all_roles', '-')}"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10m", help="comma-separated, of 10m, 60m, 250m (default: 10m)")
    parser.add_argument("--backends", default="cpu,lambda", help="comma-separated training backends (default: cpu,lambda)")
    parser.add_argument("--train-sizes", default=None,
                        help="sizes that are also trained (default: all of --sizes); the others stop after partitioning")
    parser.add_argument("--parts", type=int, default=2, help="graph servers (default: 2)")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default: 3)")
    parser.add_argument("--method", default="auto", help="dorylus partition --method (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="generator and training seed (default: 0)")
    parser.add_argument("--workdir", default=str(WORKDIR), help=f"data, stores and runs (default: {WORKDIR})")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command before it is killed (default: 3600)")
    parser.add_argument("--whole", action="store_true",
                        help="also time the whole `dorylus train --dataset DIR` command per backend (load, "
                             "partition, train), with the peak of its processes' RSS and PSS taken together")
    parser.add_argument("--json", type=Path, default=RESULTS / "scale.json", help="result file")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        parser.error(f"--sizes: unknown size {', '.join(bad) or '(none)'}; known: {', '.join(SIZES)}")
    args.train_sizes = sizes if args.train_sizes is None else [t.strip() for t in args.train_sizes.split(",")]
    if any(t not in SIZES for t in args.train_sizes):
        parser.error(f"--train-sizes: each of {', '.join(SIZES)}, got {args.train_sizes}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or any(b not in ("cpu", "lambda", "gpu", "reference") for b in args.backends):
        parser.error(f"--backends: each of cpu, lambda, gpu, reference, got {args.backends}")
    if args.parts < 1 or args.epochs < 1:
        parser.error("--parts and --epochs must be >= 1")

    load_before = os.getloadavg()
    rows = [run_size(size, args) for size in sizes]
    result = {"benchmark": "scale", "parts": args.parts, "epochs": args.epochs, "method": args.method, "rows": rows,
              "machine": machine_info(load_before, os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print()
    print(format_table(rows))
    if args.whole:
        print()
        print(format_whole_table(rows))
    write_json(result, args.json)
    print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
