"""Throughput of the machine ``dorylus plan`` runs on, per task kind, measured in seconds.

A :class:`Calibration` holds rates of ONE CPU thread (the planner scales them to the cores a
role gets), the cost of moving bytes between roles, and optionally a GPU's rates:

==========================  ====================================================================
rate                        measured as
==========================  ====================================================================
``gather``                  ``nnz * width / seconds`` of ``A · X`` with the graph servers' Gather
                            (:meth:`dorylus.models.graph.CsrGraph.aggregate`: the numba kernel at
                            this size) on a format-3 structure (int32 column ids, per-vertex
                            norms, no per-entry value), random columns, against the bytes of the
                            dense operand ``X`` (1 MB to 256 MB: from inside the caches to far
                            outside; :meth:`Rates.gather_per_s` interpolates)
``matmul_per_s``            multiply-adds per second of numpy float32 ``H @ W`` at GCN's shapes
                            (wide-to-narrow, narrow-to-narrow), as the model's ``compute`` does
``dropout_per_s``           elements per second of the model's own ``PREP`` stage while training
                            (activation + keyed dropout mask + scaling)
``elementwise_per_s``       the same without dropout (evaluation: activation only)
``softmax_per_s``           logits per second of the model's own ``LOSS`` stage while training
                            (softmax cross-entropy, accuracy counts and the gradient)
``attention_per_s``         edges x heads per second of GAT's edge work (scores per edge, the
                            edge softmax; backward, their gradients): GAT's own Gather and
                            backward Gather on a random graph, less their sparse products at
                            the ``gather`` rate (:func:`attention_rates`); forward and backward
``loopback_bytes_per_s``    one ZeroMQ connection over 127.0.0.1, 4 MB messages, one way
``round_trip_s``            a small ZeroMQ request and reply over 127.0.0.1
``invoke_s``                a Lambda Invoke API call of an empty function through the local
                            emulator, from aiobotocore as the graph servers call (round trip)
``contention``,            how much longer work takes in a local cluster than its kernels
``stage_s``, ``call_s``     alone, and the runtime's own cost per stage and per function call,
                            from training small graphs for real (:mod:`dorylus.plan.runtime`)
==========================  ====================================================================

The CPU rates are measured in a child process started with one thread for torch, OpenBLAS and
OpenMP, so they are per-thread figures whatever the machine. GPU rates are measured when CUDA
is present (torch CSR SpMM, ``torch.mm`` with TF32 off, element-wise ops); without one, the
planner falls back on :func:`dorylus.plan.environment.anchor_gpu_rates`. A calibration is saved and loaded as JSON
(``--save-calibration``, ``--calibration``) so that one taken on a GPU machine prices GPUs
elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dorylus.errors import ConfigError, DorylusError

FORMAT = 2  # 2: Rates gained attention_per_s


class CalibrationError(DorylusError):
    """A measurement could not be taken (not bad input): exit status 1."""

    exit_status = 1


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def curve_rate(curve: tuple[tuple[float, float], ...], operand_bytes: float) -> float:
    """The rate of a ``(operand_bytes, rate)`` curve at ``operand_bytes``: piecewise linear in
    ``log(bytes)`` between its points, the nearest end's rate outside them."""
    if operand_bytes <= curve[0][0]:
        return curve[0][1]
    for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
        if operand_bytes <= s1:
            t = (math.log(operand_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return r0 + t * (r1 - r0)
    return curve[-1][1]


@dataclass(frozen=True)
class Rates:
    """Throughput of one compute device: see the module docstring for how each is measured.

    ``gather`` is a curve of ``(operand_bytes, entries x width per second)`` points, ascending
    in bytes: sparse products slow down as the dense operand leaves the caches."""

    gather: tuple[tuple[float, float], ...]
    matmul_per_s: float       # multiply-adds per second
    dropout_per_s: float      # elements per second, input preparation with dropout
    elementwise_per_s: float  # elements per second, without dropout
    softmax_per_s: float      # logits per second, softmax cross-entropy and its gradient
    attention_per_s: tuple[float, float]  # edges x heads per second, GAT's edge work forward and backward

    def __post_init__(self) -> None:
        try:
            points = tuple((float(size), float(rate)) for size, rate in self.gather)
        except (TypeError, ValueError):
            raise ValueError(f"gather must be a list of [operand_bytes, rate] pairs, got {self.gather!r}") from None
        if not points or not all(_positive(v) for point in points for v in point) \
                or any(a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise ValueError(f"gather must be [operand_bytes, rate] pairs of positive numbers, ascending in bytes, "
                             f"got {self.gather!r}")
        object.__setattr__(self, "gather", points)
        try:
            forward, backward = (float(rate) for rate in self.attention_per_s)
        except (TypeError, ValueError):
            forward = backward = -1.0
        if not (_positive(forward) and _positive(backward)):
            raise ValueError(f"attention_per_s must be [forward, backward] positive numbers, "
                             f"got {self.attention_per_s!r}")
        object.__setattr__(self, "attention_per_s", (forward, backward))
        for name in ("matmul_per_s", "dropout_per_s", "elementwise_per_s", "softmax_per_s"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")

    def gather_per_s(self, operand_bytes: float) -> float:
        """The Gather rate at a dense operand of ``operand_bytes`` (:func:`curve_rate`)."""
        return curve_rate(self.gather, operand_bytes)

    def scaled(self, factor: float, gather: float | None = None, matmul: float | None = None) -> "Rates":
        """Every rate times ``factor`` (or Gather's and element-wise ones times ``gather``, and
        matmul times ``matmul``, when given)."""
        g = factor if gather is None else gather
        m = factor if matmul is None else matmul
        return Rates(gather=tuple((size, rate * g) for size, rate in self.gather), matmul_per_s=self.matmul_per_s * m,
                     dropout_per_s=self.dropout_per_s * g, elementwise_per_s=self.elementwise_per_s * g,
                     softmax_per_s=self.softmax_per_s * g,
                     attention_per_s=tuple(rate * g for rate in self.attention_per_s))


@dataclass(frozen=True)
class Calibration:
    host: str                      # CPU model, as /proc/cpuinfo or platform names it
    cores: int                     # CPUs this process may use (the local cluster's roles share them)
    measured_at: str               # ISO date and time
    cpu: Rates                     # ONE thread
    loopback_bytes_per_s: float
    round_trip_s: float
    invoke_s: float | None = None  # None: not measured (the local lambda backend cannot be predicted)
    stage_s: float = 0.0           # the runtime's cost per stage beyond its work
    contention: float = 1.0        # local clusters: work takes this many times as long as its kernels
    call_s: float | None = None    # ... and per call of the local emulator's functions (None: not measured)
    gpu: Rates | None = None
    gpu_name: str | None = None    # the device's name as CUDA reports it

    def __post_init__(self) -> None:
        if not (isinstance(self.cores, int) and self.cores >= 1):
            raise ValueError(f"cores must be an integer >= 1, got {self.cores!r}")
        for name in ("loopback_bytes_per_s", "round_trip_s", "invoke_s"):
            value = getattr(self, name)
            if value is None and name == "invoke_s":
                continue
            if not _positive(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (_positive(self.contention) and self.contention >= 1):
            raise ValueError(f"contention must be a number >= 1, got {self.contention!r}")
        for name in ("stage_s", "call_s"):
            value = getattr(self, name)
            if value is None and name == "call_s":
                continue
            if not (value == 0 or _positive(value)):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if (self.gpu is None) != (self.gpu_name is None):
            raise ValueError("gpu and gpu_name go together")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, values: Any, where: str) -> "Calibration":
        """Parse and check a saved calibration; ConfigError naming ``where`` and the problem."""
        try:
            if not isinstance(values, dict):
                raise ValueError("expected a JSON object")
            values = dict(values)
            if values.pop("format", None) != FORMAT:
                raise ValueError(f"format must be {FORMAT}")
            for key in ("cpu", "gpu"):
                rates = values.get(key)
                if rates is not None:
                    if not isinstance(rates, dict):
                        raise ValueError(f"{key} must be an object of rates")
                    try:
                        values[key] = Rates(**rates)
                    except TypeError as exc:
                        raise ValueError(f"{key}: {exc}") from None
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: not a valid calibration: {exc}") from None

    def save(self, path: str | Path) -> None:
        from dorylus import atomic

        path = Path(path)
        if path.parent and not path.parent.is_dir():
            raise ConfigError(f"cannot save the calibration to {path}: {path.parent} is not a directory")
        atomic.write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"calibration file {path} does not exist")
        try:
            values = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"calibration file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(values, where=f"calibration file {path}")


# --------------------------------------------------------------------------- measurement


def _median_s(run: Callable[[], object], repeats: int = 5) -> float:
    """Median of ``repeats`` timed runs after one warm-up: the machine as it is, other work
    included (a run on it will share the machine alike)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


GATHER_OPERAND_MB = (1, 4, 16, 64, 256)  # dense operand sizes of the Gather curve
GATHER_WIDTH = 32


def gather_curve(device: str = "cpu", rows: int = 40_000, nnz: int = 1_000_000,
                 operand_mb: tuple[float, ...] = GATHER_OPERAND_MB, seed: int = 0) -> tuple[tuple[float, float], ...]:
    """``(operand_bytes, nnz * width / seconds)`` of CSR SpMM with random columns at width
    :data:`GATHER_WIDTH`, the dense operand ``operand_mb`` MB each, on the graph servers' kernel
    (``device`` "cpu") or torch's CSR kernel on ``device``, over what a graph server holds: int32
    column ids (a format-3 store's, :mod:`dorylus.partition.store`) and per-vertex scales on the
    host, a float32 value per entry on a device (:meth:`dorylus.models.graph.CsrGraph.matrix`)."""
    import torch

    from dorylus.models.graph import CsrGraph, csr_tensor

    rng = np.random.default_rng(seed)
    indptr = np.linspace(0, nnz, rows + 1).astype(np.int64)
    values = rng.random(nnz, dtype=np.float32)
    curve = []
    for mb in operand_mb:
        cols = max(1, int(mb * 2 ** 20 / (4 * GATHER_WIDTH)))
        indices = rng.integers(0, cols, nnz, dtype=np.int32)
        x = rng.random((cols, GATHER_WIDTH), dtype=np.float32)
        if device == "cpu":
            graph = CsrGraph(indptr, indices, np.ones(rows, np.float32), np.ones(cols, np.float32), cols,
                             np.arange(rows), np.arange(cols))
            seconds = _median_s(lambda: graph.aggregate("gcn", x))
        else:
            matrix = csr_tensor(indptr, indices, values, (rows, cols)).to(device)
            dense = torch.from_numpy(x).to(device)
            seconds = _median_s(lambda: (matrix @ dense, torch.cuda.synchronize()))
        curve.append((float(x.nbytes), nnz * GATHER_WIDTH / seconds))
    return tuple(curve)


ATTENTION_HEADS, ATTENTION_WIDTH = 8, 8  # GAT's default hidden layer: 8 heads of 8
MIN_EDGE_SHARE = 0.1  # the edge work's least share of a measured Gather (if the products' estimate is high)


def attention_rates(gather: tuple[tuple[float, float], ...], device: str = "cpu", rows: int = 40_000,
                    nnz: int = 1_000_000, seed: int = 0) -> tuple[float, float]:
    """Edges x heads per second of GAT's edge work, forward and backward: GAT's own Gather and
    backward Gather (:func:`dorylus.models.gat.gather_torch`) on ``device`` over a random graph of
    ``rows`` rows and ``nnz`` in-edges, :data:`ATTENTION_HEADS` heads of :data:`ATTENTION_WIDTH`,
    less their sparse products (one per head forward, two backward) at the ``gather`` curve's
    rate, as :func:`dorylus.plan.model.gather_seconds` prices them."""
    import torch

    from dorylus.models import gat
    from dorylus.models.graph import CsrGraph

    rng = np.random.default_rng(seed)
    indptr = np.linspace(0, nnz, rows + 1).astype(np.int64)
    indices = rng.integers(0, rows, nnz, dtype=np.int32)
    ones = np.ones(rows, np.float32)
    graph = CsrGraph(indptr, indices, ones, ones, rows, np.arange(rows), np.arange(rows), device=device)
    width = ATTENTION_HEADS * ATTENTION_WIDTH
    projected, grad_out = (torch.from_numpy(rng.standard_normal((rows, width), dtype=np.float32)).to(device)
                           for _ in range(2))
    scores = torch.from_numpy(rng.standard_normal((rows, 2 * ATTENTION_HEADS), dtype=np.float32)).to(device)
    args = {"heads": ATTENTION_HEADS, "concat": True, "attention_dropout": 0.0, "training": True, "seed": 0,
            "epoch": 1}

    def synchronized(run: Callable[[], object]) -> Callable[[], object]:
        return run if device == "cpu" else lambda: (run(), torch.cuda.synchronize())

    forward = _median_s(synchronized(lambda: gat.gather_torch("GA", 1, graph, (0, rows), [projected, scores], args)),
                        repeats=3)
    backward = _median_s(synchronized(lambda: gat.gather_backward_torch("GA_BWD", 1, graph,
                                                                        [grad_out, projected, scores], args)),
                         repeats=3)
    one_product = nnz * ATTENTION_WIDTH / curve_rate(gather, 4 * ATTENTION_WIDTH * rows)  # float32 rows
    edges = nnz * ATTENTION_HEADS
    return tuple(edges / max(seconds - products * ATTENTION_HEADS * one_product, MIN_EDGE_SHARE * seconds)
                 for seconds, products in ((forward, 1), (backward, 2)))


MATMUL_SHAPES = ((32_000, 128, 16), (20_000, 602, 128), (32_000, 16, 16))  # rows, in, out


def matmul_rate(device: str = "cpu", seed: int = 0) -> float:
    """Multiply-adds per second of float32 ``[rows, in] @ [in, out]`` over :data:`MATMUL_SHAPES`
    (numpy on the CPU, as the model computes; ``torch.mm`` with TF32 off on a GPU)."""
    rng = np.random.default_rng(seed)
    macs = seconds = 0.0
    for rows, fan_in, fan_out in MATMUL_SHAPES:
        h = rng.random((rows, fan_in), dtype=np.float32)
        w = rng.random((fan_in, fan_out), dtype=np.float32)
        if device == "cpu":
            seconds += _median_s(lambda: h @ w)
        else:
            import torch

            torch.backends.cuda.matmul.fp32_precision = "ieee"  # the new API only: see gpu_device.set_tf32
            th, tw = torch.from_numpy(h).to(device), torch.from_numpy(w).to(device)
            seconds += _median_s(lambda: (th @ tw, torch.cuda.synchronize()))
        macs += rows * fan_in * fan_out
    return macs / seconds


def _stage(task: str, features: int, hidden: int, classes: int):
    """The GCN model module and its first training stage ``task`` above layer 0."""
    from dorylus.config import TrainConfig
    from dorylus.models import get_model
    from dorylus.models.spec import ModelSpec

    spec = ModelSpec.from_config(TrainConfig(model="gcn", layers=2, hidden=hidden, dropout=0.5), features, classes)
    model = get_model("gcn")
    return model, next(s for s in model.build_plan(spec).train if s.task == task and s.layer > 0)


def prepare_rates(rows: int = 32_000, width: int = 128, seed: int = 0) -> tuple[float, float]:
    """Elements per second of the GCN plan's own ``PREP`` stage (activation, keyed dropout),
    while training and while evaluating, through the model's ``compute``."""
    # A layer no wider at its input than at its output gathers first, so its plan has PREP.
    model, stage = _stage("PREP", 8, width, 2 * width)
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((rows, width), dtype=np.float32)
    ids = np.arange(rows, dtype=np.int64)
    rates = []
    for training in (True, False):
        args = {**dict(stage.args), "seed": 0, "epoch": 1, "training": training, "train_count": rows}
        rates.append(rows * width / _median_s(lambda: model.compute("PREP", stage.layer, [src, ids], None, args)))
    return rates[0], rates[1]


def softmax_rate(rows: int = 32_000, classes: int = 16, seed: int = 0) -> float:
    """Logits per second of the GCN plan's own ``LOSS`` stage while training."""
    # A last layer narrower at its output than at its input projects first, so its plan has LOSS.
    model, stage = _stage("LOSS", 8, 4 * classes, classes)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, classes), dtype=np.float32)
    labels = rng.integers(0, classes, rows, dtype=np.int64)
    split = np.ones(rows, dtype=np.uint8)
    args = {**dict(stage.args), "seed": 0, "epoch": 1, "training": True, "train_count": rows}
    params = {"weight": np.zeros((4 * classes, classes), np.float32), "bias": np.zeros(classes, np.float32)}  # LOSS adds b
    return rows * classes / _median_s(lambda: model.compute("LOSS", stage.layer, [logits, labels, split], params,
                                                            args))


def gpu_elementwise_rates(device: str, rows: int = 1_000_000, width: int = 128) -> tuple[float, float, float]:
    """Elements per second on ``device`` of ReLU + a dropout mask and scaling, of ReLU alone,
    and of softmax cross-entropy with its gradient."""
    import torch

    x = torch.randn(rows, width, device=device)
    labels = torch.randint(0, width, (rows,), device=device)

    def loss() -> None:
        y = x.detach().requires_grad_()
        torch.nn.functional.cross_entropy(y, labels).backward()
        torch.cuda.synchronize()

    with_dropout = _median_s(lambda: (torch.nn.functional.dropout(torch.relu(x), 0.5), torch.cuda.synchronize()))
    plain = _median_s(lambda: (torch.relu(x), torch.cuda.synchronize()))
    return rows * width / with_dropout, rows * width / plain, rows * width / _median_s(loss)


def cpu_rates() -> Rates:
    """This thread's CPU rates (call in a one-thread process: :func:`measure_cpu`)."""
    dropout, plain = prepare_rates()
    gather = gather_curve("cpu")
    return Rates(gather=gather, matmul_per_s=matmul_rate("cpu"), dropout_per_s=dropout, elementwise_per_s=plain,
                 softmax_per_s=softmax_rate(), attention_per_s=attention_rates(gather))


ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def measure_cpu(timeout_s: float = 300.0) -> Rates:
    """:func:`cpu_rates` in a child process with one thread for torch, OpenBLAS and OpenMP."""
    command = [sys.executable, "-c", "import json, dataclasses, torch; torch.set_num_threads(1); "
               "from dorylus.plan.calibration import cpu_rates; print(json.dumps(dataclasses.asdict(cpu_rates())))"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **ONE_THREAD}, cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"plan: the CPU calibration took more than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise CalibrationError(f"plan: the CPU calibration failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return Rates(**json.loads(done.stdout.strip().splitlines()[-1]))


ROUNDS = 3


def zmq_loopback(message_bytes: int = 4 << 20, messages: int = 10, pings: int = 200) -> tuple[float, float]:
    """``(bytes per second one way, median round trip seconds)`` between two ZeroMQ DEALER
    sockets over 127.0.0.1: the best of :data:`ROUNDS` rounds of ``messages`` payloads of
    ``message_bytes`` each answered by a one-byte frame, then ``pings`` small round trips."""
    import zmq

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (server, client):
            s.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")

        def echo(count: int) -> None:
            for _ in range(count):
                server.recv_multipart(copy=False)
                server.send(b"k")

        payload = np.ones(message_bytes, dtype=np.uint8)
        thread = threading.Thread(target=echo, args=(ROUNDS * messages + 1 + pings,), daemon=True)
        thread.start()
        client.send(b"warm-up")
        client.recv()
        bandwidth = 0.0
        for _ in range(ROUNDS):  # the best round: the least disturbed by other work
            start = time.perf_counter()
            for _ in range(messages):
                client.send(payload, copy=False)
                client.recv()
            bandwidth = max(bandwidth, messages * message_bytes / (time.perf_counter() - start))
        trips = []
        for _ in range(pings):
            start = time.perf_counter()
            client.send(b"p" * 64)
            client.recv()
            trips.append(time.perf_counter() - start)
        thread.join(timeout=10)
        return bandwidth, statistics.median(trips)
    finally:
        server.close(linger=0)
        client.close(linger=0)
        ctx.term()


def noop_handler(event: dict, context: Any = None) -> dict:
    """An empty function: what :func:`invoke_overhead` calls."""
    return {}


def invoke_overhead(calls: int = 30) -> float:
    """Median seconds of a Lambda Invoke API call of :func:`noop_handler` through the local
    emulator, with the graph servers' invoker (aiobotocore)."""
    import asyncio

    from dorylus.emulator import serve
    from graphserver.invoker import LambdaInvoker

    name = "dorylus-plan-noop"

    async def run(url: str) -> list[float]:
        invoker = LambdaInvoker(url, name, concurrency=1, timeout_s=60)
        times = []
        try:
            for i in range(calls + 3):
                event = {"task": "NOOP", "interval": 0, "epoch": i, "layer": 0, "part": 0}
                start = time.perf_counter()
                await invoker.invoke(event)
                if i >= 3:  # the first calls open connections and import the handler
                    times.append(time.perf_counter() - start)
        finally:
            await invoker.close()
        return times

    with serve(functions={name: "dorylus.plan.calibration:noop_handler"}, concurrency=1) as emulator:
        return statistics.median(asyncio.run(run(emulator.url)))


def gpu_rates() -> tuple[Rates, str] | None:
    """The first CUDA device's rates and name, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = "cuda"
    dropout, plain, softmax = gpu_elementwise_rates(device)
    gather = gather_curve(device, rows=400_000, nnz=20_000_000, operand_mb=(16, 256, 2048))
    rates = Rates(gather=gather, matmul_per_s=matmul_rate(device), dropout_per_s=dropout, elementwise_per_s=plain,
                  softmax_per_s=softmax,
                  attention_per_s=attention_rates(gather, device, rows=400_000, nnz=20_000_000))
    return rates, torch.cuda.get_device_name(0)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
