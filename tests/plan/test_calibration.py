"""Calibration: measurements return sane figures, files round-trip, bad files name themselves,
and the runtime's costs are solved from measured runs as documented."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from dorylus.errors import ConfigError
from dorylus.plan import calibration as cal_module
from dorylus.plan import runtime
from dorylus.plan.calibration import Calibration
from tests.plan.handmade import RATES

CAL = Calibration(host="test", cores=2, measured_at="2025-01-01T00:00:00", cpu=RATES, loopback_bytes_per_s=2e9,
                  round_trip_s=5e-5, invoke_s=1e-3, stage_s=0.002, call_s=0.01)


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    CAL.save(path)
    assert Calibration.load(path) == CAL
    with_gpu = dataclasses.replace(CAL, gpu=RATES, gpu_name="NVIDIA H100 80GB HBM3")
    with_gpu.save(path)
    assert Calibration.load(path) == with_gpu


@pytest.mark.parametrize("content, message", [
    ("{", "is not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"format": 99}', "format must be 2"),
    (None, "round_trip_s must be a positive number"),
    (None, "cpu: .*unexpected keyword"),
    (None, "gather must be"),
])
def test_bad_calibration_file_names_itself(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is None:
        values = CAL.to_dict()
        if "round_trip" in message:
            values["round_trip_s"] = -1
        elif "keyword" in message:
            values["cpu"]["flops"] = 1
        else:
            values["cpu"]["gather"] = [[2, 1], [1, 1]]
        content = json.dumps(values)
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"calibration file .*bad.json.*{message}"):
        Calibration.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Calibration.load(tmp_path / "missing.json")


def test_the_device_matmul_rate_turns_tf32_off(monkeypatch):
    """The GPU branch of matmul_rate, on torch's CPU device with a no-op synchronize: TF32 goes
    off through the fp32_precision API (as gpu_device.set_tf32 does), and a rate comes back."""
    import torch

    saved = torch.backends.cuda.matmul.fp32_precision
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cal_module, "MATMUL_SHAPES", ((2_000, 32, 16),))
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert cal_module.matmul_rate(device="cpu:0") > 1e6
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def test_kernel_rates_are_measured_on_this_machine():
    curve = cal_module.gather_curve(rows=2_000, nnz=50_000, operand_mb=(0.5, 8))
    assert [size for size, _ in curve] == [0.5 * 2 ** 20, 8 * 2 ** 20] and all(rate > 1e6 for _, rate in curve)
    assert cal_module.matmul_rate() > 1e8
    dropout, plain = cal_module.prepare_rates(rows=2_000, width=32)
    assert 1e5 < dropout < plain  # regenerating the dropout mask costs more than the activation alone
    assert cal_module.softmax_rate(rows=2_000) > 1e5
    bandwidth, round_trip = cal_module.zmq_loopback(message_bytes=1 << 20, messages=3, pings=20)
    assert bandwidth > 1e7 and 0 < round_trip < 0.1


def test_attention_rates_are_the_gather_less_its_products(monkeypatch):
    # One product (1e6 entries x width 8) at 8e8/s takes 0.01 s; 8 heads: 0.08 s forward, 0.16 backward.
    timed = iter([1.08, 0.66])  # so the edge work takes 1.0 s and 0.5 s
    monkeypatch.setattr(cal_module, "_median_s", lambda run, repeats=5: next(timed))
    curve = ((1.0, 8e8),)
    forward, backward = cal_module.attention_rates(curve, rows=1_000, nnz=1_000_000)
    assert forward == pytest.approx(8e6 / 1.0) and backward == pytest.approx(8e6 / 0.5)
    # Products priced above the measured time leave the edge work its least share, never <= 0.
    timed = iter([0.05, 0.1])
    forward, backward = cal_module.attention_rates(curve, rows=1_000, nnz=1_000_000)
    assert forward == pytest.approx(8e6 / (cal_module.MIN_EDGE_SHARE * 0.05))
    assert backward == pytest.approx(8e6 / (cal_module.MIN_EDGE_SHARE * 0.1))


def test_attention_rates_are_measured_on_this_machine():
    forward, backward = cal_module.attention_rates(cal_module.gather_curve(rows=2_000, nnz=50_000, operand_mb=(1,)),
                                                   rows=2_000, nnz=50_000)
    assert forward > 1e5 and backward > 1e5


@pytest.mark.slow  # 11 s of real measurement loops; each measurement's formula is tested above
def test_measure_without_emulator_or_runtime(monkeypatch):
    progress = []
    calibration = runtime.measure(progress.append, emulator=False, runtime=False)
    assert calibration.invoke_s is None and calibration.call_s is None and calibration.stage_s == 0
    assert calibration.cores >= 1 and calibration.cpu.matmul_per_s > 0
    assert any("gather" in line for line in progress)


def test_runtime_costs_are_solved_from_measured_runs(monkeypatch):
    # Truth: work takes 2x its kernels' time, 3 ms per stage, 5 ms more per function call.
    model = {"tiny-cpu": (0.01, 10, 4), "medium-cpu": (0.1, 10, 4), "medium-lambda": (0.2, 10, 4)}
    measured = {key: 2 * w + s * 0.003 + (f * 0.005 if key.endswith("lambda") else 0)
                for key, (w, s, f) in model.items()}
    monkeypatch.setattr(runtime, "tiny_dataset", lambda: types.SimpleNamespace(name="tiny", num_nodes=1))
    monkeypatch.setattr(runtime, "medium_dataset", lambda: types.SimpleNamespace(name="medium", num_nodes=2))
    monkeypatch.setattr(runtime, "measured_run", lambda backend, dataset, run_dir: measured[run_dir.name])
    monkeypatch.setattr(runtime, "modelled", lambda run_dir, backend, calibration: model[run_dir.name])
    solved = runtime.overheads(CAL)
    assert solved.contention == pytest.approx(2.0)
    assert solved.stage_s == pytest.approx(0.003)
    assert solved.call_s == pytest.approx(0.005)
    without_lambda = runtime.overheads(CAL, lambda_backend=False)
    assert without_lambda.call_s is None and without_lambda.stage_s == pytest.approx(0.003)
