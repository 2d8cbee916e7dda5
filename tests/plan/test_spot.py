"""Spot pricing in ``dorylus plan``: hand-made predictions and the arithmetic of
dorylus/plan/planner.py's docstring, then the command's options and table."""

from __future__ import annotations

import json
import re

import pytest

from dorylus.cli import main
from dorylus.errors import ConfigError
from dorylus.plan import catalog
from dorylus.plan.model import Prediction, Setup, even_shape
from dorylus.plan.planner import SpotOptions, spot_estimate
from tests.plan.test_command import calibration_file  # noqa: F401  (the fixture)


def handmade(graph_server: str = "c5.2xlarge", parts: int = 4) -> Prediction:
    """A 10 s epoch on 4 graph servers: $0.010 of graph servers, $0.002 of parameter server,
    $0.005 of functions."""
    setup = Setup(backend="lambda", graph_server=graph_server, parts=parts, intervals=2, functions=2, hidden=16)
    components = {"functions": 0.005, "graph_servers": 0.010, "param_server": 0.002}
    return Prediction(setup=setup, shape=even_shape(1000, 8000, 16, 4, parts, 0.5), where="hand-made", epoch_s=10.0,
                      task_s={}, calls=8, billed_gb_s=1.0, cost_by_component_usd=components, cost_usd=0.017,
                      value=1 / (10.0 * 0.017))


def test_expected_interruption_cost_by_hand():
    # 4 instances x 0.09/h x 10 s = 0.001 interruptions per epoch; each loses 10 x 10 / 2 + 200 = 250 s.
    e = spot_estimate(handmade(), SpotOptions(interruptions_per_hour=0.09, checkpoint_every=10, recovery_s=200,
                                              saving=0.6))
    assert e.interruptions_per_epoch == pytest.approx(0.001)
    assert e.lost_s_per_interruption == pytest.approx(250)
    assert e.epoch_s == pytest.approx(10.25)
    assert e.cost_by_component_usd == pytest.approx({
        "functions": 0.005 * 1.005,            # half a checkpoint interval of epochs is called again
        "graph_servers": 0.010 * 0.4 * 1.025,  # 60% off, for the longer expected epoch
        "param_server": 0.002 * 1.025})        # on-demand
    assert e.cost_usd == pytest.approx(0.011175)
    assert e.value == pytest.approx(1 / (10.25 * 0.011175))
    assert e.value / e.on_demand_value == pytest.approx((10 * 0.017) / (10.25 * 0.011175))
    assert e.saving_source == "--spot-saving" and e.notes == []


def test_no_interruptions_is_the_discount_alone_and_the_family_gives_it():
    e = spot_estimate(handmade("c5n.2xlarge"), SpotOptions(interruptions_per_hour=0))
    saving = catalog.SPOT_DISCOUNTS["c5n"].saving
    assert e.saving == saving and e.epoch_s == 10.0 and e.interruptions_per_epoch == 0
    assert e.cost_usd == pytest.approx(0.005 + 0.010 * (1 - saving) + 0.002)
    assert e.saving_source.startswith("c5n: AWS EC2 Spot Instance Advisor") and "typical" in e.saving_source


def test_checkpointing_less_often_loses_more():
    costs = [spot_estimate(handmade(), SpotOptions(interruptions_per_hour=1, checkpoint_every=k, recovery_s=60,
                                                   saving=0.6)).cost_usd for k in (1, 10, 100)]
    assert costs[0] < costs[1] < costs[2]
    risky = spot_estimate(handmade(), SpotOptions(interruptions_per_hour=1, checkpoint_every=100, recovery_s=60,
                                                  saving=0.6))
    assert risky.notes and "checkpoint more often" in risky.notes[0]  # 4 x 1/h x 560 s = 0.62 > 0.1


def test_every_priced_family_has_a_discount_with_its_source():
    families = {name.split(".")[0] for name in catalog.INSTANCES}
    assert families <= set(catalog.SPOT_DISCOUNTS)
    for d in catalog.SPOT_DISCOUNTS.values():
        assert 0 < d.saving < 0.9 and "Spot Instance Advisor" in d.source and d.as_of
    with pytest.raises(ConfigError, match="no spot discount for instance family 'x9'"):
        catalog.spot_discount("x9.large")


@pytest.mark.parametrize("kwargs, message", [
    ({"interruptions_per_hour": -1}, "--spot-interruptions-per-hour must be from 0 to 60"),
    ({"interruptions_per_hour": float("nan")}, "--spot-interruptions-per-hour"),
    ({"checkpoint_every": 0}, "--checkpoint-every must be a whole number of epochs >= 1"),
    ({"recovery_s": -5}, "--recovery-s must be from 0"),
    ({"saving": 1.0}, "--spot-saving must be a fraction in"),
])
def test_spot_options_are_checked(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SpotOptions(**kwargs)


def test_the_spot_table(calibration_file, tmp_path, capsys):  # noqa: F811
    path = tmp_path / "plan.json"
    assert main(["plan", "--calibration", str(calibration_file), "--workload", "reddit", "--spot",
                 "--spot-interruptions-per-hour", "0.2", "--checkpoint-every", "5", "--recovery-s", "120",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0.2 interruptions per instance-hour, a checkpoint every 5 epochs, 120 s to recover" in out
    saved = json.loads(path.read_text())
    assert len(saved["spot"]) == len(saved["predictions"]) == 3
    for p, e in zip(saved["predictions"], saved["spot"]):
        instances = -(-p["setup"]["parts"] // p["setup"]["graph_servers_per_instance"])
        assert e["interruptions_per_epoch"] == pytest.approx(instances * 0.2 * p["epoch_s"] / 3600)
        assert e["lost_s_per_interruption"] == pytest.approx(5 * p["epoch_s"] / 2 + 120)
        family = p["setup"]["graph_server"].split(".")[0]
        assert e["saving"] == catalog.SPOT_DISCOUNTS[family].saving
        assert e["value"] == pytest.approx(1 / (e["epoch_s"] * e["cost_usd"]))
    assert "saving: c5n: AWS EC2 Spot Instance Advisor" in out and "saving: p3: " in out


@pytest.mark.parametrize("argv, message", [
    (["--recovery-s", "60"], "--recovery-s needs --spot"),
    (["--spot", "--spot-saving", "1.5"], "--spot-saving must be a fraction"),
    (["--spot", "--checkpoint-every", "0"], "--checkpoint-every must be a whole number"),
    (["--spot", "--spot-interruptions-per-hour", "inf"], "--spot-interruptions-per-hour must be from 0 to 60"),
])
def test_bad_spot_options_are_one_error_line(calibration_file, capsys, argv, message):  # noqa: F811
    assert main(["plan", "--calibration", str(calibration_file), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dorylus plan: error: ") and err.count("\n") == 1
    assert message in err, err
