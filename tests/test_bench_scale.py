"""benchmarks/bench_scale.py reads training and evaluation epochs apart from metrics.jsonl."""

from __future__ import annotations

import pytest

from tests.benchmarks import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_scale")


def record(epoch: int, seconds: float, evaluated: bool) -> dict:
    return {"epoch": epoch, "epoch_s": seconds, "test_acc": 0.5 if evaluated else None}


def test_epoch_times_leave_out_the_warm_up_and_the_evaluation(bench):
    epochs = [record(1, 9.0, False), record(2, 3.0, False), record(3, 4.0, False), record(4, 6.0, True)]
    assert bench.epoch_times(epochs) == {"epoch_s": 3.5, "eval_epoch_s": 6.0, "epoch_s_all": [9.0, 3.0, 4.0, 6.0]}


def test_epoch_times_of_short_runs(bench):
    # one epoch: it is all there is; every later epoch evaluated: no training figure
    assert bench.epoch_times([record(1, 2.0, True)]) == {"epoch_s": None, "eval_epoch_s": 2.0, "epoch_s_all": [2.0]}
    assert bench.epoch_times([record(1, 2.0, False)])["epoch_s"] == 2.0
    assert bench.epoch_times([record(1, 9.0, True), record(2, 5.0, True)])["epoch_s"] is None
    assert bench.epoch_times([{"epoch": 1, "status": "preempted"}, record(2, 9.0, False),
                              record(3, 3.0, False)])["epoch_s"] == 3.0
