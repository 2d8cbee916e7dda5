"""The scheduler's rules, driven in-process: a fake backend and stand-in graph servers that share
one fake parameter server and one fake coordinator, all on one event loop (no processes, no
sockets). A fake call only sleeps (the delay its partition and interval are given) and logs its
start and end; the log's order is what the tests read, so loaded machines slow them but do not
change what they see.

The rules (graphserver/modes, DESIGN §3): sync finishes every stage on every interval before any
interval starts the next; pipe lets an interval run ahead to its next stage; a forward pass of
epoch e computes with weight version e-1-S or newer, a Scatter takes peer rows of epoch e-S or
newer, and under async an interval starts epoch e only when e <= min_epoch + S.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from dorylus.models.base import FUNCTION, GATHER, GATHER_BACKWARD, PIN, STASH, Plan, Stage
from graphserver.backends import Backend, call_key
from graphserver.backends.serverless import LambdaBackend
from graphserver.invoker import TaskFailed
from graphserver.modes import calls_at_once, get_mode
from graphserver.scheduler import Scheduler

TIMEOUT_S = 30.0  # a broken rule may deadlock a run; every run is bounded

# Two layers, the first product before the Gather (as GIN's plan): every kind of meeting point.
PLAN = Plan.of(
    forward=[Stage(FUNCTION, "AV", 0, ("X",), ("Z",), weights=PIN),
             Stage(GATHER, "GA", 1, ("Z",), ("AH",)),
             Stage(FUNCTION, "LOSS", 1, ("AH",), ("dZ",), weights=PIN)],
    backward=[Stage(FUNCTION, "AV_BWD", 1, ("dZ",), ("dAH",), weights=STASH, grad=True),
              Stage(GATHER_BACKWARD, "GA_BWD", 1, ("dAH",), ("dH",)),
              Stage(FUNCTION, "AV_BWD", 0, ("dH",), (), weights=STASH, grad=True)],
    widths={})
GRAD_STAGES = sum(s.grad for s in PLAN.train)
LOSS_PER_CALL = 0.25


class FakeBackend(Backend):
    """Calls that sleep ``delay(part, interval)`` seconds; gradients count towards the fake
    parameter server's next version."""

    def __init__(self, cluster: FakeCluster, part: int):
        self.cluster, self.part = cluster, part
        self._concurrency = 1
        self.calls = 0

    async def execute(self, event: dict[str, Any], priority: tuple) -> dict[str, Any]:
        cluster = self.cluster
        self.calls += 1
        version = cluster.version
        cluster.log.append(("start", self.part, event["interval"], event["epoch"], event["pass"], event["task"],
                            event["layer"], version if event["weights"] else None))
        await asyncio.sleep(cluster.delay(self.part, event["interval"]))
        if (event["pass"], event["epoch"]) == cluster.fail_on:
            raise TaskFailed(f"{event['task']} of {event['pass']} epoch {event['epoch']} failed (the test's)")
        cluster.log.append(("end", self.part, event["interval"], event["epoch"], event["pass"], event["task"],
                            event["layer"]))
        if event["grad"]:
            cluster.gradient(event["epoch"])
        meta = {"version": version, "weight_lag": cluster.version - version}
        if event["task"] == "LOSS" and event["pass"] == "train":
            meta["loss"] = LOSS_PER_CALL
        return meta

    @property
    def concurrency(self) -> int:
        return self._concurrency

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        self._concurrency = value

    def take_stats(self) -> dict[str, Any]:
        stats, self.calls = {"invocations": self.calls}, 0
        return stats

    async def close(self) -> None:
        pass


class Reports(list):
    """A graph server's report queue; the fake coordinator hears of each epoch at once."""

    def __init__(self, cluster: FakeCluster, part: int):
        super().__init__()
        self.cluster, self.part = cluster, part

    def append(self, report: dict[str, Any]) -> None:
        super().append(report)
        self.cluster.finished(self.part, report["epoch"])


