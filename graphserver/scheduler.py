"""The graph server's scheduler: runs its intervals' epochs through the model's stages.

Each interval is one coroutine that walks the plan (:mod:`dorylus.models.base`) epoch after
epoch: the training pass, then (when due) the evaluation pass. Stages meet where data requires:

* ``GATHER`` reads the rows of every interval and the peers' ghost rows, so all intervals
  arrive first; the last to arrive scatters the owned rows that peers hold as ghosts and waits
  for the peers' rows (at most ``S`` epochs old), then each interval gathers its own rows.
* ``GATHER_BACKWARD`` runs once for the partition when all intervals arrived, including the
  backward Scatter (ghost-row contributions go to their owners and are summed in peer order).
* ``FUNCTION`` stages go to the backend, one call per interval, in priority order (older epoch,
  then stage order: forward layers up, backward layers down, then interval); ``VERTEX`` stages
  run in the graph server's threads.

The mode (:mod:`graphserver.modes`) adds its waits: a barrier after every stage (sync), the
epoch gate ``e <= min_epoch + S`` (async), and the oldest weight version a pass may use. When
every interval finished an epoch, its report (loss, accuracy counts, seconds per task, bytes,
staleness, weight lag, relaunches, failures by kind, fallbacks) waits for the coordinator's next
``progress`` poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Any

import numpy as np

from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, VERTEX, Stage
from graphserver.autotune import Autotuner
from graphserver.invoker import TaskFailed, describe

PASSES = ("train", "eval")


class _Barrier:
    def __init__(self) -> None:
        self.arrived = 0
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()


class _EpochRecord:
    """What one epoch's stages reported, summed over intervals."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.task_s: dict[str, float] = defaultdict(float)
        self.staleness: list[int] = []
        self.weight_lag_max = 0
        self.intervals_done = 0
        self.train_start: float | None = None  # the training pass: first interval in, last one out
        self.train_end = 0.0


