"""Where the ``gpu`` backend (:mod:`graphserver.backends.gpu`) runs: a graph server's partition on
a torch device and every stage run there, graph work and tensor work alike (DESIGN §7). Only a
graph server of the gpu backend imports this module (``GpuBackend.make_state``), so torch loads
there and not in the config, the coordinator, the parameter server or the planner.

What lives on the device (:class:`DeviceState`): the owned rows of the static inputs (``X``
dense ``float32 [n_owned, F]``, ``ids``, ``labels``, ``split``), every row buffer of the plan
(``[n_owned or n_local, width]``), and the in-edge CSR of the partition with its transposes
(:class:`DeviceCsrGraph`: the transpose is sorted on the device from the forward matrices). What
runs there:

* ``GATHER`` / ``GATHER_BACKWARD``: the model's ``gather_torch`` / ``gather_backward_torch``
  (GCN/SAGE: one CSR x dense product, ``A[rows] · H`` and ``A^T · dY``; GAT: the edge softmax
  and its backward);
* ``FUNCTION`` and ``VERTEX`` stages: the model's ``compute`` over
  :mod:`dorylus.models.torch_ops`, the torch twin of its numpy ops (dropout masks hashed on the
  device, the same bits as every other role's, each hashed once per epoch, layer and interval:
  the backward pass reuses the forward's, :class:`~dorylus.models.torch_ops.MaskCache`). The
  parameters come from the parameter server (host numpy) and the gradients go back to it from
  the host, so versions and stashing behave as with the other backends; the calls are the
  ``cpu`` backend's (:class:`graphserver.backends.gpu.GpuBackend` is
  :class:`graphserver.backends.cpu.CpuBackend` on this state), and on CUDA the server's log gets
  the device's peak memory when it stops.

No stage drains the device. A server's stages run on one compute stream (the device's default
one), in the order the scheduler issues them; every host<->device move goes through pinned host
memory on a second, copy stream, ordered against the compute stream by events, never by
synchronizing a stream:

* a stage's parameters are staged into one pinned buffer and copied on the copy stream; the
  compute stream waits for that copy's event (a pageable upload would block the host until
  everything queued before it had run);
* a stage's gradients and its loss/accuracy scalars (0-d device tensors, no ``.item()``) are
  copied to pinned memory on the copy stream after an event recorded behind the kernels that
  made them, and the worker thread that runs the stage waits for that one event (the push to the
  parameter server needs them next); stages without either never wait;
* ghost rows to send are snapshotted on the compute stream and copied after an event recorded
  right behind the snapshot, awaited off the event loop; nothing is copied (and nothing awaited)
  for peers with no rows; received rows are staged in pinned memory, copied on the copy stream,
  and the compute stream waits for that copy only.

Every thread that touches CUDA (the server's loop, the stage worker threads, the threads that
await copies) first makes the state's device its current one (:meth:`CudaRuntime.bind_thread`):
a thread starts on GPU 0, and a runtime call there would open a second CUDA context on GPU 0
for ``--device cuda:N``.

Sync and pipe stay exact (equal to the reference within float32 rounding): TF32 is off unless
``allow_tf32`` (:func:`set_tf32`, torch's ``fp32_precision`` API). Several graph servers may
share one CUDA device, each held by torch's caching allocator to ``gpu_memory_fraction`` of it,
by default an equal share less a CUDA context per process (:func:`memory_fraction`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings

import numpy as np
import torch

from dorylus.errors import ConfigError
from dorylus.models import torch_ops
from dorylus.models.base import Plan, Result, Stage
from dorylus.models.graph import CsrGraph, csr_of_tensors
from dorylus.partition import Partition
from graphserver.state import PartitionState

logger = logging.getLogger(__name__)

# Device memory a process's CUDA context takes outside torch's caching allocator (so outside the
# budget that set_per_process_memory_fraction enforces): driver state and the kernels loaded so
# far. With lazy module loading (CUDA >= 11.7, PyTorch's default since 1.13) this has been
# reported at 287 MB (pytorch/pytorch#86509, eager loading 667 MB), "around 400MB"
# (pytorch/pytorch#109888, ptrblck) and 426 MiB with torch 2.10 + CUDA 13 on an RTX 6000 Ada
# (unslothai/unsloth-zoo#1053); cuBLAS and cuSPARSE load more kernels on first use. 512 MiB per
# graph server is reserved: not measured here (no GPU was available when this was written).
CONTEXT_RESERVE_BYTES = 512 * 2**20


def set_tf32(allow: bool) -> None:
    """TF32 in CUDA matrix products (cuBLAS) and cuDNN convolutions on or off, through torch's
    ``fp32_precision`` API (``"tf32"`` or ``"ieee"``). The legacy ``allow_tf32`` flags are
    neither set nor read anywhere here: once the new API has been used, reading
    ``torch.backends.cudnn.allow_tf32`` raises (torch 2.9 and later)."""
    mode = "tf32" if allow else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def memory_fraction(configured: float | None, parts: int, total_bytes: int) -> float:
    """The share of the device's ``total_bytes`` this graph server's allocator may take:
    ``configured`` (``--gpu-memory-fraction``) if set, else ``1 / parts`` less one CUDA context
    (:data:`CONTEXT_RESERVE_BYTES`), so that ``parts`` servers and their contexts fit together.
    ConfigError when that leaves nothing."""
    if configured is not None:
        return configured
    fraction = 1.0 / parts - CONTEXT_RESERVE_BYTES / total_bytes
    if fraction <= 0.0:
        raise ConfigError(f"invalid config: {parts} graph servers cannot share a device of "
                          f"{total_bytes / 2**30:.1f} GiB (each needs {CONTEXT_RESERVE_BYTES / 2**20:.0f} MiB "
                          f"for its CUDA context); use fewer --parts or set --gpu-memory-fraction")
    return fraction


def open_device(config, parts: int) -> torch.device:
    """The torch device of ``config.device``, which :func:`graphserver.backends.gpu.check_device`
    has found on this machine; on CUDA made this thread's current device, with TF32 as
    ``config.allow_tf32`` says and this process's memory budget set."""
    device = torch.device(config.device)
    if device.type != "cuda":
        logger.info("gpu backend: device %s (torch's CPU kernels)", device)
        return device
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.cuda.set_device(device)  # before anything else opens a context on GPU 0 (see the module docstring)
    set_tf32(config.allow_tf32)
    properties = torch.cuda.get_device_properties(device)
    fraction = memory_fraction(config.gpu_memory_fraction, parts, properties.total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device.index)
    reserve = "" if config.gpu_memory_fraction is not None else \
        f" (1/{parts} less {CONTEXT_RESERVE_BYTES / 2**20:.0f} MiB for the CUDA context)"
    logger.info("gpu backend: device %s (%s), TF32 %s, memory budget %.3g of %.1f GiB%s", device, properties.name,
                "on" if config.allow_tf32 else "off", fraction, properties.total_memory / 2**30, reserve)
    return device


