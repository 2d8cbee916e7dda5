"""What a local cluster costs beyond its kernels and links, calibrated by training for real.

Rates of kernels and links do not see the runtime: the graph server's event loop and threads,
barriers, the parameter server's replies, the coordinator's polls, the emulator's HTTP server and
worker pipes, the function's decoding, nor the roles (and whatever else runs here) competing for
this machine's cores. Local runs of ``dorylus train`` at its defaults (2 graph servers, 2
intervals) measure them, on synthetic graphs like the presets users train. With ``T`` the
median epoch after the first, ``W`` the model's epoch from the kernels and links alone
(:func:`dorylus.plan.model.predict` with no runtime cost), ``S`` the stages of an epoch (training
and evaluation passes) and ``F`` its function stages, the cpu backend on a tiny graph (``W``
next to nothing) and on a medium one (``W`` most of ``T``) give two equations in the slowdown of
work under contention, ``contention``, and the cost per stage, ``stage_s``::

    T = contention * W + S * stage_s

and the lambda backend on the medium graph the cost of a function call beyond them::

    call_s = (T - contention * W - S * stage_s) / F

``contention`` is at least 1 and ``stage_s``, ``call_s`` at least 0. ``contention`` and
``call_s`` hold for local predictions only (on AWS each graph server has its own machine and a
call's invoke latency is Lambda's); ``stage_s`` applies everywhere. They measure this machine as
it is while calibrating, other work included: predictions are for runs under the same load.
The model counts input features as dense; these graphs' features are about 7.5% non-zero, so
runs keep them sparse (``--sparse-features auto``) and ``contention`` absorbs the difference for
graphs of like density, not for dense ones.

:func:`measure` takes a whole calibration: the rates of :mod:`dorylus.plan.calibration`, then
these costs on top of them.
"""

from __future__ import annotations

import dataclasses
import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from dorylus.plan.calibration import (Calibration, cpu_model, gpu_rates, invoke_overhead, measure_cpu,
                                      zmq_loopback)

EPOCHS = 8
MAX_CONTENTION = 20.0


def tiny_dataset():
    from dorylus.data.synthetic import SyntheticSpec, generate

    return generate(SyntheticSpec(num_nodes=2_000, num_edges=20_000, num_features=16, num_classes=4,
                                  train_fraction=0.2, name="plan-tiny"), seed=0)


def medium_dataset():
    """A graph whose epoch is mostly work (``W`` 82 ms of ``T`` 110-135 ms here), so that the
    fit's ``contention`` moves less with the milliseconds by which epochs vary on a loaded
    machine: four back-to-back fits gave 1.00-1.11 on it, 1.00-1.44 on ``synthetic-small`` (``W``
    35 of 65-80 ms). Its own size, so that neither preset the planner is checked against
    (synthetic-1m, synthetic-reddit) is the one its runtime costs were fitted on; otherwise
    synthetic-1m's recipe."""
    from dorylus.data.synthetic import PRESETS, generate

    spec = dataclasses.replace(PRESETS["synthetic-1m"], num_nodes=48_000, num_edges=800_000, name="plan-medium")
    return generate(spec, seed=0)


def measured_run(backend: str, dataset, run_dir: Path, epochs: int = EPOCHS) -> float:
    """Train ``dataset`` for ``epochs`` epochs with ``backend`` at the train defaults (2 graph
    servers, 2 intervals); the median epoch after the first."""
    from dorylus.config import TrainConfig
    from dorylus.runs import read_metrics
    from dorylus.coordinator.training import run_training

    config = TrainConfig(dataset=dataset.name, backend=backend, parts=2, intervals=2, epochs=epochs,
                         checkpoint_every=epochs, run_dir=str(run_dir))
    run_training(config, dataset, progress=io.StringIO())
    return statistics.median(m["epoch_s"] for m in read_metrics(run_dir)[1:])


def modelled(run_dir: Path, backend: str, calibration: Calibration) -> tuple[float, int, int]:
    """The model's epoch for the run in ``run_dir`` under ``calibration``, its stages and its
    function stages."""
    from dorylus.partition import open_store
    from dorylus.plan import environment
    from dorylus.plan.model import Setup, model_plan, predict, store_shape

    shape = store_shape(open_store(run_dir / "partitions", verify=False))
    setup = Setup(backend=backend, graph_server="c5.2xlarge", parts=shape.parts, intervals=2, functions=2,
                  hidden=16, lambda_memory_mb=1024)
    _, plan = model_plan(shape, setup)
    stages = (*plan.train, *plan.evaluate)
    work = predict(shape, setup, environment.local(calibration, setup)).epoch_s
    return work, len(stages), sum(s.kind == "function" for s in stages)


