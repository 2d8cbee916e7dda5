"""The ``cpu`` backend: the model's ``compute`` runs in the graph server process, on its own
rows, with no invoke and no tensor hop; weights still come from (and gradients go to) the
parameter server, so versions and stashing behave as with functions. The ``gpu`` backend makes
the same calls on a state whose rows live on a torch device (:mod:`graphserver.backends.gpu_device`):
``state.compute`` decides which twin of the model's functions runs."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Any

from dorylus.models import get_model
from dorylus.protocol import Header, Op
from graphserver.backends import LimitedBackend, call_key
from graphserver.limiter import PriorityLimiter


class CpuBackend(LimitedBackend):
    def __init__(self, server, *, concurrency: int):
        self.server = server
        self.limiter = PriorityLimiter(concurrency)
        # As many computations at once as the server has threads (--threads): more interleave on
        # the same cores at no gain, each holding its interval's temporaries (a wide layer's
        # logits and gradient are 100s of MB), and oversubscribe the cores. torch is imported here,
        # not with the module, which the config and the planner import without a graph server.
        import torch

        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(server.config.intervals, torch.get_num_threads())))
        self.calls = 0
        # Weights of the stash keys (layer, epoch, interval) pulled this training run: every
        # ``pin`` and ``stash`` pull of one key gets the version its first pin pinned
        # (dorylus.paramserver), so a key's later stages (GCN: BIAS and AV_BWD after AV) need no
        # round trip. Versions are immutable, so sharing the arrays is safe. Bounded, oldest
        # dropped first: a key dropped too soon is pulled again, never wrong.
        self.pinned: collections.OrderedDict[tuple, tuple[dict, dict[str, Any]]] = collections.OrderedDict()
        self.pinned_for = None  # the scheduler (one per ``train`` command) the keys were pulled for
        self.pinned_max = server.config.intervals * server.config.layers * (server.config.staleness + 2)

    async def execute(self, event: dict[str, Any], priority: tuple) -> dict[str, Any]:
        async with self.limiter.slot(priority):
            self.calls += 1
            rows, meta = await self.compute(event)
        self.server.write_result(call_key(event), rows)
        return meta

    async def compute(self, event: dict[str, Any]) -> tuple[list, dict[str, Any]]:
        """Run one stage on the graph server's own rows, outside any slot; its rows and meta,
        not yet written. The lambda backend's fallback for a task its functions keep failing
        (:mod:`graphserver.backends.serverless`) runs it here. Weights and gradients go through
        the parameter server as a function's would, so a gradient a failed attempt already
        pushed is dropped there as a duplicate."""
        server = self.server
        a, b = event["rows"]
        layer, epoch, interval = event["layer"], event["epoch"], event["interval"]
        rows = [server.state.rows(name)[a:b] for name in event["reads"]]
        params, meta = None, {}
        if event["weights"]:
            params, meta = await self._weights(event["weights"], layer, epoch, interval)
        model = get_model(event["model"])
        result = await asyncio.get_running_loop().run_in_executor(
            self.executor, server.state.compute, model, event["task"], layer, rows, params, event["args"])
        if event["grad"] and result.grads is not None:
            await server.ps.request(Header(Op.PUSH_GRADS, layer=layer, epoch=epoch, interval=interval,
                                           part=server.part_id, version=meta["version"],
                                           names=tuple(result.grads)), list(result.grads.values()),
                                    timeout=server.config.task_timeout_s)
        meta.update(result.meta)
        return result.rows, meta

    async def _weights(self, wanted: str, layer: int, epoch: int, interval: int) -> tuple[dict, dict[str, Any]]:
        """The layer's parameters for a call and its meta (version, weight lag), from the
        parameter server or, for a stash key pulled before in this run, from :attr:`pinned`."""
        server = self.server
        if self.pinned_for is not server.scheduler:  # a new run (perhaps after a recovery): new pins
            self.pinned.clear()
            self.pinned_for = server.scheduler
        key = (layer, epoch, interval)
        if wanted in ("pin", "stash") and key in self.pinned:
            params, meta = self.pinned[key]
            return dict(params), dict(meta)
        reply, tensors = await server.ps.request(Header(
            Op.PULL_WEIGHTS, layer=layer, epoch=epoch, interval=interval, part=server.part_id,
            meta={"weights": wanted}), timeout=server.config.task_timeout_s)
        params = dict(zip(reply.names, tensors))
        meta = {"version": reply.version, "weight_lag": int(reply.meta.get("newest", reply.version)) - reply.version}
        if wanted == "pin":
            self.pinned[key] = (params, meta)
            while len(self.pinned) > self.pinned_max:
                self.pinned.popitem(last=False)
        return dict(params), dict(meta)

    def take_stats(self) -> dict[str, Any]:
        stats = {"invocations": self.calls, **self.limiter.take_stats()}
        self.calls = 0
        return stats

    async def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


BACKEND = CpuBackend