class FakeServer:
    """What the scheduler uses of a graph server (graphserver/scheduler.py's module doc)."""

    def __init__(self, cluster: FakeCluster, part: int, mode, intervals: int):
        self.cluster, self.part_id = cluster, part
        self.plan, self.mode = PLAN, mode
        self.config = SimpleNamespace(functions=intervals)
        self.state = SimpleNamespace(intervals=[(i, i + 1) for i in range(intervals)], pulls=lambda stage: False)
        self.backend = FakeBackend(cluster, part)
        self.min_epoch = 0
        self.gate_changed = asyncio.Event()
        self.in_flight: dict[str, float] = {}
        self.reports = Reports(cluster, part)

    def event(self, stage: Stage, pass_: str, epoch: int, interval: int) -> dict[str, Any]:
        return {"task": stage.task, "layer": stage.layer, "epoch": epoch, "interval": interval, "pass": pass_,
                "part": self.part_id, "weights": stage.weights, "grad": stage.grad and pass_ == "train"}

    async def gather(self, stage, pass_, epoch, interval) -> None:
        self.cluster.log.append(("gather", self.part_id, interval, epoch, pass_, stage.task, stage.layer))
        await asyncio.sleep(0)

    async def vertex(self, stage, pass_, epoch, interval) -> None:
        raise AssertionError("the test plan has no VERTEX stage")

    async def scatter(self, stage, pass_, epoch, oldest) -> list[int]:
        return await self.cluster.exchange(self.part_id, ("SC", pass_, stage.layer), epoch, oldest)

    async def gather_backward(self, stage, pass_, epoch, oldest) -> list[int]:
        return await self.cluster.exchange(self.part_id, ("SC_BWD", pass_, stage.layer), epoch, oldest)

    async def wait_version(self, version: int) -> int:
        return await self.cluster.wait_version(version)

    def add_report(self, report: dict[str, Any]) -> None:
        self.reports.append(report)

    def take_traffic(self) -> dict[str, int]:
        return {}