def overheads(calibration: Calibration, progress: Callable[[str], None] = lambda message: None,
              lambda_backend: bool = True) -> Calibration:
    """``calibration`` with ``contention``, ``stage_s`` and (``lambda_backend``) ``call_s`` measured."""
    base = dataclasses.replace(calibration, contention=1.0, stage_s=0.0, call_s=0.0)
    tiny, medium = tiny_dataset(), medium_dataset()
    runs = [("tiny", tiny, "cpu"), ("medium", medium, "cpu")] + ([("medium", medium, "lambda")] if lambda_backend else [])
    measured, model = {}, {}
    with tempfile.TemporaryDirectory(prefix="dorylus-plan-") as tmp:
        for name, dataset, backend in runs:
            progress(f"  training {dataset.name} ({dataset.num_nodes:,} vertices, {EPOCHS} epochs) with the "
                     f"{backend} backend ...")
            run_dir = Path(tmp) / f"{name}-{backend}"
            measured[name, backend] = measured_run(backend, dataset, run_dir)
            model[name, backend] = modelled(run_dir, backend, base)
    (w1, s1, _), (w2, s2, _) = model["tiny", "cpu"], model["medium", "cpu"]
    t1, t2 = measured["tiny", "cpu"], measured["medium", "cpu"]
    determinant = w2 * s1 - w1 * s2
    contention = (t2 * s1 - t1 * s2) / determinant if determinant > 0 else 1.0
    contention = min(max(contention, 1.0), MAX_CONTENTION)
    stage_s = max(0.0, min((t1 - contention * w1) / s1, (t2 - contention * w2) / s2))
    call_s = None
    if lambda_backend:
        w, s, f = model["medium", "lambda"]
        call_s = max(0.0, (measured["medium", "lambda"] - contention * w - s * stage_s) / f)
    progress(f"  work takes {contention:.2f}x its kernels' time, {stage_s * 1e3:.2f} ms per stage"
             + (f", {call_s * 1e3:.2f} ms more per function call" if call_s is not None else ""))
    return dataclasses.replace(calibration, contention=contention, stage_s=stage_s, call_s=call_s)


def measure(progress: Callable[[str], None] = lambda message: None, emulator: bool = True,
            runtime: bool = True) -> Calibration:
    """Calibrate this machine (about 30 s): CPU rates, loopback, invoke overhead (unless
    ``emulator`` is False), the GPU's rates when CUDA is present, and (``runtime``) the
    runtime's cost per stage and call from training a tiny graph."""
    progress("calibrating CPU rates (one thread: Gather, matmul, dropout, GAT's edge work) ...")
    cpu = measure_cpu()
    curve = ", ".join(f"{rate:.3g} at {size / 2 ** 20:.0f} MB" for size, rate in cpu.gather)
    progress(f"  gather {curve} (entries x width/s), matmul {cpu.matmul_per_s:.3g} MAC/s, "
             f"dropout {cpu.dropout_per_s:.3g} elements/s, without {cpu.elementwise_per_s:.3g}, "
             f"softmax {cpu.softmax_per_s:.3g} logits/s, attention {cpu.attention_per_s[0]:.3g} and "
             f"{cpu.attention_per_s[1]:.3g} edges x heads/s forward and backward")
    progress("calibrating ZeroMQ loopback ...")
    bandwidth, round_trip = zmq_loopback()
    progress(f"  {bandwidth / 1e9:.2f} GB/s, round trip {round_trip * 1e6:.0f} us")
    invoke = None
    if emulator:
        progress("calibrating the Lambda emulator's invoke round trip ...")
        invoke = invoke_overhead()
        progress(f"  {invoke * 1e3:.2f} ms per call")
    gpu = gpu_rates()
    if gpu is not None:
        progress(f"calibrated GPU {gpu[1]}: gather {gpu[0].gather_per_s(2 ** 28):.3g}/s at 256 MB, "
                 f"matmul {gpu[0].matmul_per_s:.3g}/s")
    calibration = Calibration(host=cpu_model(), cores=len(os.sched_getaffinity(0)),
                              measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpu=cpu,
                              loopback_bytes_per_s=bandwidth, round_trip_s=round_trip, invoke_s=invoke,
                              gpu=gpu[0] if gpu else None, gpu_name=gpu[1] if gpu else None)
    if runtime:
        progress("calibrating the runtime's cost per stage and call ...")
        calibration = overheads(calibration, progress, lambda_backend=emulator)
    return calibration
