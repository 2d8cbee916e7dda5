"""Value on every run: the pricing of a run's components, the per-epoch cost fields, and what a
run records in metrics.jsonl and summary.json."""

from __future__ import annotations

import io
import json

import pytest

from dorylus.config import TrainConfig
from dorylus.cost import (
    COMPONENTS, DEFAULT_PRICES, Pricing, epoch_metrics, lambda_cost_usd, value,
)
from dorylus.errors import ConfigError
from dorylus.runs import EpochProgress, read_metrics
from dorylus.coordinator.training import run_training
from tests.graphs import random_graph


def test_gpu_and_2025_prices_are_in_the_table():
    hourly = DEFAULT_PRICES.ec2_hour_usd
    assert "2025" in DEFAULT_PRICES.as_of
    for instance in ("p3.2xlarge", "g5.xlarge", "p4d.24xlarge", "p5.48xlarge", "c5n.2xlarge"):
        assert hourly[instance] > 0
    # An 8-GPU machine costs more than a one-GPU one, and a GPU machine more than a CPU one.
    assert hourly["p5.48xlarge"] > hourly["p4d.24xlarge"] > hourly["p3.2xlarge"] > hourly["c5.2xlarge"]


def test_epoch_cost_is_hours_times_price_by_component():
    pricing = Pricing(graph_server_instance="c5.2xlarge", graph_servers=4, param_server_instance="c5.xlarge",
                      param_servers=1, lambda_memory_mb=2048)
    parts = pricing.epoch_cost(seconds=1800.0, billed_gb_s=1000.0, requests=500_000)
    assert set(parts) == set(COMPONENTS)
    assert parts["graph_servers"] == pytest.approx(4 * 0.5 * 0.34)
    assert parts["param_server"] == pytest.approx(0.5 * 0.17)
    assert parts["functions"] == pytest.approx(1000 * 0.0000166667 + 500_000 * 0.20 / 1e6)


def test_epoch_metrics_value_is_inverse_of_seconds_times_dollars():
    pricing = Pricing(graph_server_instance="c5.xlarge", graph_servers=1, param_server_instance="c5.xlarge",
                      param_servers=1, lambda_memory_mb=None)
    m = epoch_metrics(pricing, seconds=36.0)
    assert m["cost_usd"] == pytest.approx(2 * 36 / 3600 * 0.17)
    assert m["cost_usd"] == pytest.approx(sum(m["cost_by_component_usd"].values()))
    assert m["cost_by_component_usd"]["functions"] == 0
    assert m["value"] == pytest.approx(1 / (36.0 * m["cost_usd"]))
    assert m["value"] == pytest.approx(value(36.0, m["cost_usd"]))
    # Twice as long costs twice as much: a quarter of the value.
    assert epoch_metrics(pricing, seconds=72.0)["value"] == pytest.approx(m["value"] / 4)


def test_pricing_of_a_run_follows_its_backend():
    lam = Pricing.of_run(TrainConfig(backend="lambda", lambda_memory_mb=512), parts=3)
    assert (lam.graph_servers, lam.param_servers, lam.lambda_memory_mb) == (3, 1, 512)
    cpu = Pricing.of_run(TrainConfig(backend="cpu"), parts=2)
    assert cpu.lambda_memory_mb is None and cpu.to_dict()["functions"] is None
    reference = Pricing.of_run(TrainConfig(backend="reference"), parts=None)
    assert (reference.graph_servers, reference.param_servers) == (1, 0)
    record = lam.to_dict()
    assert record["graph_server"] == {"instance": "c5.2xlarge", "count": 3, "usd_per_hour": 0.34}
    assert record["param_server"] == {"instance": "c5.xlarge", "count": 1, "usd_per_hour": 0.17}
    assert record["functions"]["usd_per_gb_s"] == DEFAULT_PRICES.lambda_gb_s_usd["x86_64"]
    assert record["region"] == "us-east-1" and record["as_of"] and record["source"]
    with pytest.raises(ConfigError, match="unknown instance type 'z9.huge'"):
        Pricing(graph_server_instance="z9.huge", graph_servers=1, param_server_instance="c5.xlarge",
                param_servers=1, lambda_memory_mb=None)


def test_graph_server_instance_defaults_to_the_backends_machine():
    assert TrainConfig(backend="cpu").graph_server_instance == "c5.2xlarge"
    assert TrainConfig(backend="lambda").graph_server_instance == "c5.2xlarge"
    assert TrainConfig(backend="gpu", device="cpu").graph_server_instance == "p3.2xlarge"
    assert TrainConfig(backend="reference").graph_server_instance == "c5.2xlarge"
    assert TrainConfig(backend="cpu", graph_server_instance="c5n.4xlarge").graph_server_instance == "c5n.4xlarge"
    with pytest.raises(ConfigError, match="graph_server_instance='m9.huge' is not in the price table"):
        TrainConfig(graph_server_instance="m9.huge")


def test_progress_line_shows_seconds_and_dollars_per_epoch():
    out = io.StringIO()
    EpochProgress(3, out).update({"epoch": 1, "loss": 1.0, "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5,
                                  "epoch_s": 0.25, "cost_usd": 1.5e-05})
    assert "s/epoch 0.250" in out.getvalue() and "$/epoch 1.50e-05" in out.getvalue()


def _check_run(run_dir, summary, expected_components):
    history = read_metrics(run_dir)
    for m in history:
        assert set(m["cost_by_component_usd"]) == set(COMPONENTS)
        assert m["cost_usd"] == pytest.approx(sum(m["cost_by_component_usd"].values()))
        assert m["value"] == pytest.approx(1 / (m["epoch_s"] * m["cost_usd"]))
        for component in COMPONENTS:
            assert (m["cost_by_component_usd"][component] > 0) == (component in expected_components)
    epochs = len(history)
    assert summary["epoch_s"] == pytest.approx(sum(m["epoch_s"] for m in history) / epochs)
    assert summary["cost_usd"] == pytest.approx(sum(m["cost_usd"] for m in history) / epochs)
    assert summary["total_cost_usd"] == pytest.approx(summary["cost_usd"] * epochs)
    assert summary["value"] == pytest.approx(1 / (summary["epoch_s"] * summary["cost_usd"]))
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["pricing"] == summary["pricing"] and saved["value"] == pytest.approx(summary["value"])


def test_reference_run_records_cost_and_value(tmp_path):
    config = TrainConfig(backend="reference", epochs=3, hidden=4, run_dir=str(tmp_path / "run"))
    summary = run_training(config, random_graph(num_nodes=40, num_edges=120), progress=io.StringIO())
    _check_run(tmp_path / "run", summary, {"graph_servers"})
    assert summary["pricing"]["graph_server"]["count"] == 1 and summary["pricing"]["param_server"]["count"] == 0


def test_lambda_run_records_cost_by_component(tmp_path):
    config = TrainConfig(backend="lambda", parts=2, epochs=2, hidden=4, run_dir=str(tmp_path / "run"))
    summary = run_training(config, random_graph(num_nodes=60, num_edges=200), progress=io.StringIO())
    _check_run(tmp_path / "run", summary, set(COMPONENTS))
    pricing = summary["pricing"]
    assert pricing["graph_server"] == {"instance": "c5.2xlarge", "count": 2, "usd_per_hour": 0.34}
    assert pricing["functions"]["memory_mb"] == 1024
    for m in read_metrics(tmp_path / "run"):
        assert m["cost_by_component_usd"]["functions"] == pytest.approx(lambda_cost_usd(m["billed_gb_s"],
                                                                                        m["invocations"]))