class FakeCluster:
    """``parts`` stand-in graph servers, the fake parameter server (version v exists once every
    gradient of epoch v and of every epoch before it arrived) and the fake coordinator
    (``min_epoch``: the oldest epoch not finished everywhere, published to every server at once
    unless ``hold_min_epoch``)."""

    def __init__(self, mode: str, staleness: int = 0, *, parts: int, intervals: int, epochs: int,
                 delays: dict[tuple[int, int], float] | None = None, eval_every: int = 1):
        self.mode = get_mode(mode, staleness)
        self.parts, self.intervals, self.epochs, self.eval_every = parts, intervals, epochs, eval_every
        self.delays = delays or {}
        self.fail_on: tuple[str, int] | None = None  # (pass, epoch) whose calls fail
        self.log: list[tuple] = []
        self.version = 0  # the initial weights
        self.grads: dict[int, int] = {}
        self.changed = asyncio.Event()  # versions, ghost rows
        self.done = {p: 0 for p in range(parts)}  # newest epoch each part finished
        self.hold_min_epoch = False
        self.ghosts: dict[tuple, dict[int, int]] = {}  # (task, pass, layer) -> part -> epoch of its newest rows
        self.servers = [FakeServer(self, p, self.mode, intervals) for p in range(parts)]
        self.schedulers = [Scheduler(s, first=1, last=epochs, epochs=epochs, eval_every=eval_every)
                           for s in self.servers]

    def delay(self, part: int, interval: int) -> float:
        return self.delays.get((part, interval), self.delays.get((part, None), 0.0))

    # the parameter server
    def gradient(self, epoch: int) -> None:
        self.grads[epoch] = self.grads.get(epoch, 0) + 1
        while self.grads.get(self.version + 1, 0) == self.parts * self.intervals * GRAD_STAGES:
            self.version += 1
        self.changed.set()

    async def wait_version(self, version: int) -> int:
        while self.version < version:
            self.changed.clear()
            await self.changed.wait()
        return self.version

    # the peers' ghost rows
    async def exchange(self, part: int, key: tuple, epoch: int, oldest: int) -> list[int]:
        rows = self.ghosts.setdefault(key, {})
        rows[part] = max(rows.get(part, 0), epoch)
        self.changed.set()
        peers = [j for j in range(self.parts) if j != part]
        while any(j not in rows or rows[j] < oldest for j in peers):  # some rows of each peer, however old
            self.changed.clear()
            await self.changed.wait()
        ages = [max(0, epoch - rows[j]) for j in peers]
        self.log.append(("scatter", part, None, epoch, key, ages))
        return ages

    # the coordinator
    def finished(self, part: int, epoch: int) -> None:
        self.done[part] = epoch
        self.log.append(("done", part, None, epoch))
        if not self.hold_min_epoch:
            self.publish(min(self.done.values()) + 1)

    def publish(self, min_epoch: int) -> None:
        for server in self.servers:
            if min_epoch > server.min_epoch:
                server.min_epoch = min_epoch
                server.gate_changed.set()

    async def run(self) -> None:
        self.publish(1)
        await asyncio.wait_for(asyncio.gather(*(s.run() for s in self.schedulers)), TIMEOUT_S)

    # what the log says
    def calls(self) -> list[tuple[int, tuple]]:
        """(log index, entry) of every call start and end."""
        return [(n, e) for n, e in enumerate(self.log) if e[0] in ("start", "end")]

    def epoch_starts(self) -> list[tuple[int, int, int, int]]:
        """(log index, part, interval, epoch) of each interval's first call of each epoch."""
        seen, starts = set(), []
        for n, e in enumerate(self.log):
            if e[0] == "start" and (e[1], e[2], e[3]) not in seen:
                seen.add((e[1], e[2], e[3]))
                starts.append((n, e[1], e[2], e[3]))
        return starts

    def finished_everywhere_before(self, index: int) -> int:
        """The newest epoch every part had finished before log entry ``index``."""
        done = {p: 0 for p in range(self.parts)}
        for e in self.log[:index]:
            if e[0] == "done":
                done[e[1]] = e[3]
        return min(done.values())


def run(*args, hold_min_epoch: bool = False, **kwargs) -> FakeCluster:
    """A cluster built (on the loop that runs it) and run to its last epoch."""
    async def main():
        cluster = FakeCluster(*args, **kwargs)
        cluster.hold_min_epoch = hold_min_epoch
        await cluster.run()
        return cluster

    return asyncio.run(main())


def function_stage_pairs(cluster: FakeCluster) -> list[tuple[int, int, int]]:
    """For each pass of each epoch and each two consecutive FUNCTION stages k, k+1 of a part:
    (log index of the last end of stage k, log index of the first start of stage k+1, part)."""
    tasks = {"train": [(s.task, s.layer) for s in PLAN.train], "eval": [(s.task, s.layer) for s in PLAN.evaluate]}
    kinds = {"train": [s.kind for s in PLAN.train], "eval": [s.kind for s in PLAN.evaluate]}
    last_end, first_start = {}, {}
    for n, e in cluster.calls():
        part, epoch, pass_, key = e[1], e[3], e[4], (e[5], e[6])
        k = tasks[pass_].index(key)
        if e[0] == "end":
            last_end[(part, epoch, pass_, k)] = n
        else:
            first_start.setdefault((part, epoch, pass_, k), n)
    pairs = []
    for (part, epoch, pass_, k), end in last_end.items():
        nxt = (part, epoch, pass_, k + 1)
        if nxt in first_start and kinds[pass_][k] == kinds[pass_][k + 1] == FUNCTION:
            pairs.append((end, first_start[nxt], part))
    return pairs


# ----------------------------------------------------------------------------- sync and pipe

SLOW_INTERVAL = {(0, 0): 0.03, (1, 0): 0.03}  # interval 0 of every part is slow


