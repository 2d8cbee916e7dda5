"""The ``dorylus`` command line. Each subcommand's ``--help`` explains every option."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Iterable

from dorylus import __version__
from dorylus.commandline import ROLE_HELP, run
from dorylus.errors import ConfigError
from dorylus.models import MODELS


def _stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_train(args: argparse.Namespace) -> int:
    # SIGTERM stops a run like Ctrl-C: checkpoint, stop every role, print how to resume.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = _train_or_resume(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"final test accuracy {summary['final_test_acc']:.4f} (val {summary['final_val_acc']:.4f}), "
          f"best val {summary['best_val_acc']:.4f} at epoch {summary['best_val_epoch']} "
          f"(test {summary['test_acc_at_best_val']:.4f}); {summary['total_s']:.2f} s total, "
          f"{summary['epoch_s'] * 1000:.1f} ms/epoch"
          + (f", ${summary['total_cost_usd']:.6f} ({summary['invocations']} function calls)"
             if "total_cost_usd" in summary else "")
          + f"; run directory {summary['run_dir']}")
    return 0


def _train_or_resume(args: argparse.Namespace) -> dict:
    from dorylus.config import config_from_args, overrides_from_args
    from dorylus.data.loaders import open_edge_stream
    from dorylus.coordinator.training import ClusterArgs, check_new_run, resume_training, run_cluster_training, run_training

    cluster = None
    if args.cluster:
        cluster = ClusterArgs(args.cluster, args.keys, args.cluster_wait_s)
    elif args.keys is not None:
        raise ConfigError("--keys names the coordinator's CURVE keys of a cluster; it needs --cluster "
                          "(a local run makes its own with --curve)")
    if args.resume:
        if args.config:
            raise ConfigError("--resume continues with the run's own config.json; --config cannot be combined with it")
        return resume_training(args.resume, overrides_from_args(args), cluster=cluster)
    if cluster is not None and args.preempt:
        raise ConfigError("--preempt plays AWS in a local run; a cluster's spot servers get real notices "
                          "(--spot-watch, docs/aws.md)")
    if cluster is not None:
        if args.dataset is not None:
            raise ConfigError("--cluster trains on the cluster file's partition store; --dataset does not apply")
        return run_cluster_training(config_from_args(args), cluster)
    config = check_new_run(config_from_args(args))
    if config.partitions:
        from dorylus.partition import open_store

        # Checksums cannot catch labels that were wrong when the store was written: refused
        # here, before the run directory exists, instead of failing at epoch 1 inside it.
        check_labels(open_store(config.partitions, verify=False), config.partitions)
    return run_training(config, None if config.partitions else open_edge_stream(config.dataset))


def check_labels(store, where: str) -> None:
    """ConfigError naming the first part with a label outside ``[0, num_classes)`` on a vertex
    of the train, val or test mask (labels of vertices in no mask are never read)."""
    classes = store.meta.num_classes
    for i in range(store.num_parts):
        part = store.load_part(i)
        used = part.train_mask | part.val_mask | part.test_mask
        bad = used & ((part.labels < 0) | (part.labels >= classes))
        if bad.any():
            rows = bad.nonzero()[0]
            first = int(rows[0])
            raise ConfigError(f"partition store {where}: part {i} has {rows.size} label(s) outside [0, {classes}) "
                              f"on masked vertices, the first {int(part.labels[first])} at global vertex "
                              f"{int(part.owned[first])}; rebuild the store from a dataset with labels in range")


def cmd_keys(args: argparse.Namespace) -> int:
    from dorylus.curve import ROLES, TFVARS_FILE, write_keys

    written = write_keys(args.out)
    print(f"wrote CURVE key pairs of {', '.join(ROLES)} into {args.out} (mode 0600): "
          f"{len(written)} files; {args.out / TFVARS_FILE} holds them as Terraform's curve_public_keys and "
          f"curve_secret_keys (terraform apply -var-file={args.out / TFVARS_FILE})")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from dorylus.data.loaders import load_dataset, open_edge_stream
    from dorylus.partition import check_store_target, format_stats, open_store, partition_stats
    from dorylus.partition.placement import StreamOptions, assign

    check_store_target(args.out, args.overwrite)  # before the minutes of loading and partitioning
    if args.tmp_dir is not None and not args.tmp_dir.is_dir():
        raise ConfigError(f"--tmp-dir {args.tmp_dir} is not an existing directory")
    start = time.perf_counter()
    stream = open_edge_stream(args.dataset)
    _stderr_progress(f"opened {stream.name}: {stream.num_nodes:,} vertices ({time.perf_counter() - start:.1f} s)")
    options = StreamOptions(passes=args.passes, imbalance=args.imbalance, chunk_edges=args.chunk_edges,
                            tmp_dir=args.tmp_dir, memory_budget_bytes=None if args.memory_budget_gb is None
                            else int(args.memory_budget_gb * 2**30))
    placement = assign(stream, args.parts, args.method, seed=args.seed, options=options,
                       load=lambda: load_dataset(args.dataset), progress=_stderr_progress)
    method = placement.method
    start = time.perf_counter()
    placement.write(args.out, seed=args.seed, overwrite=args.overwrite, sparse_features=args.sparse_features,
                    progress=_stderr_progress)
    _stderr_progress(f"wrote {args.out} ({time.perf_counter() - start:.1f} s)")
    stats = partition_stats(open_store(args.out, verify=False))
    print(format_stats(stats))
    total = stats["global"]
    print(f"replication factor (owned + ghosts) / N: "
          f"{(total['num_nodes'] + total['ghosts']) / total['num_nodes']:.3f} ({method})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from dorylus.partition import format_stats, open_store, partition_stats

    store = open_store(args.store, verify=True)
    check_labels(store, args.store)
    print(json.dumps({k: v for k, v in store.meta.to_dict().items() if k not in ("files", "parts")}, indent=2))
    stats = partition_stats(store)
    print(format_stats(stats))
    from graphserver.state import format_memory, memory_figures

    for i in range(store.num_parts):  # what a graph server holds before the model's row buffers
        print(f"part {i} graph-server state: {format_memory(memory_figures(store.load_part(i)))}")
    if args.model:
        print(_model_traffic(args, store.meta, stats))
    return 0


def _model_traffic(args: argparse.Namespace, meta, stats: dict) -> str:
    """What one epoch of ``args.model`` moves between the store's graph servers, and its calls."""
    from dorylus.config import TrainConfig
    from dorylus.models import get_model
    from dorylus.models.spec import ModelSpec

    config = TrainConfig(model=args.model, **{k: getattr(args, k) for k in ("layers", "hidden", "heads", "out_heads")
                                              if getattr(args, k) is not None})
    spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
    plan = get_model(args.model).build_plan(spec)
    ghosts = stats["global"]["ghosts"]
    train, evaluate = (4 * ghosts * plan.ghost_columns(training) for training in (True, False))
    shapes = " -> ".join([str(spec.layers[0].in_dim)] + [str(layer.output_width) for layer in spec.layers])
    return (f"{args.model} ({shapes}, parameters {spec.named_shapes()}): per epoch, ghost rows carry "
            f"{train / 1e6:,.1f} MB ({train:,} bytes) in the training pass and {evaluate / 1e6:,.1f} MB in an "
            f"evaluation pass; "
            f"{plan.function_calls_per_interval(True)} + {plan.function_calls_per_interval(False)} function calls "
            f"per interval")


