"""The ``gpu`` backend: a graph server keeps its partition on a torch device and runs every stage
there, graph work and tensor work alike (DESIGN §7), with the ``cpu`` backend's in-process calls.

This module is what the config, the coordinator, the parameter server and the planner ask of
the backend (its options, its device check, its pricing) and loads no torch: they import it
whenever a config names the backend. What runs on the device, in the graph server, is
:mod:`graphserver.backends.gpu_device`, imported by :meth:`GpuBackend.make_state`.
"""

from __future__ import annotations

import logging
import re

from dorylus.errors import ConfigError
from graphserver.backends.cpu import CpuBackend

logger = logging.getLogger(__name__)

DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")  # the torch devices this backend runs on


def check_device(config) -> None:
    """``config.device`` exists on this machine (CUDA built in, a device of that index visible):
    checked before a local run writes anything, and by each graph server on its own machine.
    torch is imported only to look for a CUDA device: torch's CPU device is always there."""
    if not config.device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"invalid config: device {config.device!r} (--device): CUDA is not available on this "
                          f"machine ({why}); use --device cpu to run the gpu backend on torch's CPU kernels")
    index = torch.device(config.device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"invalid config: device {config.device!r} (--device): this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s), numbered from 0")


class GpuBackend(CpuBackend):
    """The cpu backend's in-process calls, on a
    :class:`~graphserver.backends.gpu_device.DeviceState`; when the graph server stops, its log
    gets the CUDA device's peak memory (what benchmarks/bench_gpu.py reads). Priced and planned
    as one GPU per graph server (a V100 machine, the Dorylus paper's GPU, when the config names
    no instance)."""

    graph_server_instance = "p3.2xlarge"
    device = "gpu"
    scale_instance = "p3.2xlarge"

    @classmethod
    def check_config(cls, config) -> list[tuple[bool, str]]:
        return [
            (DEVICE_PATTERN.fullmatch(config.device) is not None,
             f"device {config.device!r} (--device) is not a torch device the gpu backend runs on: 'cuda', "
             "'cuda:N' or 'cpu'"),
            (config.gpu_memory_fraction is None or 0.0 < config.gpu_memory_fraction <= 1.0,
             f"gpu_memory_fraction must be in (0, 1], got {config.gpu_memory_fraction}"),
        ]

    @classmethod
    def check_machine(cls, config, parts: int | None = None) -> None:
        check_device(config)

    @classmethod
    def scale_intervals(cls, machine) -> int:
        """One: a stage's kernels already fill the GPU."""
        return 1

    @classmethod
    def make_state(cls, config, part, plan, *, parts: int):
        check_device(config)
        from graphserver.backends.gpu_device import DeviceState, open_device

        return DeviceState(part, plan, device=open_device(config, parts),
                           row_normalize_features=config.row_normalize_features, num_intervals=config.intervals)

    async def close(self) -> None:
        await super().close()
        device = self.server.state.device
        if device.type == "cuda":
            import torch  # loaded with the state

            logger.info("gpu backend: peak memory allocated %d bytes, reserved %d bytes on %s",
                        torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), device)


BACKEND = GpuBackend