class CudaRuntime:
    """The CUDA calls a :class:`DeviceState` makes, in one place: its copy stream, events, pinned
    buffers, and the current device of each thread. (The tests stand a recording fake in for it
    that runs the same paths on CPU tensors.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self._thread = threading.local()
        self.bind_thread()
        self.copy_stream = torch.cuda.Stream(device)

    def bind_thread(self) -> None:
        """Make the device current in the calling thread, once per thread (a thread starts on
        GPU 0; set_device never opens a context elsewhere, and nothing here resets it)."""
        if not getattr(self._thread, "bound", False):
            torch.cuda.set_device(self.device)
            self._thread.bound = True

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        """Context: kernels and copies queued inside go to ``stream``."""
        return torch.cuda.stream(stream)

    def event(self, stream) -> torch.cuda.Event:
        """An event recorded on ``stream`` now: done when what is queued there so far is."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (torch's caching host allocator: a block is not reused before
        the copies that used it have completed)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def keep_for(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s device block is not reused until ``stream``'s work queued so far is done
        (it was allocated on another stream)."""
        tensor.record_stream(stream)


class DeviceCsrGraph(CsrGraph):
    """:class:`~dorylus.models.graph.CsrGraph` whose transposes are built on its device: the
    forward matrices of the row blocks in ``row_blocks`` (the intervals, already on the device
    for Gather) are concatenated and stably sorted by column there, so no host sort and no host
    values. Entries of a transposed row stay in ascending source order, as the host transpose
    has them (the same summation order)."""

    row_blocks: list[tuple[int, int]] = []

    def transpose(self, kind: str) -> torch.Tensor:
        cache = self.__dict__.setdefault("_device_transposes", {})
        if kind not in cache:
            blocks = list(self.row_blocks)
            if not blocks or blocks[0][0] != 0 or blocks[-1][1] != self.num_rows or any(
                    a[1] != b[0] for a, b in zip(blocks, blocks[1:])):
                blocks = [(0, self.num_rows)]  # the blocks must tile the rows in order
            cache[kind] = transpose_on_device([self.matrix(kind, block) for block in blocks], self.num_cols)
        return cache[kind]


def transpose_on_device(blocks: list[torch.Tensor], num_cols: int) -> torch.Tensor:
    """``[num_cols, rows]`` CSR of the transpose of the row blocks ``blocks`` (torch CSR of one
    device and index dtype, stacked in order), built with torch ops on their device and no host
    read of the device (sizes come from the tensors' shapes)."""
    device, index = blocks[0].device, blocks[0].col_indices().dtype
    rows, offset = [], 0
    for block in blocks:
        n, nnz = block.shape[0], block.values().numel()
        rows.append(torch.repeat_interleave(torch.arange(offset, offset + n, dtype=index, device=device),
                                            block.crow_indices().diff(), output_size=nnz))
        offset += n
    row = torch.cat(rows)
    col = torch.cat([block.col_indices() for block in blocks])
    values = torch.cat([block.values() for block in blocks])
    order = torch.argsort(col, stable=True)
    crow = torch.searchsorted(col[order], torch.arange(num_cols + 1, dtype=index, device=device),
                              out_int32=index == torch.int32)
    return csr_of_tensors(crow, row[order], values[order], (num_cols, offset))


class DeviceState(PartitionState):
    """:class:`~graphserver.state.PartitionState` with its rows and graph on ``device``.

    ``mask_epochs``: the dropout masks of this many newest epochs are kept for the backward
    pass (:class:`~dorylus.models.torch_ops.MaskCache`)."""

    def __init__(self, part: Partition, plan: Plan, *, device: torch.device, row_normalize_features: bool,
                 num_intervals: int, mask_epochs: int = 2):
        # Dense features: the device's products read dense rows (sparse X stays a host layout).
        super().__init__(part, plan, row_normalize_features=row_normalize_features, num_intervals=num_intervals,
                         sparse_features="off")
        self.device = device
        self.cuda = CudaRuntime(device) if device.type == "cuda" else None
        n_owned = part.n_owned
        self.graph = DeviceCsrGraph(part.indptr, part.indices, part.norm[:n_owned], part.norm, part.n_local,
                                    self.global_ids[:n_owned], self.global_ids, device=device)
        self.graph.row_blocks = list(self.intervals)
        # Copied: the store's arrays may be read-only memory maps, which torch will not wrap.
        self.static = {name: torch.from_numpy(np.array(values)).to(device) for name, values in self.static.items()}
        self.buffers = {name: torch.zeros(tuple(buffer.shape), dtype=torch.float32, device=device)
                        for name, buffer in self.buffers.items()}
        self.masks = torch_ops.MaskCache(self.static["ids"], epochs=mask_epochs)
        self.ops = torch_ops.Ops(self.masks)
        self._send_index: dict[int, torch.Tensor] = {}

    def _bind(self) -> None:
        if self.cuda is not None:
            self.cuda.bind_thread()

    def host_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        self._bind()
        return self._download([self.rows(name)[start:stop]])[0]

    # ------------------------------------------------------------------ host <-> device

    def _upload(self, params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The layer's ``params`` on the device, usable by the compute stream's next work. On
        CUDA: staged into one pinned buffer and copied with one non-blocking copy on the copy
        stream; the compute stream waits for that copy's event, the host for nothing."""
        arrays = {name: np.asarray(value) for name, value in params.items()}
        for name, value in arrays.items():
            if value.dtype != np.float32:
                raise ValueError(f"parameter {name} must be float32, got {value.dtype}")
        if self.cuda is None:
            return {name: torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
                    for name, value in arrays.items()}
        sizes = [value.size for value in arrays.values()]
        staged = self.cuda.pinned((sum(sizes),), torch.float32)
        host, start = staged.numpy(), 0
        for value, size in zip(arrays.values(), sizes):
            host[start:start + size] = value.ravel()
            start += size
        with self.cuda.on(self.cuda.copy_stream):
            flat = staged.to(self.device, non_blocking=True)
            copied = self.cuda.event(self.cuda.copy_stream)
        compute = self.cuda.compute_stream()
        compute.wait_event(copied)
        self.cuda.keep_for(flat, compute)  # allocated on the copy stream, read on the compute stream
        out, start = {}, 0
        for (name, value), size in zip(arrays.items(), sizes):
            out[name] = flat[start:start + size].view(value.shape)
            start += size
        return out

    def _download(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        """``tensors`` (device) as host arrays, in order. On CUDA: copied into pinned memory on the
        copy stream after an event recorded on the compute stream now (behind the kernels that
        made them), and this thread waits for the copies' one event. Nothing to copy: no wait."""
        if self.cuda is None:
            return [t.contiguous().numpy() for t in tensors]
        if all(t.numel() == 0 for t in tensors):
            return [np.empty(tuple(t.shape), dtype=_numpy_dtype(t.dtype)) for t in tensors]
        produced = self.cuda.event(self.cuda.compute_stream())
        copy = self.cuda.copy_stream
        copy.wait_event(produced)
        hosts = []
        with self.cuda.on(copy):
            for tensor in tensors:
                self.cuda.keep_for(tensor, copy)  # not reused by the compute stream until copied
                host = self.cuda.pinned(tuple(tensor.shape), tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                hosts.append(host)
            done = self.cuda.event(copy)
        done.synchronize()
        return [host.numpy() for host in hosts]  # each array keeps its pinned block

    # ------------------------------------------------------------------ the model's stages

    def compute(self, model, task: str, layer: int, rows: list, params: dict[str, np.ndarray] | None,
                args: dict) -> Result:
        """``model.compute`` on device rows with :mod:`~dorylus.models.torch_ops` (this state's
        dropout masks); the layer's ``params`` come from the host and the ``grads`` and scalar
        ``meta`` go back to it in one event-ordered copy, the result's rows stay on the device."""
        self._bind()
        on_device = None if params is None else self._upload(params)
        result = model.compute(task, layer, rows, on_device, args, ops=self.ops)
        grads = dict(result.grads) if result.grads is not None else {}
        scalars = {key: value for key, value in result.meta.items() if isinstance(value, torch.Tensor)}
        if grads or scalars:
            hosts = self._download([*grads.values(), *scalars.values()])
            if result.grads is not None:
                result.grads = dict(zip(grads, hosts[:len(grads)]))
            for key, host in zip(scalars, hosts[len(grads):]):
                result.meta[key] = host.item()  # numpy's item: an int for the counts, a float for the loss
        return result

    def gather(self, model, stage: Stage, interval: int, args: dict) -> None:
        self._bind()
        inputs = [self.buffers[name] for name in stage.reads]
        result = model.gather_torch(stage.task, stage.layer, self.graph, self.intervals[interval], inputs, args)
        for name, values in zip(stage.writes, result):
            self.write(name, interval, values)

    def gather_backward(self, model, stage: Stage, args: dict) -> list[torch.Tensor]:
        self._bind()
        inputs = [self.buffers[name][: self.n_owned] if k == 0 else self.buffers[name]
                  for k, name in enumerate(stage.reads)]
        return model.gather_backward_torch(stage.task, stage.layer, self.graph, inputs, args)

    # ------------------------------------------------------------------ ghost exchange (numpy rows)

    def _peer_index(self, peer: int) -> torch.Tensor:
        """``part.send_rows(peer)`` on the device, copied once."""
        if peer not in self._send_index:
            self._send_index[peer] = torch.from_numpy(np.ascontiguousarray(self.part.send_rows(peer),
                                                                           dtype=np.int64)).to(self.device)
        return self._send_index[peer]

    async def _to_host(self, blocks: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
        """Device ``blocks`` (snapshots just queued on the compute stream) as host arrays. On CUDA
        the copies run on the copy stream after an event recorded behind the snapshots, and the
        event loop awaits them in a worker thread while the server goes on queueing other
        intervals' work; empty blocks are never copied (and, all empty, nothing is awaited)."""
        if self.cuda is None or all(block.numel() == 0 for block in blocks.values()):
            return dict(zip(blocks, self._download(list(blocks.values()))))
        produced = self.cuda.event(self.cuda.compute_stream())
        copy = self.cuda.copy_stream
        copy.wait_event(produced)
        hosts = {}
        with self.cuda.on(copy):
            for key, block in blocks.items():
                hosts[key] = self.cuda.pinned(tuple(block.shape), block.dtype)
                if block.numel():
                    self.cuda.keep_for(block, copy)  # not reused by the compute stream until copied
                    hosts[key].copy_(block, non_blocking=True)
            done = self.cuda.event(copy)

        def wait() -> None:
            self.cuda.bind_thread()
            done.synchronize()

        await asyncio.to_thread(wait)
        return {key: host.numpy() for key, host in hosts.items()}  # each array keeps its pinned block

    def _to_device(self, rows: np.ndarray) -> torch.Tensor:
        """Host ``rows`` on the device, usable by the compute stream's next work. On CUDA: staged
        in pinned memory and copied on the copy stream, so the host does not wait for the work
        already queued and the copy overlaps it; the compute stream waits for the copy only."""
        if self.cuda is None:
            with warnings.catch_warnings():  # received ghost rows are read-only frames; only read here
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                return torch.from_numpy(rows).to(self.device)
        staged = self.cuda.pinned(rows.shape, torch.float32)
        staged.numpy()[...] = rows
        with self.cuda.on(self.cuda.copy_stream):
            block = staged.to(self.device, non_blocking=True)
            copied = self.cuda.event(self.cuda.copy_stream)
        compute = self.cuda.compute_stream()
        compute.wait_event(copied)
        self.cuda.keep_for(block, compute)
        return block

    async def rows_for_peers(self, name: str, peers) -> dict[int, np.ndarray]:
        self._bind()
        return await self._to_host({peer: self.buffers[name].index_select(0, self._peer_index(peer))
                                    for peer in peers})

    def set_ghost_rows(self, name: str, peer: int, rows: np.ndarray) -> None:
        self._bind()
        self.buffers[name][self.part.ghost_rows(peer)].copy_(self._to_device(rows))

    async def contributions_for_peers(self, contribution: torch.Tensor, peers) -> dict[int, np.ndarray]:
        self._bind()
        return await self._to_host({peer: contribution[self.part.ghost_rows(peer)] for peer in peers})

    def set_owned_rows(self, name: str, contribution: torch.Tensor) -> None:
        self._bind()
        self.buffers[name].copy_(contribution[: self.n_owned])

    def add_peer_contribution(self, name: str, peer: int, rows: np.ndarray) -> None:
        self._bind()
        self.buffers[name].index_add_(0, self._peer_index(peer), self._to_device(rows))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype

