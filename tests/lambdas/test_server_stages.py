"""Which stages the lambda backend runs on its graph server instead of invoking a function.

A stage with element-wise work only and no gradient (GCN's and GAT's BIAS) runs through the cpu
code path on the graph server at any size, and so does one of at most ``server_stage_ops``
multiply-adds, elements and logits on its interval with no dropout mask to regenerate (0: none
but the element-wise ones); everything else is a function call. The backend here has a stand-in
graph server (rows, the parameter server's weights and its gradient sink, the result sink) and an
endpoint nobody listens on, so a stage it tried to invoke would fail.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from dorylus.config import TrainConfig
from dorylus.models import get_model
from dorylus.models.base import FUNCTION, Work
from dorylus.models.ops import TRAIN
from dorylus.models.spec import ModelSpec
from dorylus.protocol import Header, Op
from graphserver.backends.serverless import SERVER_STAGE_OPS, LambdaBackend

FEATURES, CLASSES, ROWS = 128, 7, 5


def _server(model: str, server_stage_ops: int = SERVER_STAGE_OPS, **config):
    spec = ModelSpec.from_config(TrainConfig(model=model, **config), FEATURES, CLASSES)
    rng = np.random.default_rng(0)
    weights = [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in layer.items()}
               for layer in spec.param_shapes()]
    buffers, written, pulls = {}, {}, []

    class ParamServer:
        async def request(self, header, tensors=(), *, timeout):
            pulls.append((header, list(tensors)))
            if header.op is Op.PUSH_GRADS:
                return Header(Op.ACK), []
            assert header.op is Op.PULL_WEIGHTS
            layer = weights[header.layer]
            return (Header(Op.WEIGHTS, layer=header.layer, version=4, names=tuple(layer), meta={"newest": 6}),
                    list(layer.values()))

    def rows(name):
        width = spec.layers[0].output_width
        if name == "labels":
            return buffers.setdefault(name, rng.integers(0, CLASSES, ROWS).astype(np.int64))
        if name == "split":
            return buffers.setdefault(name, np.full(ROWS, TRAIN, np.uint8))  # every row a training row
        return buffers.setdefault(name, rng.standard_normal((ROWS, width)).astype(np.float32))

    state = SimpleNamespace(rows=rows, compute=lambda model, *args: model.compute(*args))
    config = SimpleNamespace(task_timeout_s=5.0, relaunch_min_s=5.0, relaunch_ratio=3.0, fallback_after=1,
                             intervals=1, layers=2, staleness=0, server_stage_ops=server_stage_ops)
    server = SimpleNamespace(part_id=0, spec=spec, plan=get_model(model).build_plan(spec), config=config,
                             state=state, ps=ParamServer(), scheduler=None, write_result=lambda key, r: written.update({key: r}))
    return server, weights, buffers, written, pulls


def _event(stage, model: str, pass_: str = "train") -> dict:
    return {"model": model, "task": stage.task, "layer": stage.layer, "reads": list(stage.reads),
            "writes": list(stage.writes), "weights": stage.weights, "grad": stage.grad and pass_ == "train",
            "args": {**dict(stage.args), "seed": 0, "epoch": 1, "training": pass_ == "train", "train_count": 8},
            "graph_server": "tcp://127.0.0.1:9", "param_server": "tcp://127.0.0.1:9", "part": 0, "interval": 0,
            "rows": [0, ROWS], "epoch": 1, "pass": pass_, "attempt": 0, "run": "test"}


def _here(model: str, config: dict, server_stage_ops: int) -> dict[str, set]:
    server, *_ = _server(model, server_stage_ops, **config)
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    return {pass_: {(s.task, s.layer) for s in stages
                    if s.kind == FUNCTION and backend.runs_on_server(_event(s, model, pass_))}
            for pass_, stages in (("train", server.plan.train), ("eval", server.plan.evaluate))}


@pytest.mark.parametrize("model, config, on_server", [
    ("gcn", {}, {("BIAS", 0)}),  # 128 -> 16 projects first: its bias is added after the Gather
    ("gcn", {"hidden": 256}, set()),  # gathers first: the bias joins the product
    ("gat", {"hidden": 8, "heads": 2}, {("BIAS", 0)}),
    ("sage", {}, set()), ("gin", {}, set()),
])
def test_without_small_stages_only_element_wise_stages_without_a_gradient_run_on_the_graph_server(
        model, config, on_server):
    assert _here(model, config, 0) == {"train": on_server, "eval": on_server}


# At 5 rows every stage is small: those that regenerate a dropout mask while training stay calls.
@pytest.mark.parametrize("model, config, train, evaluate", [
    ("gcn", {}, {("BIAS", 0), ("LOSS", 1)}, {("AV", 0), ("BIAS", 0), ("AV", 1), ("LOSS", 1)}),
    # the layers gather first: their dropout is the graph server's PREP, so no call regenerates it
    ("gcn", {"hidden": 256}, {("AV", 0), ("AV_BWD", 0), ("LOSS", 1)}, {("AV", 0), ("AV", 1), ("LOSS", 1)}),
    ("gin", {}, {("MLP", 0), ("MLP_BWD", 0), ("LOSS", 1)}, {("MLP", 0), ("AV", 0), ("AV", 1), ("LOSS", 1)}),
])
def test_small_stages_without_a_dropout_mask_run_on_the_graph_server(model, config, train, evaluate):
    assert _here(model, config, SERVER_STAGE_OPS) == {"train": train, "eval": evaluate}


@pytest.mark.parametrize("work, grad, small, here", [
    (Work(macs=100, elementwise=50, softmax=10), True, 160, True),  # at the limit
    (Work(macs=100, elementwise=50, softmax=10), True, 159, False),  # one over
    (Work(macs=1, dropout=1), False, 1 << 30, False),  # any dropout mask is a call's
    (Work(elementwise=1 << 40), False, 0, True),  # element-wise only, no gradient: at any size
    (Work(elementwise=1 << 40), True, 1 << 30, False),  # ... but a gradient to push is a call's when large
    (Work(macs=1), False, 0, False),  # 0: no small stage runs here
])
def test_stage_on_server_counts_multiply_adds_elements_and_logits(work, grad, small, here):
    assert LambdaBackend.stage_on_server(work, grad, small) is here


def test_a_stage_is_small_by_its_intervals_rows():
    """The same stage is a call on an interval past ``server_stage_ops``: GCN's fused last layer,
    4 -> 7 wide, costs 105 a row (3 products of 28 multiply-adds, the bias and its gradient 14
    elements, 7 logits)."""
    server, *_ = _server("gcn", 105 * 1000, hidden=4)
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    stage = next(s for s in server.plan.train if s.task == "AV_LOSS")
    assert backend.runs_on_server({**_event(stage, "gcn"), "rows": [0, 1000]})
    assert not backend.runs_on_server({**_event(stage, "gcn"), "rows": [0, 1001]})


def test_a_bias_stage_adds_the_pulled_bias_on_the_graph_server_without_an_invoke():
    server, weights, buffers, written, pulls = _server("gcn", 0)
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    bias = next(s for s in server.plan.train if s.task == "BIAS")

    async def call():
        try:
            return await backend.run(_event(bias, "gcn"), ())
        finally:
            await backend.close()

    meta = asyncio.run(call())
    assert meta == {"version": 4, "weight_lag": 2}
    assert [h.meta["weights"] for h, _ in pulls] == ["pin"]  # pinned, as the function would have
    (key, rows), = written.items()
    assert key == ("train", "BIAS", 0, 1, 0)
    np.testing.assert_array_equal(rows[0], buffers["G0"] + weights[0]["bias"])  # the same float32 add
    stats = backend.take_stats()
    assert stats["invocations"] == 1 and stats["failed_calls"] == 0  # counted as a call, none failed
    assert backend.take_stats()["invocations"] == 0


def test_a_small_stage_with_a_gradient_pushes_it_from_the_graph_server_as_the_function_would():
    """GCN's fused last layer (4 -> 7, gathers first) on 5 rows: the graph server pulls the pinned
    weights, computes what the handler computes, pushes the gradient to the parameter server
    under the call's key and version, and writes ``dZ1``; nothing is invoked."""
    server, weights, buffers, written, pulls = _server("gcn", hidden=4)
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    stage = next(s for s in server.plan.train if s.task == "AV_LOSS")
    event = _event(stage, "gcn")

    async def call():
        try:
            return await backend.run(event, ())
        finally:
            await backend.close()

    meta = asyncio.run(call())
    expected = get_model("gcn").compute("AV_LOSS", 1, [server.state.rows(n) for n in stage.reads], weights[1],
                                        event["args"])
    assert meta == {"version": 4, "weight_lag": 2, **expected.meta}
    (pull, _), (push, grads) = pulls
    assert (pull.op, pull.layer, pull.meta["weights"]) == (Op.PULL_WEIGHTS, 1, "pin")
    assert (push.op, push.layer, push.epoch, push.interval, push.version) == (Op.PUSH_GRADS, 1, 1, 0, 4)
    assert set(push.names) == set(expected.grads) == {"weight", "bias"}
    for name, grad in zip(push.names, grads):
        np.testing.assert_array_equal(grad, expected.grads[name])
    (key, rows), = written.items()
    assert key == ("train", "AV_LOSS", 1, 1, 0) and len(rows) == 1
    np.testing.assert_array_equal(rows[0], expected.rows[0])
    assert backend.take_stats()["invocations"] == 1