def cmd_generate(args: argparse.Namespace) -> int:
    from dorylus.data.loaders import save_npz
    from dorylus.data.synthetic import STREAMED_PRESETS, generate_preset, write_streamed

    if args.preset in STREAMED_PRESETS:
        if args.out.suffix.lower() == ".npz":
            raise ConfigError(f"{args.preset} is written as a dataset directory, not an .npz: give --out a directory path")
        meta = write_streamed(args.preset, args.out, seed=args.seed, chunk_vertices=args.chunk_vertices,
                              overwrite=args.overwrite, progress=_stderr_progress)
        print(f"wrote {args.out}: {meta['num_nodes']:,} vertices, {meta['num_edges']:,} edges, "
              f"{meta['num_features']} features, {meta['num_classes']} classes (dataset directory)")
        return 0
    if args.chunk_vertices is not None:
        raise ConfigError(f"--chunk-vertices applies to the streamed presets ({', '.join(STREAMED_PRESETS)}), "
                          f"not {args.preset}")
    dataset = generate_preset(args.preset, seed=args.seed, progress=_stderr_progress)
    save_npz(dataset, args.out)
    print(f"wrote {args.out}: {dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges, "
          f"{dataset.num_features} features, {dataset.num_classes} classes")
    return 0


def _int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (one message shape for every such option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def cmd_package_lambda(args: argparse.Namespace) -> int:
    from dorylus.packaging import package_lambda

    bundle = package_lambda(args.out, python=args.python, arch=args.arch, wheels_dir=args.wheels,
                            cache_dir=args.cache_dir)
    if bundle.left_out:
        _stderr_progress(f"left out (imported only inside functions, and they need torch): {', '.join(bundle.left_out)}")
    print(f"{bundle.path}: {bundle.zipped_bytes:,} bytes ({bundle.unzipped_bytes:,} unzipped, {bundle.entries} files), "
          f"sha256 {bundle.sha256}")
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    from dorylus.partition.s3 import upload_store

    uploaded = upload_store(args.store, args.url, endpoint_url=args.s3_endpoint_url, progress=_stderr_progress)
    print(f"uploaded {uploaded.files} files ({uploaded.bytes:,} bytes) to {uploaded.url}; every object's "
          f"checksum matches meta.json")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dorylus.report import write_report

    out = write_report(args.runs, args.out)
    print(f"wrote {out / 'index.md'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dorylus.plan.command import run_from_args

    return run_from_args(args)


# `dorylus --help` lists every command by these lines without importing what each one needs.
COMMAND_HELP = {
    "train": "train a GNN; writes a run directory",
    "keys": "make CURVE key pairs for the roles of a cluster",
    "partition": "partition a dataset into a partition store",
    "inspect": "verify a partition store and print its statistics",
    "generate": "generate a synthetic dataset preset (.npz, or a dataset directory)",
    "package-lambda": "build the AWS Lambda function zip (numpy + pyzmq + lambdas/)",
    "upload": "upload a partition store to S3, verifying every object's checksum",
    "report": "plot one or more runs and compare their time, dollars and value",
    "plan": "predict epoch time, dollars and value of lambda, CPU and GPU configurations",
    **ROLE_HELP,
}


def _add_train(sub) -> None:
    from dorylus.config import add_config_arguments

    train = sub.add_parser("train", help=COMMAND_HELP["train"],
                           description="Train a GNN full-graph. Options come from the defaults, then --config, "
                                       "then flags. Writes config.json, metrics.jsonl, checkpoint.pt and summary.json "
                                       "into the run directory.")
    add_config_arguments(train)
    train.add_argument("--cluster", metavar="FILE",
                       help="cluster mode: train on the graph and parameter servers already running at the addresses "
                            "of FILE (`terraform output -json cluster`, or the same shape by hand; see docs/aws.md), "
                            "invoking the function it names; every connection uses CURVE. The servers must run "
                            "this run's training config (the coordinator checks) and are stopped at the end")
    train.add_argument("--keys", metavar="DIR", type=Path,
                       help="with --cluster: the CURVE keys directory of `dorylus keys` (default: the cluster file's "
                            "\"keys\", else the cluster's SSM parameters)")
    train.add_argument("--cluster-wait-s", type=float, default=120.0, metavar="S",
                       help="with --cluster: how long to wait for servers that are still starting (default: 120)")
    train.set_defaults(func=cmd_train)


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help=COMMAND_HELP["keys"],
                          description="Write a new CURVE key pair for each role (coordinator, graphserver, paramserver, "
                                      "function) into DIR as <role>.public and <role>.secret (Z85 text, mode 0600), and "
                                      "curve.tfvars.json with all of them as the Terraform module's curve_public_keys "
                                      "and curve_secret_keys. Servers take --keys DIR, `dorylus train --cluster` takes "
                                      "--keys DIR; the function reads its keys from DORYLUS_CURVE_* environment "
                                      "variables (Terraform sets them). Refuses to overwrite existing keys.")
    keys.add_argument("--out", required=True, type=Path, metavar="DIR",
                      help="directory to write into (created mode 0700 if missing)")
    keys.set_defaults(func=cmd_keys)


def _add_partition(sub) -> None:
    part = sub.add_parser("partition", help=COMMAND_HELP["partition"],
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="Partition a dataset and write the partition store (meta.json + part-<i>/), "
                                      "then print per-partition statistics and the replication factor.\n\n"
                                      "--method auto (the default) estimates METIS' memory as 16 bytes per listed "
                                      "edge (the in-memory edge list) + 160 bytes per adjacency entry (E entries "
                                      "when the list holds both directions of each pair, as generated datasets do, "
                                      "else 2E; measured 155 on an ogbn-products-sized graph) + 64 bytes per vertex, and uses METIS "
                                      "if that fits --memory-budget-gb (default: 25% of MemAvailable), else Fennel. "
                                      "ldg and fennel stream the edges in chunks of --chunk-edges: memory is 4 x parts "
                                      "+ 2 bytes per vertex plus one chunk, and the store is written one part at a time "
                                      "from in-edge buckets in temporary files (--tmp-dir).")
    part.add_argument("--dataset", required=True,
                      help="preset name or path (.npz, edge list, OGB directory, dataset directory from `dorylus "
                           "generate`); ldg/fennel read dataset directories, .npz and edge lists in chunks, "
                           "other formats whole")
    part.add_argument("--parts", type=_positive_int, required=True, help="number of partitions (graph servers)")
    part.add_argument("--method", default="auto", choices=("auto", "metis", "ldg", "fennel", "random", "contiguous"),
                      help="auto (default): metis if its memory estimate fits the budget, else fennel (rule above); "
                           "metis: k-way min edge cut (pymetis, 32-bit CSR built in row blocks); ldg / fennel: "
                           "streaming over edge chunks with --passes passes; random: seeded balanced; contiguous: "
                           "id ranges")
    part.add_argument("--passes", type=_positive_int, default=3,
                      help="ldg/fennel: passes over the edges; every pass after the first re-decides each vertex "
                           "on its whole neighbourhood (default 3)")
    part.add_argument("--imbalance", type=_fraction, default=0.05,
                      help="ldg/fennel: no part's load exceeds ceil((1 + IMBALANCE) * W / parts) plus one "
                           "vertex, a vertex weighing the mean degree plus its degree (half vertices, half edges), "
                           "in [0, 1] (default 0.05)")
    part.add_argument("--chunk-edges", type=_positive_int, default=1 << 23,
                      help="ldg/fennel: edges read per chunk (default 8388608: about 0.3 GB of temporaries)")
    part.add_argument("--tmp-dir", type=Path, default=None,
                      help="ldg/fennel: existing directory for the in-edge buckets, about 8 bytes per in-edge, "
                           "removed at the end (default: beside --out)")
    part.add_argument("--memory-budget-gb", type=_positive_float, default=None,
                      help="auto: memory METIS may use, in GiB (default: 25%% of MemAvailable)")
    part.add_argument("--out", required=True, type=Path, help="output directory (must not exist or be empty)")
    part.add_argument("--seed", type=_non_negative_int, default=0,
                      help="seed for random, METIS and the streaming methods' fill order (default 0)")
    part.add_argument("--overwrite", action="store_true", help="replace an existing store (atomically)")
    part.add_argument("--sparse-features", default="auto", choices=("auto", "on", "off"),
                      help="store the features as CSR: 'auto' (default) when a part's density is below 0.1")
    part.set_defaults(func=cmd_partition)


def _add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help=COMMAND_HELP["inspect"],
                             description="Load a partition store, verify format version and checksums and that "
                                         "every label on a train, val or test vertex is in [0, num_classes), and "
                                         "print per-partition statistics (owned vertices, edges, ghosts, send volume).")
    inspect.add_argument("store", help="partition store directory, or s3://BUCKET/PREFIX (downloaded into the "
                                       "local cache first; AWS_ENDPOINT_URL_S3 picks another S3 endpoint)")
    inspect.add_argument("--model", choices=tuple(MODELS),
                         help="also print what one epoch of this model moves between the graph servers")
    for flag, what in (("--layers", "layers"), ("--hidden", "hidden width (gat: per head)"),
                       ("--heads", "gat: hidden layers' heads"), ("--out-heads", "gat: last layer's heads")):
        inspect.add_argument(flag, type=int, help=f"with --model: {what} (default: train's)")
    inspect.set_defaults(func=cmd_inspect)


