"""The graph server's scheduler: runs its intervals' epochs through the model's stages.

Each interval is one coroutine that walks the plan (:mod:`dorylus.models.base`) epoch after
epoch: the training pass, then (when due) the evaluation pass. Stages meet where data requires:

* ``GATHER`` reads the rows of every interval and the peers' ghost rows, so all intervals
  arrive first; the last to arrive runs the Scatter (owned rows that peers hold as ghosts go
  out, the peers' rows come in, at most as old as the mode allows), then each interval gathers
  its own rows.
* ``GATHER_BACKWARD`` runs once for the partition when all intervals arrived, including the
  backward Scatter (ghost-row contributions go to their owners and are summed in peer order);
  one that the state pulls (``state.pulls(stage)``: symmetric, on an undirected graph) runs as
  a ``GATHER`` of its input instead.
* ``FUNCTION`` stages go to the backend, one call per interval, in priority order (older epoch,
  then stage order: forward layers up, backward layers down, then interval); ``VERTEX`` stages
  run in the graph server's threads.

The mode (:mod:`graphserver.modes`) is asked where to wait: before an epoch
(:meth:`~graphserver.modes.Mode.may_start`, against the coordinator's ``min_epoch``), after a
stage (:meth:`~graphserver.modes.Mode.barrier_after_stage`), for peer rows
(:meth:`~graphserver.modes.Mode.oldest_ghosts`) and for weights
(:meth:`~graphserver.modes.Mode.oldest_weights`); and whether an interval's evaluation pass of
epoch ``e`` runs beside its training pass of ``e + 1``
(:meth:`~graphserver.modes.Mode.evaluates_beside_training`: then the graph server allows twice
as many calls at once). When every interval finished an epoch, its
report (loss, accuracy counts, seconds per task, bytes, staleness, weight lag, relaunches,
failures by kind, fallbacks) waits for the coordinator's next ``progress`` poll.

What the scheduler uses of its graph server (:class:`graphserver.server.GraphServer`; the unit
tests drive it with a stand-in): ``plan``, ``mode``, ``backend`` (:mod:`graphserver.backends`),
``config.functions``, ``state.intervals``, ``state.pulls(stage)``; ``event(stage, pass, epoch,
interval)`` (a call's payload); the coroutines ``gather``/``vertex(stage, pass, epoch, interval)``,
``scatter(stage, pass, epoch, oldest)`` and ``gather_backward(stage, pass, epoch, oldest)``
(each Scatter returns the ages in epochs of the peer rows it used) and ``wait_version(v)``
(returns the newest version, at least ``v``); ``min_epoch`` with the event ``gate_changed`` set
when it grows; ``in_flight`` (calls running, for the watchdog); ``add_report(report)`` (a finished epoch) and
``take_traffic()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Any

from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, VERTEX, Stage
from graphserver.autotune import Autotuner
from graphserver.invoker import describe
from graphserver.modes import calls_at_once

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
        # Calls one graph server can have ready at once: a stage of every interval, twice as many
        # when evaluation runs beside the next epoch's training (graphserver.modes.calls_at_once;
        # a local emulator needs a worker for each, or it answers the calls beyond 429).
        self.beside = self.mode.evaluates_beside_training()
        most = calls_at_once(self.mode, self.n)
        self.autotuner = (Autotuner(1, most, min(most, 4)) if config.functions is None else None)
        server.backend.concurrency = self.autotuner.value if self.autotuner else calls_at_once(
            self.mode, self.n, config.functions)
        self.last_epoch_end = time.monotonic()
        self.failed: asyncio.Future | None = None  # the first failure of a pass run beside the intervals' loops

    # ------------------------------------------------------------------ top level

    async def run(self) -> None:
        self.failed = asyncio.get_running_loop().create_future()
        self.beside_tasks: list[asyncio.Future] = []
        tasks = [asyncio.create_task(self._interval(i)) for i in range(self.n)]
        every = asyncio.gather(*tasks)
        try:
            await asyncio.wait([every, self.failed], return_when=asyncio.FIRST_COMPLETED)
            if self.failed.done():
                self.failed.result()  # a pass run beside an interval's loop failed
            every.result()  # raises the first failure
        finally:
            for task in (*tasks, *self.beside_tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(*tasks, *self.beside_tasks, return_exceptions=True)
            if every.done() and not every.cancelled():
                every.exception()  # retrieved: raised above already, or none

    def evaluates(self, epoch: int) -> bool:
        return epoch % self.eval_every == 0 or epoch == self.epochs

    async def _interval(self, i: int) -> None:
        previous = None  # this interval's evaluation of the epoch before, when it runs beside training
        for epoch in range(self.first, self.last + 1):
            await self._epoch_gate(epoch)
            record = self.records[epoch]
            if record.train_start is None:
                record.train_start = time.monotonic()
            await self._pass(i, epoch, "train")
            record.train_end = max(record.train_end, time.monotonic())
            finish = self._finish(i, epoch, previous)
            if self.beside:
                previous = asyncio.ensure_future(finish)
                previous.add_done_callback(self._beside_done)
                self.beside_tasks.append(previous)
            else:
                await finish
        if previous is not None:
            await previous

    async def _finish(self, i: int, epoch: int, previous: asyncio.Future | None) -> None:
        """Interval ``i``'s evaluation of ``epoch`` (when due), then its part of the epoch's end;
        after ``previous`` (the epoch before's), so that evaluations use their buffers one at a
        time and epochs end in order."""
        if previous is not None:
            await previous
        if self.evaluates(epoch):
            await self._pass(i, epoch, "eval")
        self._interval_done(epoch)

    def _beside_done(self, task: asyncio.Future) -> None:
        if task.cancelled():
            return
        if task.exception() is not None and not self.failed.done():
            self.failed.set_exception(task.exception())
        with contextlib.suppress(ValueError):
            self.beside_tasks.remove(task)

    async def _epoch_gate(self, epoch: int) -> None:
        server = self.server
        while not self.mode.may_start(epoch, server.min_epoch):
            server.gate_changed.clear()
            await server.gate_changed.wait()

    # ------------------------------------------------------------------ one pass

    async def _pass(self, i: int, epoch: int, pass_: str) -> None:
        server, mode = self.server, self.mode
        stages = server.plan.train if pass_ == "train" else server.plan.evaluate
        await self._version_at_least(mode.oldest_weights(epoch, pass_))
        for k, stage in enumerate(stages):
            start = time.perf_counter()
            if stage.kind == GATHER or server.state.pulls(stage):
                await self._meet((pass_, epoch, k), lambda: self._scatter(server.scatter, stage, pass_, epoch))
                await server.gather(stage, pass_, epoch, i)
            elif stage.kind == GATHER_BACKWARD:
                await self._meet((pass_, epoch, k), lambda: self._scatter(server.gather_backward, stage, pass_, epoch))
            elif stage.kind == VERTEX:
                await server.vertex(stage, pass_, epoch, i)
            elif stage.kind == FUNCTION:
                await self._call(i, epoch, pass_, k, stage)
            else:
                raise ValueError(f"unknown stage kind {stage.kind!r}")
            self.records[epoch].task_s[stage.task.lower() + ("_eval" if pass_ == "eval" else "") + "_s"] += \
                time.perf_counter() - start
            if mode.barrier_after_stage():
                await self._meet((pass_, epoch, k, "end"), None)

    async def _scatter(self, exchange, stage: Stage, pass_: str, epoch: int) -> None:
        ages = await exchange(stage, pass_, epoch, self.mode.oldest_ghosts(epoch, pass_))
        self.records[epoch].staleness.extend(ages)

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
        call = describe(event)
        server.in_flight[call] = time.monotonic()
        try:
            meta = await server.backend.run(event, (epoch, PASSES.index(pass_), k, i))
        finally:
            del server.in_flight[call]
        record = self.records[epoch]
        if pass_ == "train" and "loss" in meta:
            record.sums["loss"] += meta["loss"]
        if pass_ == "eval":
            for split in ("train", "val", "test"):
                record.sums[f"correct_{split}"] += meta.get(f"correct_{split}", 0)
        record.weight_lag_max = max(record.weight_lag_max, int(meta.get("weight_lag", 0)))

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
            **{k: stats.get(k, 0)
               for k in ("invocations", "relaunches", "failed_calls", "fallback_calls", "throttled")},
            "failures": dict(stats.get("failures", {})),  # failed function attempts by kind
            **server.take_traffic(),
        }
        server.add_report(report)
        del self.records[epoch]
        self.oldest_unfinished = max(self.oldest_unfinished, epoch + 1)
        if self.autotuner is not None:  # the training pass alone: evaluation epochs are not slower steps
            new = self.autotuner.update(record.train_end - record.train_start, queued=stats.get("max_waiting", 0) > 0)
            if new is not None:
                server.backend.concurrency = new
