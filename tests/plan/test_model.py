"""The epoch model's arithmetic on hand-made calibration numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dorylus.cost import DEFAULT_PRICES
from dorylus.errors import ConfigError
from dorylus.plan import environment
from dorylus.plan.calibration import Calibration
from dorylus.plan.catalog import GPUS, WORKLOADS, instance
from dorylus.plan.model import Setup, even_shape, ghost_rows, model_plan, predict, server_memory_bytes, task_work
from dorylus.plan.planner import ScaleOptions, fit_parts, plan_scale
from tests.plan.handmade import RATES

CAL = Calibration(host="test", cores=2, measured_at="2025-01-01T00:00:00", cpu=RATES, loopback_bytes_per_s=2e9,
                  round_trip_s=5e-5, invoke_s=1e-3)
SHAPE = even_shape(vertices=64_000, edges=1_000_000, features=128, classes=16, parts=2, cut_fraction=0.3)


def setup(**changes) -> Setup:
    base = dict(backend="cpu", graph_server="c5.2xlarge", parts=SHAPE.parts, intervals=2, functions=2, hidden=16,
                lambda_memory_mb=1024)
    return Setup(**{**base, **changes})


def local(s: Setup, calibration: Calibration = CAL):
    return predict(SHAPE if s.parts == SHAPE.parts else dataclasses.replace(SHAPE, parts=s.parts), s,
                   environment.local(calibration, s))


def test_gather_rate_interpolates_in_log_bytes():
    assert RATES.gather_per_s(1e5) == 2e9 and RATES.gather_per_s(1e9) == 1e9  # the ends outside
    assert RATES.gather_per_s(1e7) == pytest.approx(1.5e9)  # halfway in log(bytes)
    with pytest.raises(ValueError, match="ascending in bytes"):
        dataclasses.replace(RATES, gather=((2.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="attention_per_s must be"):
        dataclasses.replace(RATES, attention_per_s=(1.0,))


def test_doubling_the_gather_rate_halves_gather_time():
    s = setup(parts=1)
    faster = dataclasses.replace(CAL, cpu=dataclasses.replace(RATES, gather=tuple((b, 2 * r) for b, r in RATES.gather)))
    slow, fast = local(s), local(s, faster)
    for key in ("ga_s", "ga_bwd_s", "ga_eval_s"):
        assert fast.task_s[key] == pytest.approx(slow.task_s[key] / 2)
    assert fast.task_s["av_s"] == pytest.approx(slow.task_s["av_s"])  # nothing else moves


def test_gather_time_is_entries_times_width_over_rate():
    s = setup(parts=1)
    shape = dataclasses.replace(SHAPE, parts=1, ghosts=0, send=0)
    env = environment.local(dataclasses.replace(CAL, cores=1), s)  # one thread: the calibrated rates themselves
    assert env.server == RATES
    p = predict(shape, s, env)
    _, plan = model_plan(shape, s)
    expected = 0.0
    for stage in plan.train:
        if stage.task == "GA":
            width = plan.widths[stage.reads[0]]
            expected += shape.nnz * width / RATES.gather_per_s(4 * width * shape.owned)
    assert p.task_s["ga_s"] == pytest.approx(expected)
    # Two threads: 1 + PARALLEL_EFFICIENCY times the rate.
    two = predict(shape, s, environment.local(CAL, s))
    assert two.task_s["ga_s"] == pytest.approx(expected / (1 + environment.PARALLEL_EFFICIENCY))


def test_local_graph_servers_share_the_cache():
    """A local cluster's P graph servers gather at once through one cache: each Gather at the
    rate of P times its operand; on AWS each server has its own machine."""
    s = setup(parts=2, graph_servers_per_instance=1)
    shape = dataclasses.replace(SHAPE, ghosts=0, send=0)
    one_thread = dataclasses.replace(CAL, cores=2)  # 2 cores for 2 servers: one thread each
    env = environment.local(one_thread, s)
    assert env.cache_sharers == 2 and environment.aws(CAL, s).cache_sharers == 1
    _, plan = model_plan(shape, s)
    widths = [plan.widths[st.reads[0]] for st in plan.train if st.task == "GA"]

    def expected(sharers: int) -> float:  # no ghost rows: each exchange is one round trip
        return sum(shape.nnz * w / RATES.gather_per_s(sharers * 4 * w * shape.owned) + env.round_trip_s
                   for w in widths)

    assert predict(shape, s, env).task_s["ga_s"] == pytest.approx(expected(2))
    assert predict(shape, s, dataclasses.replace(env, cache_sharers=1)).task_s["ga_s"] == pytest.approx(expected(1))
    assert expected(2) > expected(1)  # the curve falls there, so the check can fail


def test_backward_gather_reads_the_owned_rows_only():
    """Gather's operand is [owned; ghost] rows, its transpose's the owned rows' gradients: with
    as many ghosts as owned rows, twice the bytes, at the rate for that size."""
    s = setup(parts=1)
    shape = dataclasses.replace(SHAPE, parts=1, ghosts=SHAPE.owned, send=0)
    p = predict(shape, s, environment.local(dataclasses.replace(CAL, cores=1), s))
    _, plan = model_plan(shape, s)
    for task, rows in (("GA", 2 * shape.owned), ("GA_BWD", shape.owned)):
        expected = sum(shape.nnz * plan.widths[st.reads[0]] / RATES.gather_per_s(4 * plan.widths[st.reads[0]] * rows)
                       for st in plan.train if st.task == task)
        assert p.task_s[f"{task.lower()}_s"] == pytest.approx(expected), task
    assert p.task_s["ga_bwd_s"] < p.task_s["ga_s"]


def test_cost_is_hours_times_price_and_value_is_inverse_time_times_cost():
    p = local(setup(backend="cpu"))
    hourly = DEFAULT_PRICES.ec2_hour_usd
    assert p.cost_by_component_usd["graph_servers"] == pytest.approx(2 * p.epoch_s / 3600 * hourly["c5.2xlarge"],
                                                                     rel=1e-12)
    assert p.cost_by_component_usd["param_server"] == pytest.approx(p.epoch_s / 3600 * hourly["c5.xlarge"], rel=1e-12)
    assert p.cost_by_component_usd["functions"] == 0 and p.calls == 0
    assert p.cost_usd == pytest.approx(sum(p.cost_by_component_usd.values()))
    assert p.value == pytest.approx(1 / (p.epoch_s * p.cost_usd))


@pytest.mark.parametrize("server_stage_ops, per_interval", [
    # AV and AV_BWD of layer 0 (dropout), AV of the evaluation pass (33M multiply-adds on 16,000 rows)
    (None, 3),
    (0, 5),  # and the fused last layer (AV_LOSS) of both passes; BIAS runs on the servers either way
])
def test_lambda_calls_and_their_bill(server_stage_ops, per_interval):
    s = setup(backend="lambda", **({} if server_stage_ops is None else {"server_stage_ops": server_stage_ops}))
    p = local(s)
    assert p.calls == SHAPE.parts * s.intervals * per_interval
    bill = p.billed_gb_s * DEFAULT_PRICES.lambda_gb_s_usd["x86_64"] + p.calls * DEFAULT_PRICES.lambda_request_usd
    assert p.cost_by_component_usd["functions"] == pytest.approx(bill)
    # Billed time excludes the invoke latency and is at least a millisecond per call.
    assert p.billed_gb_s >= p.calls * 0.001 * s.lambda_memory_mb / 1024


def test_a_summed_read_moves_one_row_per_call():
    """GCN's project-first AV_BWD uses dY only for the bias gradient: its function pulls dY's sum,
    one row, so dY adds its width once per call, not per row (dorylus.models.base.Stage.summed)."""
    from dorylus.config import TrainConfig
    from dorylus.models.gcn import build_plan
    from dorylus.models.spec import ModelSpec
    from dorylus.plan.model import call_bytes, row_bytes

    plan = build_plan(ModelSpec.from_config(TrainConfig(model="gcn", hidden=16), 128, 8))
    av_bwd = next(st for st in plan.train if st.key == ("AV_BWD", 0))
    assert av_bwd.summed == ("dY0",)
    per_row = sum(row_bytes(n, plan.widths, 128) for n in av_bwd.reads if n != "dY0")
    one, two = (call_bytes(av_bwd, 0, plan.widths, 128, rows, True) for rows in (1000, 2000))
    assert two - one == pytest.approx(1000 * per_row)
    assert one == pytest.approx(1000 * per_row + 4 * plan.widths["dY0"])


def test_a_call_waits_two_round_trips_whatever_it_moves():
    """Pulls go out together, then pushes together (lambdas.handler), so a call with weights and
    a gradient waits as many round trips as one without; a stage on the graph server (BIAS) waits
    for its weights alone."""
    s = setup(backend="lambda", functions=1, server_stage_ops=0)  # two waves per stage
    slow_link = [dataclasses.replace(CAL, round_trip_s=rtt) for rtt in (1.0, 2.0)]
    near, far = (local(s, cal) for cal in slow_link)
    calls = {"av_s": 2, "av_loss_s": 2, "av_bwd_s": 2, "av_eval_s": 2, "av_loss_eval_s": 2, "bias_s": 1, "bias_eval_s": 1}
    for key, round_trips in calls.items():
        assert far.task_s[key] - near.task_s[key] == pytest.approx(2 * round_trips * 1.0), key


def test_fewer_concurrent_calls_take_more_waves():
    roomy = dataclasses.replace(CAL, cores=8)  # enough cores for every call at once: only the waves differ
    one, two = (local(setup(backend="lambda", functions=f), roomy) for f in (1, 2))
    assert one.task_s["av_s"] == pytest.approx(2 * two.task_s["av_s"], rel=1e-9)
    assert one.task_s["ga_s"] == pytest.approx(two.task_s["ga_s"])
    # On 2 cores, 2 servers x 2 calls share them: each call computes at half speed.
    crowded = local(setup(backend="lambda", functions=2))
    assert crowded.task_s["av_s"] > two.task_s["av_s"]


def test_the_runtime_cost_adds_to_every_stage():
    s = setup()
    _, plan = model_plan(SHAPE, s)
    stages = len(plan.train) + len(plan.evaluate)
    with_cost = local(s, dataclasses.replace(CAL, stage_s=0.01))
    assert with_cost.epoch_s == pytest.approx(local(s).epoch_s + stages * 0.01)
    slower = local(s, dataclasses.replace(CAL, contention=2.0))
    assert slower.task_s["av_s"] == pytest.approx(2 * local(s).task_s["av_s"])


def test_pipe_overlaps_functions_with_graph_work_only_for_lambda():
    for backend in ("lambda", "cpu"):
        sync, pipe = local(setup(backend=backend)), local(setup(backend=backend, mode="pipe"))
        if backend == "lambda":
            assert pipe.epoch_s < sync.epoch_s
        else:
            assert pipe.epoch_s == pytest.approx(sync.epoch_s)


def test_task_work_counts_products_and_dropout():
    spec, plan = model_plan(SHAPE, setup())
    layer0 = spec.layers[0]  # 128 -> 16: projects first, so AV applies layer 0's dropout to X
    av0 = next(st for st in plan.train if st.task == "AV" and st.layer == 0)
    work = task_work(av0, layer0, 1000, training=True)
    assert (work.macs, work.dropout, work.elementwise) == (1000 * 128 * 16, 1000 * 128, 0)
    evaluation = task_work(av0, layer0, 1000, training=False)  # no dropout, no activation on layer 0's input
    assert (evaluation.macs, evaluation.dropout, evaluation.elementwise) == (1000 * 128 * 16, 0, 0)
    backward = task_work(next(st for st in plan.train if st.task == "AV_BWD" and st.layer == 0), layer0, 1000, True)
    assert (backward.macs, backward.dropout) == (1000 * 128 * 16, 1000 * 128)  # dW only: no dX at layer 0
    fused = next(st for st in plan.train if st.task == "AV_LOSS")  # 16 -> 16 gathers first: loss fused
    loss = task_work(fused, spec.layers[1], 1000, training=True)
    assert (loss.macs, loss.softmax) == (3 * 1000 * 16 * 16, 1000 * 16)  # forward, dW, dZ


def test_sage_and_gat_stages_count_their_products():
    """SAGE projects with both halves of its weights; GAT with K heads of F and two scores per head."""
    for model, extra in (("sage", {}), ("gat", {"heads": 4})):
        s = setup(model=model, hidden=8, **extra)
        spec, plan = model_plan(SHAPE, s)
        layer0 = spec.layers[0]  # 128 -> 8 (x 4 heads for gat), dropout on X
        av0 = next(st for st in plan.train if st.task == "AV" and st.layer == 0)
        work = task_work(av0, layer0, 1000, True, model)
        if model == "sage":  # GraphSAGE's defaults have no dropout; S carries the bias (8 adds per row)
            assert (work.macs, work.dropout, work.elementwise) == (2 * 1000 * 128 * 8, 0, 1000 * 8)
        else:
            assert (work.macs, work.dropout, work.elementwise) == (1000 * 128 * 32, 1000 * 128, 2 * 1000 * 32)
        # Every stage of both passes has a formula, and the model's weights are what a call moves.
        for stage in (*plan.train, *plan.evaluate):
            if stage.kind in ("function", "vertex"):
                task_work(stage, spec.layers[stage.layer], 10, True, model)
    with pytest.raises(ConfigError, match="no cost formulas for the model 'nope'"):
        task_work(av0, layer0, 10, True, "nope")


def test_gat_gather_is_a_product_per_head_and_its_edge_work():
    from dorylus.plan.model import gather_seconds

    s = setup(model="gat", hidden=8, heads=4, parts=1, attention_dropout=0.5)
    shape = dataclasses.replace(SHAPE, parts=1, ghosts=0, send=0)
    spec, plan = model_plan(shape, s)
    layer0 = spec.layers[0]
    for kind, products, edge_rate, masks in (("gather", 1, 3e8, 1), ("gather_backward", 2, 1e8, 2)):
        stage = next(st for st in plan.train if st.kind == kind and st.layer == 0)
        product = products * 4 * shape.nnz * 8 / RATES.gather_per_s(4 * 8 * shape.owned)
        edges = shape.nnz * 4 / edge_rate
        mask = masks * shape.nnz * 4 / RATES.dropout_per_s  # attention dropout, while training only
        for training, expected in ((True, product + edges + mask), (False, product + edges)):
            seconds = gather_seconds(stage, layer0, "gat", plan.widths[stage.reads[0]], shape, RATES, training)
            assert seconds == pytest.approx(expected), (kind, training)


def test_ghost_rows_of_a_partition():
    assert ghost_rows(1000, 500, 0) == 0 and ghost_rows(1000, 1000, 50) == 0
    few, many = ghost_rows(1000, 500, 100), ghost_rows(1000, 500, 10_000)
    assert 0 < few < 100 and few < many <= 500  # at most the cut edges, at most the remote vertices
    assert many == pytest.approx(500 * (1 - math.exp(-20)))
    assert even_shape(1000, 5000, 8, 2, parts=1, cut_fraction=0.5).ghosts == 0
    with pytest.raises(ConfigError, match="edge-cut fraction"):
        even_shape(1000, 5000, 8, 2, parts=2, cut_fraction=1.5)


def test_gpu_rates_scale_with_memory_bandwidth_and_flops():
    anchor = environment.anchor_gpu_rates()
    v100, source = environment.gpu_rates(GPUS["V100"], CAL)
    assert "anchor" in source and "V100" in source
    assert v100.gather_per_s(1) == pytest.approx(anchor.gather_per_s(1) * 900 / 3350)
    assert v100.matmul_per_s == pytest.approx(anchor.matmul_per_s * 15.7 / 67.0)
    measured = dataclasses.replace(CAL, gpu=RATES, gpu_name="NVIDIA A100-SXM4-40GB")
    h100, source = environment.gpu_rates(GPUS["H100"], measured)
    assert "calibrated on NVIDIA A100" in source
    assert h100.dropout_per_s == pytest.approx(RATES.dropout_per_s * 3350 / 1555)
    unknown = dataclasses.replace(CAL, gpu=RATES, gpu_name="Mystery GPU 9000")
    with pytest.raises(ConfigError, match="not in the GPU table"):
        environment.gpu_rates(GPUS["V100"], unknown)


def test_parts_are_the_fewest_that_fit():
    friendster = WORKLOADS["friendster"]
    s = Setup(backend="cpu", graph_server="c5n.2xlarge", parts=1, intervals=8, functions=8, hidden=128)
    capacity = 0.8 * instance("c5n.2xlarge").memory_gib * 2 ** 30
    shape = fit_parts(friendster, s, capacity, cut_fraction=0.5)
    assert server_memory_bytes(shape, dataclasses.replace(s, parts=shape.parts)) <= capacity
    fewer = even_shape(friendster.vertices, friendster.edges, friendster.features, friendster.classes,
                       shape.parts - 1, 0.5)
    assert server_memory_bytes(fewer, dataclasses.replace(s, parts=shape.parts - 1)) > capacity


def test_scale_table_prices_three_configurations_per_workload():
    predictions = plan_scale(CAL, ScaleOptions(), ["reddit", "friendster"])
    assert [(p.shape.vertices, p.setup.backend) for p in predictions] == [
        (232_965, "lambda"), (232_965, "cpu"), (232_965, "gpu"),
        (65_608_366, "lambda"), (65_608_366, "cpu"), (65_608_366, "gpu")]
    for p in predictions:
        assert p.epoch_s > 0 and p.value == pytest.approx(1 / (p.epoch_s * p.cost_usd))
        assert (p.calls > 0) == (p.setup.backend == "lambda")
    gpu = predictions[5].setup
    assert gpu.graph_server == "p3.2xlarge" and gpu.instances == gpu.parts  # one V100 per p3.2xlarge
    with pytest.raises(ConfigError, match="unknown workload"):
        plan_scale(CAL, ScaleOptions(), ["orkut"])
    with pytest.raises(ConfigError, match="GPU instance type 'c5.xlarge'"):
        plan_scale(CAL, ScaleOptions(servers=(("gpu", "c5.xlarge"),)), ["reddit"])