def _add_generate(sub) -> None:
    from dorylus.data.synthetic import preset_names, streamed_preset_names

    gen = sub.add_parser("generate", help=COMMAND_HELP["generate"],
                         description="Generate a seeded synthetic graph (a preset). In-memory presets "
                                     f"({', '.join(preset_names())}) are saved as .npz; streamed presets "
                                     f"({', '.join(streamed_preset_names())}) are written to a dataset directory "
                                     "(meta.json + memory-mappable .npy files) a chunk of sources at a time, without "
                                     "holding the edges: about 80 bytes per vertex plus one chunk.")
    gen.add_argument("preset", help="preset name: " + ", ".join(preset_names() + streamed_preset_names()))
    gen.add_argument("--out", required=True, type=Path,
                     help="output .npz path (in-memory presets) or directory (streamed presets)")
    gen.add_argument("--seed", type=_non_negative_int, default=0, help="generator seed (default 0)")
    gen.add_argument("--chunk-vertices", type=_positive_int, default=None,
                     help="streamed presets: sources generated per chunk (memory only; the output is the same "
                          "for every value; default: about 4M pairs per chunk)")
    gen.add_argument("--overwrite", action="store_true",
                     help="streamed presets: replace an existing directory (an .npz is always replaced)")
    gen.set_defaults(func=cmd_generate)


