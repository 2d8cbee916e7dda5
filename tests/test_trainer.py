"""DistributedTrainer over a stand-in cluster: what ``step`` makes of the graph servers' reports,
without processes or sockets."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dorylus.config import TrainConfig
from dorylus.coordinator.trainer import DistributedTrainer
from dorylus.protocol import Header, Op


def report(epoch: int, epoch_s: float, loss: float = 1.0) -> dict:
    return {"epoch": epoch, "loss": loss, "evaluated": False, "task_s": {"ga_s": epoch_s / 2}, "epoch_s": epoch_s,
            "staleness_max": 0, "staleness_sum": 0, "staleness_reads": 0, "weight_lag_max": 0, "concurrency": 2,
            "invocations": 4, "relaunches": 0, "failed_calls": 0, "fallback_calls": 0, "failures": {},
            "bytes_functions": 0, "bytes_ghosts": 10, "bytes_params": 20}


class StandInCluster:
    """Two graph servers whose finished epochs (``pending``: part -> reports) are handed out by
    ``progress``; the coordinator's other requests are acknowledged."""

    def __init__(self):
        self.store = SimpleNamespace(num_parts=2, meta=SimpleNamespace(num_features=8, num_classes=3, train_count=10,
                                                                       val_count=5, test_count=5))
        self.servers = [object(), object()]
        self.intervals = 2
        self.pending: dict[int, list[dict]] = {0: [], 1: []}
        self.watchdog = SimpleNamespace(bound=lambda step: (60.0, "test"), record=lambda step, s: None)

    def ps_request(self, header, tensors=()):
        return Header(header.op), []

    def command(self, name, **meta):
        assert name == "train"

    def command_replies(self, name, *, each=(), **meta):
        assert name == "progress"
        replies = [Header(Op.ACK, meta={"more": False}, doc=self.pending[p]) for p in (0, 1)]
        self.pending = {0: [], 1: []}
        return replies

    def epoch_begins(self, epoch):
        pass

    def check(self, what, elapsed, bound, why):
        assert elapsed < bound

    def emulator_stats(self):
        return {}


@pytest.fixture
def trainer():
    cluster = StandInCluster()
    return cluster, DistributedTrainer(TrainConfig(dataset="cora", backend="cpu", parts=2), cluster)


def test_epoch_seconds_are_the_slowest_servers_not_when_the_coordinator_looked(trainer):
    """A coordinator that looks late (a checkpoint's write, a pause) sees several epochs at once:
    each still gets the seconds its graph servers took, and the epoch's dollars follow them."""
    cluster, trainer = trainer
    cluster.pending = {0: [report(1, 0.20), report(2, 0.25)], 1: [report(1, 0.30), report(2, 0.10)]}
    time.sleep(0.5)  # the coordinator was busy: epoch 1 looks 0.5 s long to it, epoch 2 0 s
    first, second = trainer.step(1), trainer.step(2)
    assert first["epoch_s"] == pytest.approx(0.30)
    assert second["epoch_s"] == pytest.approx(0.25)
    assert first["cost_usd"] / second["cost_usd"] == pytest.approx(0.30 / 0.25)
    assert first["loss"] == pytest.approx(2.0) and first["calls"] == 8
    assert first["bytes"] == {"functions": 0, "ghosts": 20, "params": 40}


def test_failure_counts_are_summed_over_the_graph_servers(trainer):
    cluster, trainer = trainer
    reports = [report(1, 0.2), report(1, 0.3)]
    for r, (relaunches, throttled, fallbacks, raised) in zip(reports, [(1, 3, 0, 2), (2, 4, 1, 0)]):
        r.update(relaunches=relaunches, throttled=throttled, fallback_calls=fallbacks, failures={"raise": raised})
    cluster.pending = {0: [reports[0]], 1: [reports[1]]}
    metrics = trainer.step(1)
    assert (metrics["relaunches"], metrics["throttled"], metrics["fallback_calls"]) == (3, 7, 1)
    assert metrics["failures"] == {"raise": 2}