def test_sync_finishes_every_stage_on_every_interval_before_any_starts_the_next():
    cluster = run("sync", parts=2, intervals=3, epochs=3, delays=SLOW_INTERVAL)
    pairs = function_stage_pairs(cluster)
    assert len(pairs) == 2 * 3  # parts x epochs: AV_BWD right after LOSS in the training pass
    assert all(end < start for end, start, _ in pairs), "an interval started a stage before all finished the last"


def test_pipe_lets_intervals_run_ahead_to_their_next_stage():
    cluster = run("pipe", parts=2, intervals=3, epochs=3, delays=SLOW_INTERVAL)
    pairs = function_stage_pairs(cluster)
    # the fast intervals start AV_BWD while the slow one is still in LOSS: on every part, every epoch
    assert sum(start < end for end, start, _ in pairs) == 2 * 3


@pytest.mark.parametrize("mode", ["sync", "pipe"])
def test_exact_modes_read_this_epochs_rows_and_the_previous_epochs_weights(mode):
    cluster = run(mode, parts=3, intervals=2, epochs=4, delays={(2, None): 0.02})
    for e in cluster.log:
        if e[0] == "scatter":
            assert e[5] == [0, 0], e
        if e[0] == "start" and e[7] is not None:
            epoch, pass_ = e[3], e[4]
            # forward of e: version e-1 exactly (version e needs this interval's backward of e);
            # evaluation of e: version e (e+1 needs this interval's backward of e+1)
            assert e[7] == (epoch - 1 if pass_ == "train" else epoch), e
    assert all(d == 4 for d in cluster.done.values())


@pytest.mark.parametrize("mode", ["sync", "pipe", "async"])
def test_every_epoch_is_reported_once_in_order_with_its_results(mode):
    cluster = run(mode, 1 if mode == "async" else 0, parts=2, intervals=3, epochs=4, eval_every=2,
                              delays={(1, 2): 0.01})
    for server in cluster.servers:
        assert [r["epoch"] for r in server.reports] == [1, 2, 3, 4]
        assert [r["evaluated"] for r in server.reports] == [False, True, False, True]
        # the results the backend's futures carried: one LOSS call per interval and epoch
        assert all(r["loss"] == pytest.approx(3 * LOSS_PER_CALL) for r in server.reports)
        # every call counted once (in the report of the epoch during which it ran): 4 per interval
        # in a training pass, 2 in an evaluation pass
        assert sum(r["invocations"] for r in server.reports) == 3 * (4 * 4 + 2 * 2)
        assert not server.in_flight


# ----------------------------------------------------------------------------- the epoch gate


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_starts_no_epoch_past_min_epoch_plus_s(staleness):
    """The coordinator holds min_epoch at 1: the server runs epochs 1..1+S and waits at the gate;
    published again, the gate opens."""
    async def main():
        cluster = FakeCluster("async", staleness, parts=1, intervals=2, epochs=6)
        cluster.hold_min_epoch = True
        cluster.publish(1)
        running = asyncio.ensure_future(asyncio.gather(*(s.run() for s in cluster.schedulers)))
        try:
            while cluster.done[0] < 1 + staleness:  # bounded by the wait_for below
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)  # would an interval start one more epoch?
            assert max(e for *_, e in cluster.epoch_starts()) == 1 + staleness
            assert cluster.done[0] == 1 + staleness
            cluster.hold_min_epoch = False
            cluster.publish(cluster.done[0] + 1)
            await running
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        return cluster

    cluster = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert cluster.done[0] == 6


@pytest.mark.parametrize("mode", ["sync", "pipe"])
def test_exact_modes_do_not_wait_for_the_coordinator(mode):
    # min_epoch stays 1: sync and pipe are held back by the weights only
    cluster = run(mode, parts=1, intervals=2, epochs=4, hold_min_epoch=True)
    assert cluster.done[0] == 4


