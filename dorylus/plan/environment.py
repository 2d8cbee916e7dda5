"""Where the roles of a predicted run execute: this machine (local mode) or AWS.

Rates come from a :class:`~dorylus.plan.calibration.Calibration` (one CPU thread) and are scaled
to the cores a role gets, assuming ``c`` cores of the same speed run ``1 + (c - 1) *
PARALLEL_EFFICIENCY`` times as fast as one (sparse and dense kernels stop scaling linearly as
they saturate memory bandwidth; an assumption, not a measurement):

* local: every role is a process on this machine's ``cores``. A graph server gets ``cores //
  parts`` threads (as :class:`dorylus.coordinator.local.LocalCluster` gives it), or a ``cores /
  parts`` share when there are more servers than cores; the emulator's functions share the
  cores with each other (``parts * functions`` calls at once); the graph servers gather at once
  through one last-level cache, so each Gather is priced at the operands of all of them
  (``cache_sharers``); links are the ZeroMQ loopback
  and the invoke latency is the emulator's; work and transfers take ``contention`` times as long
  as their kernels alone, and the runtime costs ``stage_s`` per stage and ``call_s`` per call,
  all as calibrated (:mod:`dorylus.plan.runtime`).
* AWS: a CPU graph server gets its instance's cores (vCPUs / 2), a GPU one its GPU; a Lambda
  call ``memory_mb / 1769`` vCPUs (:data:`dorylus.plan.catalog.LAMBDA`); graph servers talk over
  their instances' baseline network bandwidth (several GPUs of one instance share its NIC), a
  function over its own Lambda bandwidth; a round trip is the calibrated loopback one plus
  :data:`NETWORK_LATENCY_S`; a stage costs the runtime what it costs here, and a call's invoke
  latency is Lambda's (which replaces the emulator's HTTP server and worker pipes).

GPU rates: the calibration's own when it has a GPU, else :func:`anchor_gpu_rates`; scaled to
another GPU by memory bandwidth (Gather, element-wise: memory-bound) and float32 throughput
(matmul).
"""

from __future__ import annotations

from dataclasses import replace

from dorylus.errors import ConfigError
from dorylus.plan.calibration import Calibration, Rates
from dorylus.plan.catalog import GPUS, LAMBDA, Gpu, gpu_of, instance
from dorylus.plan.model import Environment, Setup

PARALLEL_EFFICIENCY = 0.8
NETWORK_LATENCY_S = 100e-6  # one round trip between instances in one availability zone, about 0.1 ms

# The anchor measured in issue 9 on one NVIDIA H100 (torch 2.11): one SpMM of synthetic-reddit's
# A_hat (114,848,857 entries) at width 128 took 13.4 ms. Matmul at half the H100's float32 peak
# (67 TFLOPS = 33.5e12 multiply-adds/s); element-wise work at 70% of its 3,350 GB/s moving 8
# bytes per element (read and write float32), dropout at half that (the mask's bits as well),
# softmax cross-entropy with its gradient at a quarter (four passes over the logits), and GAT's
# edge work as element-wise passes over the edges (ATTENTION_PASSES).
ANCHOR_GPU = "H100"
REDDIT_NNZ = 114_848_857
# Forward: the scores' sum, leaky ReLU, the row maximum, exp, the row sum and the division, and
# one more for the index gathers; backward, that again (recomputed) and the softmax's and the
# scores' gradients.
ATTENTION_PASSES = (7, 7 + 8)


def anchor_gpu_rates() -> Rates:
    """Rates of an H100 without a GPU calibration (see :data:`ANCHOR_GPU`'s comment)."""
    gpu = GPUS[ANCHOR_GPU]
    elementwise = 0.7 * gpu.memory_gb_per_s * 1e9 / 8
    operand = 4 * 128 * 232_965  # bytes of synthetic-reddit's rows at width 128
    return Rates(gather=((operand, REDDIT_NNZ * 128 / 13.4e-3),), matmul_per_s=0.5 * gpu.fp32_tflops * 1e12 / 2,
                 dropout_per_s=elementwise / 2, elementwise_per_s=elementwise, softmax_per_s=elementwise / 4,
                 attention_per_s=tuple(elementwise / passes for passes in ATTENTION_PASSES))


