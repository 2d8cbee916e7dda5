"""``dorylus plan``: its options and its tables (see :mod:`dorylus.plan`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from dorylus.config import TrainConfig
from dorylus.errors import ConfigError
from dorylus.models import MODELS
from dorylus.plan.calibration import Calibration
from dorylus.plan.catalog import WORKLOADS
from dorylus.plan.model import MODES, Prediction, Setup, graph_bytes
from dorylus.plan.runtime import measure
from graphserver.backends import BACKENDS, backend_class
from graphserver.modes import mode_class
from dorylus.plan.planner import (
    LAMBDA_MEMORY_MB, LocalOptions, ScaleOptions, SpotOptions, and_list, local_default_backends, local_shape,
    measured_epoch_s, plan_local, plan_scale, predicted_backends, run_options, spot_estimate, to_json,
)

# The table at scale's yardstick ("value vs cpu"): CPU graph servers doing their own tensor work,
# what the paper compares Lambda and GPUs with.
BASELINE = "cpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cal = parser.add_argument_group("calibration")
    cal.add_argument("--calibration", metavar="FILE", type=Path,
                     help="read rates from FILE (written by --save-calibration) instead of measuring this machine")
    cal.add_argument("--save-calibration", metavar="FILE", type=Path, help="write the rates used to FILE (JSON)")
    cal.add_argument("--no-emulator", action="store_true",
                     help="do not start a Lambda emulator to time an invoke (then local lambda runs cannot be "
                          "predicted)")
    local = parser.add_argument_group("a local run (instead of the table at scale)")
    where = local.add_mutually_exclusive_group()
    where.add_argument("--dataset", metavar="SPEC",
                       help="predict `dorylus train --dataset SPEC` on this machine: a preset (sizes only, nothing "
                            "generated) or a dataset file, cut into --parts even partitions (see --cut-fraction)")
    where.add_argument("--partitions", metavar="STORE",
                       help="predict a run on the partition store STORE (its real partition sizes and ghost rows)")
    where.add_argument("--run", metavar="RUN_DIR",
                       help="predict the run in RUN_DIR with its own config and partitions, and print its measured "
                            "epoch time beside (the median of its epochs after the first, those with the evaluation "
                            "pass or those without as predicted)")
    local.add_argument("--backend", action="append", choices=BACKENDS,
                       help=f"backend(s) to predict, repeatable (default: {and_list(local_default_backends())})")
    local.add_argument("--parts", type=int, help="graph servers with --dataset (default 2)")
    local.add_argument("--intervals", type=int, default=2, help="intervals per graph server (default 2)")
    local.add_argument("--functions", type=int, help="concurrent calls per graph server (default: --intervals)")
    local.add_argument("--lambda-memory-mb", type=int,
                       help=f"function memory in MB (default: {LocalOptions.lambda_memory_mb} locally, as `dorylus "
                            f"train`; at scale the best value of {and_list([str(m) for m in LAMBDA_MEMORY_MB])})")
    model = parser.add_argument_group("model and run")
    model.add_argument("--hidden", type=int, help=f"hidden width (default: {LocalOptions.hidden} locally; "
                                                  f"{ScaleOptions.hidden} at scale)")
    model.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    model.add_argument("--model", choices=tuple(MODELS),
                       help=f"the model of a local prediction (default: {LocalOptions.model}, or the run's; the "
                            f"table at scale is {Setup.model.upper()}'s)")
    for name in ("heads", "out_heads"):
        model.add_argument(f"--{name.replace('_', '-')}", type=int,
                           help=f"{train_help(name)} (default: the model's, as `dorylus train`, or the run's)")
    model.add_argument("--mode", choices=MODES, help=mode_help())
    model.add_argument("--evaluate", action=argparse.BooleanOptionalAction, default=None,
                       help="include an evaluation pass in every epoch (default: yes locally, as `dorylus train "
                            "--eval-every 1`; no at scale)")
    model.add_argument("--static-cached", type=float, default=0.0, metavar="SHARE",
                       help="share of function calls whose warm container still holds their interval's features, "
                            "ids, labels and splits, so that they are not sent again (default 0: a call lands on any "
                            "idle container)")
    model.add_argument("--cut-fraction", type=float, default=0.5,
                       help="share of a partition's in-edges whose source lives on another partition, which sets "
                            "its ghost rows (default 0.5; a partition store gives the real ghost rows)")
    scale = parser.add_argument_group("the table at scale")
    scale.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                       help="workload(s) to price, repeatable (default: all)")
    defaults = ScaleOptions()
    scale.add_argument("--server", action="append", default=[], metavar="BACKEND=INSTANCE", type=backend_server,
                       help=f"graph-server instance of BACKEND's configuration, repeatable (default: the backend's: "
                            f"{scale_instances()})")
    scale.add_argument("--param-server", default=defaults.param_server,
                       help="parameter-server instance (default %(default)s)")
    spot = parser.add_argument_group(
        "spot graph servers", "price every prediction again with its graph servers on spot instances (the "
        "parameter server stays on-demand) and the expected cost of their interruptions: each loses about half "
        "a checkpoint interval of work plus the recovery time, for the whole cluster")
    spot_defaults = SpotOptions()
    spot.add_argument("--spot", action="store_true", help="add the spot estimate to the table")
    spot.add_argument("--spot-interruptions-per-hour", type=float, metavar="RATE",
                      help=f"interruptions per graph-server instance and hour, 0 to 60 (default "
                           f"{spot_defaults.interruptions_per_hour}: an assumption; a spot cluster's spot-events log "
                           f"gives a real rate)")
    spot.add_argument("--checkpoint-every", type=int, metavar="EPOCHS",
                      help=f"epochs between checkpoints, as `dorylus train --checkpoint-every` (default "
                           f"{spot_defaults.checkpoint_every})")
    spot.add_argument("--recovery-s", type=float, metavar="SECONDS",
                      help=f"seconds from an interruption to training again: a replacement's boot and the restart "
                           f"from the checkpoint (default {spot_defaults.recovery_s:g})")
    spot.add_argument("--spot-saving", type=float, metavar="FRACTION",
                      help="spot's saving over on-demand, in [0, 1) (default: the instance family's typical "
                           "saving from the Spot Instance Advisor, in dorylus/plan/catalog.py)")
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write the predictions to FILE as JSON")


def train_help(name: str) -> str:
    """The help of ``dorylus train``'s option ``name`` (its field in :mod:`dorylus.config`), which
    names the models it applies to."""
    return next(f.metadata["help"] for f in fields(TrainConfig) if f.name == name)


def mode_help() -> str:
    """``--mode``'s help: every mode of :data:`graphserver.modes.MODES` by its own description,
    and how the planner prices it (by its stage barrier, :mod:`dorylus.plan.model`)."""
    summed = [name for name in MODES if mode_class(name)().barrier_after_stage()]
    overlapped = [name for name in MODES if name not in summed]
    ahead = [name for name in overlapped if mode_class(name).bounded_staleness]
    text = "scheduler: " + "; ".join(f"'{name}' = {mode_class(name).description}" for name in MODES)
    if summed:
        text += f". Priced by its stage barrier: {and_list(summed)} sum{'s' * (len(summed) == 1)} the stages"
    if overlapped:
        text += (f"{'; ' if summed else '. Priced: '}{and_list(overlapped)} overlap{'s' * (len(overlapped) == 1)} "
                 f"graph work with function calls")
    if ahead:
        text += (f"; {and_list(ahead)} as if {'it' if len(ahead) == 1 else 'they'} never ran ahead across "
                 f"epochs (an upper bound)")
    return text + f" (default: {LocalOptions.mode} locally, {ScaleOptions.mode} at scale)"


def scale_instances() -> str:
    """Each predicted backend's graph-server instance at scale, for ``--server``'s help."""
    backends: dict[str, list[str]] = {}
    for name in predicted_backends():
        backends.setdefault(backend_class(name).scale_instance, []).append(name)
    return ", ".join(f"{instance} for {and_list(names)}" for instance, names in backends.items())


def backend_server(text: str) -> tuple[str, str]:
    """``--server BACKEND=INSTANCE`` as ``(backend, instance)``."""
    backend, sep, server = text.partition("=")
    if not sep or backend not in BACKENDS or not server:
        raise argparse.ArgumentTypeError(f"{text!r} is not BACKEND=INSTANCE with BACKEND one of {', '.join(BACKENDS)}")
    return backend, server


def spot_options(args: argparse.Namespace) -> SpotOptions | None:
    """The checked spot options, None without --spot (ConfigError for one given without it)."""
    given = {k: getattr(args, k) for k in ("spot_interruptions_per_hour", "checkpoint_every", "recovery_s",
                                           "spot_saving") if getattr(args, k) is not None}
    if not args.spot:
        if given:
            raise ConfigError(f"plan: --{next(iter(given)).replace('_', '-')} needs --spot")
        return None
    names = {"spot_interruptions_per_hour": "interruptions_per_hour", "spot_saving": "saving"}
    return SpotOptions(**{names.get(k, k): v for k, v in given.items()})


def run_from_args(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    for name in ("parts", "intervals", "functions", "hidden", "layers", "lambda_memory_mb"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"plan: --{name.replace('_', '-')} must be >= 1, got {value}")
    spot = spot_options(args)  # checked before the calibration, which takes a minute
    if args.calibration is not None:
        calibration = Calibration.load(args.calibration)
    else:
        calibration = measure(progress=lambda message: print(message, file=sys.stderr, flush=True),
                              emulator=not args.no_emulator)
    if args.save_calibration is not None:
        calibration.save(args.save_calibration)
    print(f"calibration: {calibration.host}, {calibration.cores} cores, measured {calibration.measured_at}"
          + (f", GPU {calibration.gpu_name}" if calibration.gpu_name else "")
          + (f" ({args.calibration})" if args.calibration else ""), file=out)
    if args.dataset or args.partitions or args.run:
        predictions = _local(args, calibration, out)
    else:
        predictions = _scale(args, calibration, out)
    estimates = None if spot is None else _spot(predictions, spot, out)
    if args.json is not None:
        from dorylus import atomic

        atomic.write_text(args.json, to_json(predictions, calibration, estimates))
    return 0


def _local(args: argparse.Namespace, calibration: Calibration, out) -> list[Prediction]:
    measured = None
    if args.run:
        options, shape = run_options(args.run)
        backends = [options.backend]
        source = f"run {args.run}"
    else:
        shape = local_shape(args.dataset, args.partitions, args.parts, args.cut_fraction)
        options = LocalOptions(intervals=args.intervals, functions=args.functions, cut_fraction=args.cut_fraction,
                               static_cached=args.static_cached)
        backends = args.backend or local_default_backends()
        source = args.dataset or args.partitions
    overrides = {k: v for k, v in (("hidden", args.hidden), ("layers", args.layers if not args.run else None),
                                   ("lambda_memory_mb", args.lambda_memory_mb), ("mode", args.mode),
                                   ("evaluate", args.evaluate), ("model", args.model), ("heads", args.heads),
                                   ("out_heads", args.out_heads)) if v is not None}
    from dataclasses import replace

    options = replace(options, static_cached=args.static_cached, **overrides)
    if args.run:
        measured = measured_epoch_s(args.run, evaluated=options.evaluate)
    print(f"predicted epoch on this machine for {source}: {shape.vertices:,} vertices, {shape.parts} parts (largest: "
          f"{shape.owned:,} rows, {shape.nnz:,} A_hat entries, {shape.ghosts:,} ghost rows), {shape.features} "
          f"features, {shape.classes} classes; {options.model.upper()} hidden {options.hidden}, "
          f"{options.intervals} intervals, mode {options.mode}, evaluation pass {'on' if options.evaluate else 'off'}", file=out)
    predictions = [plan_local(calibration, shape, replace(options, backend=b)) for b in backends]
    header = ["backend", "parts", "intervals", "s/epoch", "$/epoch", "value", "calls/epoch"]
    rows = [[p.setup.backend, str(p.setup.parts), str(p.setup.intervals), f"{p.epoch_s:.4f}", f"{p.cost_usd:.3e}",
             f"{p.value:.4g}", str(p.calls)] for p in predictions]
    if measured is not None:
        header += ["measured s/epoch", "predicted/measured"]
        rows[0] += [f"{measured[0]:.4f} (median of {measured[1]})", f"{predictions[0].epoch_s / measured[0]:.2f}"]
    print(format_table(header, rows), file=out)
    for p in predictions:
        print(f"  {p.setup.backend}: " + ", ".join(f"{k.removesuffix('_s')} {v:.4f}" for k, v in p.task_s.items())
              + " s", file=out)
    return predictions


def _scale(args: argparse.Namespace, calibration: Calibration, out) -> list[Prediction]:
    defaults = ScaleOptions()
    options = ScaleOptions(hidden=args.hidden or defaults.hidden, layers=args.layers, cut_fraction=args.cut_fraction,
                           lambda_memory_mb=args.lambda_memory_mb,
                           servers=tuple(args.server),
                           param_server=args.param_server, mode=args.mode or defaults.mode,
                           evaluate=defaults.evaluate if args.evaluate is None else args.evaluate,
                           static_cached=args.static_cached)
    predictions = plan_scale(calibration, options, args.workload)
    from dorylus.cost import DEFAULT_PRICES as prices

    print(f"predicted training epoch at scale: {Setup.model.upper()} hidden {options.hidden}, {options.layers} "
          f"layers, mode {options.mode}, evaluation pass {'on' if options.evaluate else 'off'}, edge-cut fraction "
          f"{options.cut_fraction}, cached static inputs {options.static_cached:g}; {prices.region} on-demand "
          f"prices as of {prices.as_of}", file=out)
    header = ["workload", "backend", "graph servers", "intervals", "GiB/server", "B/entry", "s/epoch", "$/epoch",
              "value", f"value vs {BASELINE}", "rates"]
    rows = []
    for p in predictions:
        s = p.setup
        base = next(q for q in predictions if q.shape.vertices == p.shape.vertices and q.setup.backend == BASELINE)
        servers = f"{s.parts} x {s.graph_server}" if s.graph_servers_per_instance == 1 else \
            f"{s.parts} GPUs on {s.instances} x {s.graph_server}"
        calls = f"{s.intervals} x {s.lambda_memory_mb} MB" if s.runs.calls_functions else str(s.intervals)
        workload = next(w for w in WORKLOADS.values() if w.vertices == p.shape.vertices)
        per_entry, _ = graph_bytes(p.shape, s)
        rows.append([workload.name, s.backend, servers, calls, f"{p.memory_gib:.1f}", f"{per_entry:g}", f"{p.epoch_s:.3f}",
                     f"{p.cost_usd:.3e}", f"{p.value:.4g}", f"{p.value / base.value:.2f}x", p.where])
    print(format_table(header, rows), file=out)
    print("value = 1 / (s/epoch x $/epoch); graph servers: the fewest that hold the partitions in 80% of their memory "
          "(a GPU's for gpu: B/entry is what the graph structures cost per A_hat entry there, the rest being per "
          "vertex, features and row buffers: docs/planning.md); sources of sizes, instances and rates: "
          "dorylus/plan/catalog.py", file=out)
    return predictions


def _spot(predictions: list[Prediction], options: SpotOptions, out) -> list:
    estimates = [spot_estimate(p, options) for p in predictions]
    print(f"on spot graph servers (parameter server on-demand): {options.interruptions_per_hour:g} interruptions per "
          f"instance-hour, a checkpoint every {options.checkpoint_every} epochs, {options.recovery_s:g} s to recover; "
          f"each interruption loses half a checkpoint interval plus the recovery", file=out)
    header = ["workload", "backend", "graph servers", "saving", "interruptions/epoch", "lost s/interruption",
              "s/epoch", "$/epoch", "value", "vs on-demand"]
    rows = []
    for p, e in zip(predictions, estimates):
        workload = next((w.name for w in WORKLOADS.values() if w.vertices == p.shape.vertices), "local")
        rows.append([workload, p.setup.backend, f"{p.setup.instances} x {p.setup.graph_server}", f"{e.saving:.0%}",
                     f"{e.interruptions_per_epoch:.3g}", f"{e.lost_s_per_interruption:.1f}", f"{e.epoch_s:.4g}",
                     f"{e.cost_usd:.3e}", f"{e.value:.4g}", f"{e.value / e.on_demand_value:.2f}x"])
    print(format_table(header, rows), file=out)
    for source in dict.fromkeys(e.saving_source for e in estimates):
        print(f"  saving: {source}", file=out)
    for note in dict.fromkeys(n for e in estimates for n in e.notes):
        print(f"  note: {note}", file=out)
    return estimates


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