def _add_package_lambda(sub) -> None:
    pack = sub.add_parser("package-lambda", help=COMMAND_HELP["package-lambda"],
                          description="Build the function's deployment zip: manylinux wheels of numpy and pyzmq for "
                                      "the Lambda runtime's Python and architecture, plus lambdas/ and the torch-free "
                                      "dorylus modules the handler imports. Reproducible (same bytes when built "
                                      "again); refused if it would contain torch or exceed Lambda's limits (50 MB "
                                      "zipped, 250 MB unzipped). Prints the zip's path, size and sha256.")
    pack.add_argument("--out", required=True, type=Path, help="the zip file to write (replaced atomically)")
    pack.add_argument("--python", default="3.12", help="the Lambda runtime's Python version, e.g. 3.11 or 3.12 "
                                                        "(default 3.12; must match terraform's function_python)")
    pack.add_argument("--arch", default="x86_64", choices=("x86_64", "arm64"),
                      help="the function's architecture (default x86_64; must match terraform's function_architecture)")
    source = pack.add_mutually_exclusive_group()
    source.add_argument("--wheels", type=Path, metavar="DIR",
                        help="use the numpy and pyzmq wheels already in DIR (no download)")
    source.add_argument("--cache-dir", type=Path, metavar="DIR",
                        help="where pip-downloaded wheels are kept and reused (default: $DORYLUS_CACHE_DIR/wheels "
                             "or ~/.cache/dorylus/wheels)")
    pack.set_defaults(func=cmd_package_lambda)