# ----------------------------------------------------------------------------- async staleness


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_staleness_bound_with_a_slow_partition(staleness):
    """Part 2 is slow. No interval starts epoch e+S+1 before every part finished epoch e, and with
    S >= 1 the fast parts do run ahead, by one epoch at most: training waits for the previous
    epoch's step (every part's gradients), so only evaluation trails behind. Rows are at most S
    epochs old; weights are never stale in training."""
    epochs = 7
    cluster = run("async", staleness, parts=3, intervals=2, epochs=epochs, delays={(2, None): 0.015})
    leads = []
    for n, part, interval, epoch in cluster.epoch_starts():
        leads.append(epoch - 1 - cluster.finished_everywhere_before(n))
    assert max(leads) == min(staleness, 1), leads
    ages = [age for e in cluster.log if e[0] == "scatter" for age in e[5]]
    assert max(ages) <= staleness
    # evaluation is exact: its rows are of its own epoch
    assert {age for e in cluster.log if e[0] == "scatter" and e[4][1] == "eval" for age in e[5]} == {0}
    if staleness:
        assert max(ages) > 0  # the fast parts did read rows of an older epoch
    for e in cluster.log:
        if e[0] == "start" and e[7] is not None:
            epoch, pass_ = e[3], e[4]
            assert e[7] >= (epoch - 1 if pass_ == "train" else epoch), e
    assert all(d == epochs for d in cluster.done.values())


def test_async_evaluates_epoch_e_beside_training_e_plus_1():
    """With S = 1 an interval's evaluation of epoch e overlaps its training of e + 1 (the gate
    lets e + 1 start once e - 1 finished); sync never overlaps them."""
    def overlaps(cluster: FakeCluster) -> int:
        eval_end, train_start = {}, {}
        for n, e in cluster.calls():
            key = (e[1], e[2], e[3])  # part, interval, epoch
            if e[0] == "end" and e[4] == "eval":
                eval_end[key] = n
            elif e[0] == "start" and e[4] == "train":
                train_start.setdefault(key, n)
        return sum(train_start[(p, i, e + 1)] < end for (p, i, e), end in eval_end.items()
                   if (p, i, e + 1) in train_start)

    assert overlaps(run("async", 1, parts=2, intervals=2, epochs=5, delays={(0, None): 0.005})) > 0
    assert overlaps(run("sync", parts=2, intervals=2, epochs=5, delays={(0, None): 0.005})) == 0


def test_a_failed_evaluation_beside_training_stops_the_run():
    async def main():
        cluster = FakeCluster("async", 1, parts=2, intervals=2, epochs=6)
        cluster.fail_on = ("eval", 2)
        await cluster.run()

    with pytest.raises(TaskFailed, match="of eval epoch 2 failed"):
        asyncio.run(main())


# ----------------------------------------------------------------------------- a call's result