class Scheduler:
    def __init__(self, server, *, first: int, last: int, epochs: int, eval_every: int):
        self.server = server
        self.mode = server.mode
        self.first, self.last, self.epochs, self.eval_every = first, last, epochs, eval_every
        self.n = len(server.state.intervals)
        self.barriers: dict[tuple, _Barrier] = {}
        self.records: dict[int, _EpochRecord] = defaultdict(_EpochRecord)
        self.version_waits: dict[int, asyncio.Future] = {}
        self.known_version = -1
        # Epochs finish in order (an epoch's Gathers meet every interval), so one number says
        # which are done; the server refuses messages for epochs far beyond it.
        self.oldest_unfinished = first
        config = server.config
        self.autotuner = (Autotuner(1, self.n, min(self.n, 4)) if config.functions is None else None)
        server.backend.concurrency = self.autotuner.value if self.autotuner else min(config.functions, self.n)
        self.last_epoch_end = time.monotonic()

    # ------------------------------------------------------------------ top level

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._interval(i)) for i in range(self.n)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(*tasks, return_exceptions=True)

    def evaluates(self, epoch: int) -> bool:
        return epoch % self.eval_every == 0 or epoch == self.epochs

    async def _interval(self, i: int) -> None:
        for epoch in range(self.first, self.last + 1):
            await self._epoch_gate(epoch)
            record = self.records[epoch]
            if record.train_start is None:
                record.train_start = time.monotonic()
            await self._pass(i, epoch, "train")
            record.train_end = max(record.train_end, time.monotonic())
            if self.evaluates(epoch):
                await self._pass(i, epoch, "eval")
            self._interval_done(epoch)

    async def _epoch_gate(self, epoch: int) -> None:
        server = self.server
        if not self.mode.gate_epochs:
            return
        while epoch > server.min_epoch + self.mode.staleness:
            server.gate_changed.clear()
            await server.gate_changed.wait()

    # ------------------------------------------------------------------ one pass

    async def _pass(self, i: int, epoch: int, pass_: str) -> None:
        server, S = self.server, self.mode.staleness
        stages = server.plan.train if pass_ == "train" else server.plan.evaluate
        # forward of epoch e: weights after epoch e-1's step (sync); evaluation: after e's
        await self._version_at_least(epoch - 1 - S if pass_ == "train" else epoch - S)
        for k, stage in enumerate(stages):
            start = time.perf_counter()
            if stage.kind == GATHER:
                await self._meet((pass_, epoch, k), lambda: self._scatter(pass_, epoch, stage))
                await server.run_in_thread(server.run_gather, stage, pass_, epoch, i)
            elif stage.kind == GATHER_BACKWARD:
                await self._meet((pass_, epoch, k), lambda: self._gather_backward(pass_, epoch, stage))
            elif stage.kind == VERTEX:
                await server.run_in_thread(server.run_vertex, stage, pass_, epoch, i)
            elif stage.kind == FUNCTION:
                await self._call(i, epoch, pass_, k, stage)
            else:
                raise ValueError(f"unknown stage kind {stage.kind!r}")
            self.records[epoch].task_s[stage.task.lower() + ("_eval" if pass_ == "eval" else "") + "_s"] += \
                time.perf_counter() - start
            if self.mode.stage_barrier:
                await self._meet((pass_, epoch, k, "end"), None)

    async def _meet(self, key: tuple, action) -> None:
        """Wait until every interval arrived at ``key``; the last to arrive runs ``action``."""
        barrier = self.barriers.get(key)
        if barrier is None:
            barrier = self.barriers[key] = _Barrier()
        barrier.arrived += 1
        if barrier.arrived == self.n:
            del self.barriers[key]
            try:
                if action is not None:
                    await action()
                barrier.done.set_result(None)
            except BaseException as exc:
                barrier.done.set_exception(exc)
        await barrier.done

    async def _call(self, i: int, epoch: int, pass_: str, k: int, stage: Stage) -> None:
        server = self.server
        event = server.event(stage, pass_, epoch, i)
        priority = (epoch, PASSES.index(pass_), k, i)
        call = describe(event)
        server.in_flight[call] = time.monotonic()
        server.await_result(pass_, stage.task, stage.layer, epoch, i)
        try:
            await server.backend.run(event, priority)
        finally:
            del server.in_flight[call]
        meta = server.take_result(pass_, stage.task, stage.layer, epoch, i)
        record = self.records[epoch]
        if pass_ == "train" and "loss" in meta:
            record.sums["loss"] += meta["loss"]
        if pass_ == "eval":
            for split in ("train", "val", "test"):
                record.sums[f"correct_{split}"] += meta.get(f"correct_{split}", 0)
        record.weight_lag_max = max(record.weight_lag_max, int(meta.get("weight_lag", 0)))

    # ------------------------------------------------------------------ scatter

    async def _scatter(self, pass_: str, epoch: int, stage: Stage) -> None:
        """SC: peers get our rows of the Gather's inputs that they hold as ghosts; theirs fill ours."""
        server, state = self.server, self.server.state
        for name in stage.reads:
            await server.send_ghosts("SC", pass_, epoch, stage.layer, name,
                                     await state.rows_for_peers(name, server.peers))
        for name in stage.reads:
            received = await self._receive("SC", pass_, epoch, stage.layer, name)
            for j, rows in received.items():
                state.set_ghost_rows(name, j, rows)

    async def _gather_backward(self, pass_: str, epoch: int, stage: Stage) -> None:
        server, state = self.server, self.server.state
        local = await server.run_in_thread(server.run_gather_backward, stage, pass_, epoch)
        for name, contribution in zip(stage.writes, local):
            await server.send_ghosts("SC_BWD", pass_, epoch, stage.layer, name,
                                     await state.contributions_for_peers(contribution, server.peers))
        for name, contribution in zip(stage.writes, local):
            state.set_owned_rows(name, contribution)
            received = await self._receive("SC_BWD", pass_, epoch, stage.layer, name)
            for j in sorted(received):  # fixed order: the sum does not depend on arrival order
                state.add_peer_contribution(name, j, received[j])

    async def _receive(self, task: str, pass_: str, epoch: int, layer: int, name: str) -> dict[int, np.ndarray]:
        """Every peer's newest rows of ``name``, waiting until each is at most S epochs old."""
        server, oldest = self.server, epoch - self.mode.staleness
        timeout = server.config.task_timeout_s
        deadline = time.monotonic() + timeout
        inbox = server.inbox[(pass_, task, name)]
        while True:
            missing = [j for j in server.peers if j not in inbox or inbox[j][0] < oldest]
            if not missing:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TaskFailed(f"graph server {server.part_id}: {task} of {name} ({pass_} epoch {epoch} layer "
                                 f"{layer}): no rows of epoch >= {oldest} from graph server(s) {missing} within "
                                 f"{timeout:.0f} s")
            server.inbox_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.inbox_changed.wait(), remaining)
        record = self.records[epoch]
        received = {}
        for j in server.peers:
            tag, rows = inbox[j]
            record.staleness.append(max(0, epoch - tag))
            received[j] = rows
        return received

    # ------------------------------------------------------------------ weights and epochs

    async def _version_at_least(self, version: int) -> None:
        if version <= self.known_version:
            return
        wait = self.version_waits.get(version)
        if wait is None:
            wait = self.version_waits[version] = asyncio.ensure_future(self.server.wait_version(version))
        self.known_version = max(self.known_version, await asyncio.shield(wait))
        self.version_waits.pop(version, None)

    def _interval_done(self, epoch: int) -> None:
        record = self.records[epoch]
        record.intervals_done += 1
        if record.intervals_done < self.n:
            return
        server = self.server
        now = time.monotonic()
        epoch_s = now - self.last_epoch_end
        self.last_epoch_end = now
        stats = server.backend.take_stats()
        report: dict[str, Any] = {
            "epoch": epoch, "loss": record.sums["loss"],
            **{k: int(v) for k, v in record.sums.items() if k.startswith("correct_")},
            "evaluated": self.evaluates(epoch), "task_s": dict(record.task_s), "epoch_s": epoch_s,
            "staleness_max": max(record.staleness, default=0),
            "staleness_sum": sum(record.staleness), "staleness_reads": len(record.staleness),
            "weight_lag_max": record.weight_lag_max, "concurrency": server.backend.concurrency,
            **{k: stats.get(k, 0) for k in ("invocations", "relaunches", "failed_calls", "fallback_calls")},
            "failures": dict(stats.get("failures", {})),  # failed function attempts by kind
            **server.take_traffic(),
        }
        server.reports.append(report)
        del self.records[epoch]
        self.oldest_unfinished = max(self.oldest_unfinished, epoch + 1)
        if self.autotuner is not None:  # the training pass alone: evaluation epochs are not slower steps
            new = self.autotuner.update(record.train_end - record.train_start, queued=stats.get("max_waiting", 0) > 0)
            if new is not None:
                server.backend.concurrency = new