def _add_upload(sub) -> None:
    upload = sub.add_parser("upload", help=COMMAND_HELP["upload"],
                            description="Upload a partition store directory to s3://BUCKET/PREFIX (multipart for "
                                        "large files, SHA-256 checksums checked by S3 on every part and compared "
                                        "afterwards with meta.json's). meta.json goes last, so a reader never sees "
                                        "a store whose files are not all there. Graph servers and `dorylus "
                                        "inspect` then take the s3:// URL as a store path.")
    upload.add_argument("store", type=Path, help="partition store directory (verified before uploading)")
    upload.add_argument("url", help="destination, s3://BUCKET/PREFIX")
    upload.add_argument("--s3-endpoint-url", metavar="URL",
                        help="another S3 endpoint (default: AWS, or $AWS_ENDPOINT_URL_S3)")
    upload.set_defaults(func=cmd_upload)


def _add_report(sub) -> None:
    report = sub.add_parser("report", help=COMMAND_HELP["report"],
                            description="Write a report directory (RUN_DIR/report of the first run, or --out): "
                                        "index.md with PNG plots of the runs: loss and accuracy "
                                        "against epoch, wall time and dollars; seconds per epoch by task kind; "
                                        "dollars per epoch by component; and a table and chart of seconds, dollars "
                                        "and value (1 / (s/epoch x $/epoch)) across runs. Reads only config.json and "
                                        "metrics.jsonl, so a run still going or interrupted can be reported.")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (from `dorylus train`)")
    report.add_argument("--out", type=Path, metavar="DIR",
                        help="report directory, replaced if it exists (default: RUN_DIR/report of the first run)")
    report.set_defaults(func=cmd_report)


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help=COMMAND_HELP["plan"],
                          description="Calibrate this machine (Gather, matmul and dropout rates of one thread, ZeroMQ "
                                      "loopback, the emulator's invoke latency, a GPU's rates when CUDA is present) "
                                      "or read a saved calibration, then predict one epoch of --model: by default for "
                                      "lambda + CPU graph servers, CPU-only and GPU instances at Reddit, Amazon and "
                                      "Friendster scale on AWS; with --dataset, --partitions or --run, for a local "
                                      "run on this machine.")
    from dorylus.plan.command import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def _add_role(sub, name: str, module) -> None:
    role = sub.add_parser(name, help=COMMAND_HELP[name], description=COMMAND_HELP[name])
    module.add_arguments(role)
    role.set_defaults(func=module.run_from_args)