def _lambda_backend():
    config = SimpleNamespace(task_timeout_s=5, relaunch_min_s=5.0, relaunch_ratio=3.0, fallback_after=1)
    # no server: no fallback; the invoker never connects (its invoke is replaced below)
    return LambdaBackend(config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f")


EVENT = {"task": "AV", "layer": 0, "epoch": 3, "interval": 1, "pass": "train", "part": 0, "writes": ["P0"]}


def _call(backend, event):
    """``backend.run(event)``'s result, the backend closed after it."""
    async def main():
        try:
            return await backend.run(event, ())
        finally:
            await backend.close()

    return asyncio.run(main())


def test_a_lambda_call_resolves_with_the_result_its_function_pushed():
    backend = _lambda_backend()

    async def invoke(event, priority=()):
        pending = backend.awaiting(call_key(event))
        pending.set_result({"loss": 1.5})  # what GraphServer does with the first PUSH
        assert backend.awaiting(call_key(event)) is None  # a second push is a duplicate
        return {}

    backend.invoker.invoke = invoke
    assert _call(backend, EVENT) == {"loss": 1.5}
    assert backend.awaiting(call_key(EVENT)) is None  # nothing awaits after the call


def test_a_lambda_call_whose_function_did_not_push_fails():
    backend = _lambda_backend()

    async def invoke(event, priority=()):
        return {}

    backend.invoker.invoke = invoke
    with pytest.raises(TaskFailed, match="AV interval 1 epoch 3 layer 0 .*returned without pushing"):
        _call(backend, EVENT)


def test_a_lambda_call_that_writes_no_rows_resolves_with_its_answer():
    """Layer 0's backward writes no rows: its function pushes nothing to the graph server, and
    the call's result is the ``result`` of the invoke's answer (lambdas/handler.py's summary)."""
    backend = _lambda_backend()
    event = {**EVENT, "task": "AV_BWD", "writes": []}

    async def invoke(event, priority=()):
        return {"task": "AV_BWD", "interval": 1, "epoch": 3, "layer": 0, "result": {"version": 2, "weight_lag": 1}}

    backend.invoker.invoke = invoke
    assert _call(backend, event) == {"version": 2, "weight_lag": 1}
    assert backend.awaiting(call_key(event)) is None


def test_a_push_for_no_call_in_progress_is_a_duplicate():
    assert _lambda_backend().awaiting(("train", "AV", 0, 3, 1)) is None


# ----------------------------------------------------------------------------- the backend registry


def test_every_registered_backend_implements_backend_and_train_offers_them_all():
    import dataclasses
    import inspect

    from dorylus.config import TrainConfig
    from graphserver.backends import BACKENDS, RunBackend, backend_class

    for name in BACKENDS:
        cls = backend_class(name)
        assert issubclass(cls, RunBackend), name
        if cls.graph_servers:  # reference trains in the coordinator: no graph server executes its stages
            assert issubclass(cls, Backend) and not inspect.isabstract(cls), name
    choices = next(f for f in dataclasses.fields(TrainConfig) if f.name == "backend").metadata["choices"]
    assert set(choices) == set(BACKENDS)
    with pytest.raises(ValueError, match="unknown backend 'bogus'; known: lambda, cpu, gpu, reference"):
        backend_class("bogus")


# ----------------------------------------------------------------------------- calls in flight

@pytest.mark.parametrize("mode,staleness,most", [("sync", 0, 3), ("pipe", 0, 3), ("async", 0, 3), ("async", 1, 6),
                                                 ("async", 2, 6)])
def test_calls_at_once_doubles_where_evaluation_runs_beside_training(mode, staleness, most):
    m = get_mode(mode, staleness)
    assert calls_at_once(m, 3) == most
    assert calls_at_once(m, 3, functions=2) == 2
    assert calls_at_once(m, 3, functions=100) == most  # --functions is capped


@pytest.mark.parametrize("functions", [None, 1, 3])
@pytest.mark.parametrize("mode,staleness", [("sync", 0), ("async", 0), ("async", 1)])
def test_the_scheduler_runs_no_more_calls_than_calls_at_once(mode, staleness, functions):
    """The autotuner's top and a fixed --functions are calls_at_once's, which a local emulator
    is sized by: a scheduler allowed more than that would be answered 429."""
    async def main():
        cluster = FakeCluster(mode, staleness, parts=1, intervals=2, epochs=1)
        server = cluster.servers[0]
        server.config = SimpleNamespace(functions=functions)
        scheduler = Scheduler(server, first=1, last=1, epochs=1, eval_every=1)
        return scheduler, server.backend.concurrency

    scheduler, concurrency = asyncio.run(main())
    most = calls_at_once(get_mode(mode, staleness), 2, functions)
    if functions is None:
        assert scheduler.autotuner.high == most and concurrency <= most
    else:
        assert scheduler.autotuner is None and concurrency == most


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_local_emulator_has_a_worker_for_every_call_the_scheduler_may_run(staleness):
    from dorylus.config import TrainConfig
    from graphserver.backends.serverless import emulator_workers

    config = TrainConfig(mode="async", staleness=staleness, intervals=2)
    assert emulator_workers(config, 2) >= 2 * (calls_at_once(get_mode("async", staleness), 2) + 1)