def gpu_rates(gpu: Gpu, calibration: Calibration) -> tuple[Rates, str]:
    """``gpu``'s rates, scaled from the calibration's GPU (or the anchor), and where they came from."""
    if calibration.gpu is not None:
        base_gpu = gpu_of(calibration.gpu_name)
        if base_gpu is None:
            raise ConfigError(f"plan: the calibration's GPU {calibration.gpu_name!r} is not in the GPU table "
                              f"({', '.join(GPUS)}), so its rates cannot be scaled to a {gpu.name}")
        base, source = calibration.gpu, f"calibrated on {calibration.gpu_name}"
    else:
        base_gpu, base, source = GPUS[ANCHOR_GPU], anchor_gpu_rates(), "H100 anchor of issue 9"
    memory = gpu.memory_gb_per_s / base_gpu.memory_gb_per_s
    flops = gpu.fp32_tflops / base_gpu.fp32_tflops
    if gpu.name != base_gpu.name:
        source += f", scaled to {gpu.name}"
    return base.scaled(1.0, gather=memory, matmul=flops), source


def cores_factor(cores: float) -> float:
    """How many one-thread rates ``cores`` cores give: ``cores`` below one (a share), else
    ``1 + (cores - 1) * PARALLEL_EFFICIENCY``."""
    return cores if cores <= 1 else 1 + (cores - 1) * PARALLEL_EFFICIENCY


def local(calibration: Calibration, setup: Setup) -> Environment:
    """This machine, every role on its ``calibration.cores``; work and transfers take
    ``calibration.contention`` times as long as their kernels alone."""
    cores, parts, slow = calibration.cores, setup.parts, calibration.contention
    threads = cores / parts if cores < parts else cores // parts
    if setup.runs.device == "gpu":
        if calibration.gpu is None:
            raise ConfigError(f"plan: the {setup.backend} backend on this machine needs a calibration with a GPU "
                              "(none here: pass --calibration FILE taken on a GPU machine)")
        server = calibration.gpu.scaled(1 / slow)
    else:
        server = calibration.cpu.scaled(cores_factor(threads) / slow)
    link = calibration.loopback_bytes_per_s / slow
    env = Environment(server=server, ghost_link=link, server_link=link, round_trip_s=calibration.round_trip_s * slow,
                      stage_s=calibration.stage_s, cache_sharers=parts,
                      where=f"this machine ({calibration.host}, {cores} cores)")
    if not setup.runs.calls_functions:
        return env
    if calibration.invoke_s is None:
        raise ConfigError(f"plan: the calibration has no invoke latency (taken with --no-emulator), so the local "
                          f"{setup.backend} backend cannot be predicted")
    at_once = parts * min(setup.functions, setup.intervals)
    return replace(env, function=calibration.cpu.scaled(min(1.0, cores / at_once) / slow), call_link=link,
                   invoke_s=calibration.invoke_s * slow, call_s=calibration.call_s or 0.0)


def aws(calibration: Calibration, setup: Setup) -> Environment:
    """``setup`` deployed on AWS (see the module docstring)."""
    on_gpu = setup.runs.device == "gpu"
    machine = instance(setup.graph_server, gpu=on_gpu)
    if on_gpu:
        server, source = gpu_rates(GPUS[machine.gpu], calibration)
    else:
        server, source = calibration.cpu.scaled(cores_factor(machine.cores)), f"{calibration.host} per core"
    round_trip = calibration.round_trip_s + NETWORK_LATENCY_S
    link = machine.network_bytes_per_s
    env = Environment(server=server, ghost_link=link / setup.graph_servers_per_instance, server_link=link,
                      round_trip_s=round_trip, stage_s=calibration.stage_s, where=f"AWS ({source})")
    if not setup.runs.calls_functions:
        return env
    return replace(env, function=calibration.cpu.scaled(cores_factor(LAMBDA.vcpus(setup.lambda_memory_mb))),
                   call_link=LAMBDA.bytes_per_s, invoke_s=LAMBDA.start_s)
