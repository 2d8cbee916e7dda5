"""The ``gpu`` backend: a graph server keeps its partition on a torch device and runs every stage
there, graph work and tensor work alike (DESIGN §7).

What lives on the device (:class:`DeviceState`): the owned rows of the static inputs (``X``
dense ``float32 [n_owned, F]``, ``ids``, ``labels``, ``split``), every row buffer of the plan
(``[n_owned or n_local, width]``), and the in-edge CSR of the partition with its transposes
(:class:`~dorylus.models.graph.CsrGraph` on the device). What runs there:

* ``GATHER`` / ``GATHER_BACKWARD``: the model's ``gather_torch`` / ``gather_backward_torch``
  (GCN/SAGE: one CSR x dense product, ``A[rows] · H`` and ``A^T · dY``; GAT: the edge softmax
  and its backward);
* ``FUNCTION`` and ``VERTEX`` stages: the model's ``compute`` over
  :mod:`dorylus.models.torch_ops`, the torch twin of its numpy ops (dropout masks hashed on the
  device, the same bits as every other role's). The weights come from the parameter server
  (host numpy, copied to the device per call) and the gradients go back to it from the host,
  so versions and stashing behave as with the other backends; the calls are the ``cpu``
  backend's (:class:`GpuBackend` is :class:`graphserver.backends.cpu.CpuBackend` on this
  state), and on CUDA the server's log gets the device's peak memory when it stops.

Ghost exchange stays ZeroMQ between graph servers. A server's stages run on one compute stream
(the device's default one), in the order the scheduler issues them. On CUDA, ghost rows cross
the bus on a second, copy stream: rows to send are snapshotted on the compute stream and copied
into pinned host memory on the copy stream while the server goes on queueing other intervals'
work (the scatter awaits the copy, not the device); received rows are staged in pinned memory
and copied on the copy stream, and the compute stream waits for that copy only, never the host.

Sync and pipe stay exact (equal to the reference within float32 rounding): TF32 is off unless
``allow_tf32``. Several graph servers may share one CUDA device, each held to
``gpu_memory_fraction`` of it (default ``1 / parts``) by torch's caching allocator.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from dorylus.models import torch_ops
from dorylus.models.base import Plan, Result, Stage
from dorylus.models.graph import CsrGraph
from dorylus.partition import Partition
from graphserver.backends.cpu import CpuBackend
from graphserver.state import PartitionState


def open_device(config, parts: int) -> torch.device:
    """The torch device of ``config.device``, checked (ConfigError if absent), with TF32 as
    ``config.allow_tf32`` says and, on CUDA, this process's memory budget set."""
    config.check_device()
    device = torch.device(config.device)
    if device.type != "cuda":
        print(f"gpu backend: device {device} (torch's CPU kernels)", flush=True)
        return device
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32
    torch.backends.cudnn.allow_tf32 = config.allow_tf32
    fraction = config.gpu_memory_fraction or 1.0 / parts
    torch.cuda.set_per_process_memory_fraction(fraction, device.index)
    properties = torch.cuda.get_device_properties(device)
    print(f"gpu backend: device {device} ({properties.name}), TF32 {'on' if config.allow_tf32 else 'off'}, "
          f"memory budget {fraction:.3g} of {properties.total_memory / 2**30:.1f} GiB", flush=True)
    return device


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array on the host: itself on the CPU (shared memory); from a CUDA
    device through pinned memory (torch's caching host allocator), waited for."""
    if tensor.device.type == "cpu":
        return tensor.contiguous().numpy()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host.numpy()  # the array keeps ``host`` alive, so its block is not reused under it


class DeviceState(PartitionState):
    """:class:`~graphserver.state.PartitionState` with its rows and graph on ``device``."""

    def __init__(self, part: Partition, plan: Plan, *, device: torch.device, row_normalize_features: bool,
                 num_intervals: int):
        # Dense features: the device's products read dense rows (sparse X stays a host layout).
        super().__init__(part, plan, row_normalize_features=row_normalize_features, num_intervals=num_intervals,
                         sparse_features="off")
        self.device = device
        n_owned = part.n_owned
        self.graph = CsrGraph(part.indptr, part.indices, part.norm[:n_owned], part.norm, part.n_local,
                              self.global_ids[:n_owned], self.global_ids, device=device)
        # Copied: the store's arrays may be read-only memory maps, which torch will not wrap.
        self.static = {name: torch.from_numpy(np.array(values)).to(device) for name, values in self.static.items()}
        self.buffers = {name: torch.zeros(tuple(buffer.shape), dtype=torch.float32, device=device)
                        for name, buffer in self.buffers.items()}
        self._send_index: dict[int, torch.Tensor] = {}
        # Ghost rows cross the bus on their own stream (see _to_host, _to_device).
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def host_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return to_host(self.rows(name)[start:stop])

    # ------------------------------------------------------------------ the model's stages

    def compute(self, model, task: str, layer: int, rows: list, w: np.ndarray | None, args: dict) -> Result:
        """``model.compute`` on device rows with :mod:`~dorylus.models.torch_ops`; ``w`` comes
        from the host and ``grad_w`` goes back to it, the result's rows stay on the device."""
        weight = None if w is None else torch.from_numpy(np.ascontiguousarray(w)).to(self.device)
        result = model.compute(task, layer, rows, weight, args, ops=torch_ops)
        if result.grad_w is not None:
            result.grad_w = to_host(result.grad_w)
        return result

    def gather(self, model, stage: Stage, interval: int, args: dict) -> None:
        inputs = [self.buffers[name] for name in stage.reads]
        result = model.gather_torch(stage.task, stage.layer, self.graph, self.intervals[interval], inputs, args)
        for name, values in zip(stage.writes, result):
            self.write(name, interval, values)

    def gather_backward(self, model, stage: Stage, args: dict) -> list[torch.Tensor]:
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
        """Device ``blocks`` (snapshots taken on the compute stream) as host arrays. On CUDA the
        copies run on the copy stream while the server goes on queueing other intervals' work."""
        if self._copy_stream is None:
            return {key: to_host(block) for key, block in blocks.items()}
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        hosts = {}
        with torch.cuda.stream(self._copy_stream):
            for key, block in blocks.items():
                block.record_stream(self._copy_stream)  # not reused by the compute stream until copied
                hosts[key] = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
                hosts[key].copy_(block, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        await asyncio.to_thread(done.synchronize)
        return {key: host.numpy() for key, host in hosts.items()}  # each array keeps its pinned block

    def _to_device(self, rows: np.ndarray) -> torch.Tensor:
        """Host ``rows`` on the device, usable by the compute stream's next work. On CUDA: staged
        in pinned memory and copied on the copy stream, so the host does not wait for the work
        already queued and the copy overlaps it; the compute stream waits for the copy only."""
        if self._copy_stream is None:
            return torch.from_numpy(rows).to(self.device)
        staged = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
        staged.numpy()[...] = rows
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            block = staged.to(self.device, non_blocking=True)
        compute.wait_stream(self._copy_stream)
        block.record_stream(compute)
        return block

    async def rows_for_peers(self, name: str, peers) -> dict[int, np.ndarray]:
        return await self._to_host({peer: self.buffers[name].index_select(0, self._peer_index(peer))
                                    for peer in peers})

    def set_ghost_rows(self, name: str, peer: int, rows: np.ndarray) -> None:
        self.buffers[name][self.part.ghost_rows(peer)].copy_(self._to_device(rows))

    async def contributions_for_peers(self, contribution: torch.Tensor, peers) -> dict[int, np.ndarray]:
        return await self._to_host({peer: contribution[self.part.ghost_rows(peer)] for peer in peers})

    def set_owned_rows(self, name: str, contribution: torch.Tensor) -> None:
        self.buffers[name].copy_(contribution[: self.n_owned])

    def add_peer_contribution(self, name: str, peer: int, rows: np.ndarray) -> None:
        self.buffers[name].index_add_(0, self._peer_index(peer), self._to_device(rows))


class GpuBackend(CpuBackend):
    """The cpu backend's in-process calls, on a :class:`DeviceState`; when the graph server
    stops, its log gets the CUDA device's peak memory (what benchmarks/bench_gpu.py reads)."""

    async def close(self) -> None:
        await super().close()
        device = self.server.state.device
        if device.type == "cuda":
            print(f"gpu backend: peak memory allocated {torch.cuda.max_memory_allocated(device)} bytes, reserved "
                  f"{torch.cuda.max_memory_reserved(device)} bytes on {device}", flush=True)