def _add_graphserver(sub) -> None:
    from graphserver import server

    _add_role(sub, "graphserver", server)


def _add_paramserver(sub) -> None:
    from dorylus import paramserver

    _add_role(sub, "paramserver", paramserver)


def _add_lambda_emulator(sub) -> None:
    from dorylus import emulator

    _add_role(sub, "lambda-emulator", emulator)


_ADDERS = {
    "train": _add_train, "keys": _add_keys, "partition": _add_partition, "inspect": _add_inspect,
    "generate": _add_generate, "package-lambda": _add_package_lambda, "upload": _add_upload, "report": _add_report,
    "plan": _add_plan, "graphserver": _add_graphserver, "paramserver": _add_paramserver,
    "lambda-emulator": _add_lambda_emulator,
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``dorylus`` parser. Every command is listed; only those in ``commands`` (default:
    all) get their options, and so import their modules: ``dorylus paramserver`` imports no
    other role, ``dorylus keys`` not torch."""
    parser = argparse.ArgumentParser(
        prog="dorylus", description="Dorylus: full-graph GNN training on CPU graph servers and serverless functions."
    )
    parser.add_argument("--version", action="version", version=f"dorylus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in _ADDERS.items():
        if commands is None or name in commands:
            add(sub)
        else:
            sub.add_parser(name, help=COMMAND_HELP[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Named before parsing so that a Ctrl-C while the parser's modules import still says whose it is.
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"dorylus {command}" if command else "dorylus"

    def body() -> int:
        args = build_parser([command] if command else []).parse_args(argv)
        return args.func(args)

    return run(prog, body)


if __name__ == "__main__":
    sys.exit(main())
